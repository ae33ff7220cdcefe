"""Worker → client delivery overhead with many concurrent streamed sessions (docs/benchmarks-live.md).

Starts a real ASGI server (uvicorn, as the platform runs it) against the benchmark database and the
configured Redis, then for each stream count S: S WebSocket clients in one process, a publisher
doing ``ChunkPublisher``'s per-chunk work in another, each session receiving the tiny preset's
chunk (4 JPEG frames of 64×64) every 0.5 s. The added delay of a chunk is the client's receive wall
time minus the header's ``generated_at`` (same host, same clock).
"""

from __future__ import annotations

import json
import os
import tempfile
import time
import uuid
from pathlib import Path

import psutil
from django.conf import settings
from django.core.management.base import BaseCommand, CommandError

from sessions.benchdelivery import delivery_figures
from workers.benchlive import (
    BENCH_BROKER_DB,
    ProcessGroup,
    ServiceUnavailable,
    bench_sessions,
    check_redis,
    database_url,
    dumps,
    free_port,
    machine_load,
    port_open,
    redis_url_with_db,
    use_bench_database,
    wait_until,
)

TARGET_P99_MS = 10.0
TARGET_STREAMS = 200


class Command(BaseCommand):
    help = "Benchmark worker → channel layer → WebSocket delivery delay with S concurrent streams."

    def add_arguments(self, parser):
        parser.add_argument(
            "--streams", default="50,200", help="comma-separated stream counts (default 50,200)"
        )
        parser.add_argument(
            "--chunks-per-stream", type=int, default=40, help="chunks per stream (default 40)"
        )
        parser.add_argument("--warmup", type=int, default=2, help="first chunks of each stream not counted")
        parser.add_argument(
            "--period", type=float, default=0.5, help="seconds between a stream's chunks (tiny: 0.5)"
        )
        parser.add_argument(
            "--database",
            default=None,
            help="database on the configured server (default <configured name>_bench, created and migrated)",
        )
        parser.add_argument(
            "--channel-layer",
            choices=("configured", "pubsub"),
            default="configured",
            help="configured: settings.CHANNEL_LAYERS as deployed; pubsub: the same Redis through"
            " channels_redis.pubsub.RedisPubSubChannelLayer (a settings overlay for the server and publisher"
            " only, to compare)",
        )
        parser.add_argument(
            "--asgi-app",
            default="controlplane.asgi:application",
            help="ASGI application uvicorn serves (to compare a patched consumer; default the deployed one)",
        )
        parser.add_argument("--publishers", type=int, default=1, help="publisher processes (like workers)")
        parser.add_argument("--keep-logs", default=None, help="copy the processes' logs to this folder")
        parser.add_argument("--json", action="store_true", help="print one JSON object only")

    def handle(self, *args, **options):
        try:
            streams = [int(s) for s in options["streams"].split(",") if s.strip()]
        except ValueError as exc:
            raise CommandError(f"--streams: {exc}") from exc
        chunks, warmup = options["chunks_per_stream"], options["warmup"]
        if not streams or min(streams) < 1 or chunks < 1 or warmup < 0 or warmup >= chunks:
            raise CommandError("--streams must be positive counts and 0 <= --warmup < --chunks-per-stream")
        try:
            check_redis(settings.REDIS_URL)
            db = use_bench_database(options["database"])
        except ServiceUnavailable as exc:
            raise CommandError(str(exc)) from exc
        say = (lambda *_: None) if options["json"] else self.stdout.write
        run = uuid.uuid4().hex[:8]
        token, worker_id, session_ids = self._create_rows(run, sum(streams))
        tmp = Path(tempfile.mkdtemp(prefix="bench-delivery-"))
        port = free_port()
        env = {
            **os.environ,
            "DATABASE_URL": database_url(db, db["NAME"]),
            "REDIS_URL": settings.REDIS_URL,
            "CELERY_BROKER_URL": redis_url_with_db(settings.REDIS_URL, BENCH_BROKER_DB),
            "PYTHONUNBUFFERED": "1",
            "LOG_LEVEL": "WARNING",
        }
        if options["channel_layer"] == "pubsub":
            # A settings overlay in the run's temporary folder: the deployed settings, another layer.
            (tmp / "bench_pubsub_settings.py").write_text(
                "from controlplane.settings import *  # noqa: F403\n"
                "CHANNEL_LAYERS = {'default': {'BACKEND': 'channels_redis.pubsub.RedisPubSubChannelLayer',"
                " 'CONFIG': {'hosts': [REDIS_URL], 'prefix': 'benchps'}}}  # noqa: F405\n"
            )
            env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(tmp), env.get("PYTHONPATH", "")]))
            env["DJANGO_SETTINGS_MODULE"] = "bench_pubsub_settings"
        publishers = max(options["publishers"], 1)
        results = []
        try:
            with ProcessGroup(tmp, env, Path(settings.BASE_DIR)) as processes:
                processes.spawn(
                    "web",
                    "-m",
                    "uvicorn",
                    options["asgi_app"],
                    "--port",
                    str(port),
                    "--ws",
                    "websockets",
                    "--no-access-log",
                    "--log-level",
                    "warning",
                )
                wait_until(lambda: port_open(port), 60, "the ASGI server", alive=processes.dead)
                say(f"uvicorn on :{port}, database {db['NAME']}, Redis {settings.REDIS_URL}")
                offset = 0
                for count in streams:  # fresh sessions per count: chunk indices start at 0 again
                    say(f"{count} streams × {chunks} chunks, one every {options['period']} s …")
                    results.append(
                        self._measure(
                            processes,
                            tmp,
                            port,
                            token,
                            worker_id,
                            session_ids[offset : offset + count],
                            chunks,
                            warmup,
                            options["period"],
                            publishers,
                        )
                    )
                    offset += count
                    say(self._line(results[-1]))
                if options["keep_logs"]:
                    import shutil

                    shutil.copytree(tmp, options["keep_logs"], dirs_exist_ok=True)
        finally:
            self._delete_rows(run)
        at_target = [r for r in results if r["streams"] == TARGET_STREAMS]
        report = {
            "benchmark": "delivery",
            "database": db["NAME"],
            "chunks_per_stream": chunks,
            "warmup_chunks": warmup,
            "period_s": options["period"],
            "channel_layer": options["channel_layer"],
            "asgi_app": options["asgi_app"],
            "publishers": publishers,
            "runs": results,
            "target_p99_ms": TARGET_P99_MS,
            "target_streams": TARGET_STREAMS,
            "target_met": (at_target[0]["added_delay_ms"]["p99"] <= TARGET_P99_MS) if at_target else None,
        }
        if options["json"]:
            self.stdout.write(dumps(report))
        elif at_target:
            verdict = "met" if report["target_met"] else "MISSED"
            self.stdout.write(
                f"target p99 added delay <= {TARGET_P99_MS} ms at {TARGET_STREAMS} streams: {verdict}"
            )

    def _measure(
        self, processes, tmp, port, token, worker_id, session_ids, chunks, warmup, period, publishers=1
    ) -> dict:
        tag = f"s{len(session_ids)}-{int(time.time())}"
        sessions_file = tmp / f"{tag}-sessions.json"
        sessions_file.write_text(json.dumps(session_ids))
        ready, client_out = tmp / f"{tag}.ready", tmp / f"{tag}-clients.json"
        common = ["-m", "sessions.benchdelivery"]
        load_before = machine_load()
        server = psutil.Process(processes.processes["web"].pid)
        server_cpu_before, began = sum(server.cpu_times()[:2]), time.monotonic()
        processes.spawn(
            f"{tag}-clients",
            *common,
            "clients",
            "--sessions-file",
            str(sessions_file),
            "--out",
            str(client_out),
            "--chunks",
            str(chunks),
            "--base-url",
            f"ws://127.0.0.1:{port}",
            "--token",
            token,
            "--ready-file",
            str(ready),
            "--timeout",
            str(chunks * period + 10),
            service=False,
        )
        wait_until(ready.exists, 90, f"{len(session_ids)} WebSocket clients to connect", alive=processes.dead)
        start_at = time.time() + 1.0
        outs = []
        for p in range(publishers):  # session i goes to publisher i mod P, as sessions spread over workers
            part = tmp / f"{tag}-sessions-{p}.json"
            part.write_text(json.dumps(session_ids[p::publishers]))
            outs.append(tmp / f"{tag}-pub-{p}.json")
            processes.spawn(
                f"{tag}-publisher-{p}",
                *common,
                "publisher",
                "--sessions-file",
                str(part),
                "--out",
                str(outs[-1]),
                "--chunks",
                str(chunks),
                "--period",
                str(period),
                "--start-at",
                str(start_at),
                "--phase",
                str(p / publishers),
                "--worker-id",
                str(worker_id),
                service=False,
            )
        wait_until(
            lambda: client_out.exists() and all(o.exists() for o in outs),
            chunks * period + 60,
            f"the {len(session_ids)}-stream run to finish",
            interval=0.5,
            alive=processes.dead,
        )
        server_cpu = sum(server.cpu_times()[:2]) - server_cpu_before
        wall = time.monotonic() - began
        processes.processes.pop(f"{tag}-clients").wait(timeout=10)
        for p in range(publishers):
            processes.processes.pop(f"{tag}-publisher-{p}").wait(timeout=10)
        figures = delivery_figures(json.loads(client_out.read_text()), chunks=chunks, warmup=warmup)
        runs = [json.loads(o.read_text()) for o in outs]
        publisher = {
            "processes": publishers,
            "published": sum(r["published"] for r in runs),
            "cpu_s": round(sum(r["cpu_s"] for r in runs), 3),
            "late_ms_p99_max": max(r["late_ms"]["p99"] for r in runs),
            "publish_call_ms_p99_max": max(r["publish_call_ms"]["p99"] for r in runs),
            "frame_bytes": runs[0]["frame_bytes"],
            "each": runs,
        }
        return {
            "streams": len(session_ids),
            **figures,
            # The ASGI server's CPU over the phase (connects included): share of one core, per chunk.
            "server_cpu_s": round(server_cpu, 3),
            "server_cpu_core_share": round(server_cpu / wall, 3),
            "server_cpu_ms_per_chunk": round(1000.0 * server_cpu / max(figures["received"], 1), 3),
            "publisher": publisher,
            "load_before": load_before,
            "load_after": machine_load(),
        }

    @staticmethod
    def _line(result: dict) -> str:
        a, s, c = result["added_delay_ms"], result["server_delivery_ms"], result["socket_to_client_ms"]
        late = result["publisher"]["late_ms_p99_max"]
        return (
            f"  {result['streams']:4d} streams: added delay ms p50 {a['p50']:.2f}  p99 {a['p99']:.2f}"
            f"  max {a['max']:.2f}  (n={a['count']}, {result['within_10ms']:.1%} within 10 ms)\n"
            f"        of which generated_at → consumer send p50 {s['p50']:.2f} p99 {s['p99']:.2f};"
            f" send → client p50 {c['p50']:.2f} p99 {c['p99']:.2f}\n"
            f"        received {result['received']}/{result['expected']}, lost {result['lost']},"
            f" skipped {result['skipped']}; publisher behind schedule p99 {late:.1f} ms;"
            f" mean chunk {result['chunk_bytes_mean']} B\n"
            f"        CPU s: server {result['server_cpu_s']} ({result['server_cpu_core_share']:.0%} of a core,"
            f" {result['server_cpu_ms_per_chunk']} ms/chunk incl. connects), clients {result['clients_cpu_s']},"
            f" publisher {result['publisher']['cpu_s']}\n"
            f"        load average {result['load_before']['loadavg']} → {result['load_after']['loadavg']}"
            f" on {result['load_before']['cpus']} CPUs"
        )

    def _create_rows(self, run: str, count: int) -> tuple[str, int, list[str]]:
        from django.contrib.auth import get_user_model
        from rest_framework.authtoken.models import Token

        label = f"bench-delivery-{run}"
        try:
            user = get_user_model().objects.create(username=label)
            token = Token.objects.create(user=user).key
            worker, sessions = bench_sessions(label=label, owner=user, count=count)
        except Exception:
            self._delete_rows(run)
            raise
        return token, worker.pk, [str(s.pk) for s in sessions]

    def _delete_rows(self, run: str) -> None:
        from django.contrib.auth import get_user_model
        from django.db import close_old_connections

        from gpu.models import GpuWorker
        from sessions.models import ChunkRecord, GenerationSession

        label = f"bench-delivery-{run}"
        close_old_connections()
        sessions = GenerationSession.objects.filter(owner__username=label)
        ChunkRecord.objects.filter(session__in=sessions).delete()
        sessions.delete()
        GpuWorker.objects.filter(name=label).delete()
        get_user_model().objects.filter(username=label).delete()  # its token goes with it
