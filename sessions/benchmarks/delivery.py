"""Worker → client delivery overhead with many concurrent streamed sessions (docs/benchmarks-live.md).

Starts a real ASGI server (uvicorn, as the platform runs it) against the benchmark database and the
configured Redis, then for each stream count S: S WebSocket clients in one process, a publisher
doing ``ChunkPublisher``'s per-chunk work in another (``sessions.benchmarks.delivery_clients`` and
``workers.benchmarks.delivery_publisher``),
each session receiving the tiny preset's chunk (4 JPEG frames of 64×64) every 0.5 s. The added delay
of a chunk is the client's receive wall time minus the header's ``generated_at`` (same host, same
clock).

``webrtc_viewers`` (``--webrtc-viewers``): for each stream count, one run per number N of WebRTC
viewers (aiortc peers, ``sessions.benchmarks.webrtc_clients``) on the same web process, beside the
socket clients, the web process then serving ``sessions.benchmarks.loop_lag:application`` (the
deployed application plus a probe of its event loop's lag): each run reports the loop's lag p50/p99
over its measured window beside the socket viewers' added delay. ``webrtc_media``
(``--webrtc-media``): where the peer connections run, ``process`` (a media process beside the web
process, ``manage.py runmedia``, as deployed; its CPU reported too) or ``inline`` (in the web process).
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import time
import uuid
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import psutil
import redis
from django.conf import settings
from django.contrib.auth import get_user_model
from django.db import close_old_connections
from rest_framework.authtoken.models import Token

from contracts.bench import machine_load, summarize
from gpu.models import GpuWorker
from sessions.benchmarks.delivery_clients import delivery_figures
from sessions.models import ChunkRecord, GenerationSession
from workers.benchmarks.live import (
    BENCH_BROKER_DB,
    ProcessGroup,
    bench_sessions,
    check_redis,
    database_url,
    free_port,
    port_open,
    redis_url_with_db,
    use_bench_database,
    wait_until,
)

TARGET_P99_MS = 10.0
DEFAULT_SHAPE = {"width": 64, "height": 64, "frames": 4, "codec": "jpeg", "content": "photo"}
TARGET_STREAMS = 200
CLIENTS_MODULE = "sessions.benchmarks.delivery_clients"
WEBRTC_CLIENTS_MODULE = "sessions.benchmarks.webrtc_clients"
DEPLOYED_APP = "controlplane.asgi:application"
LOOP_LAG_APP = "sessions.benchmarks.loop_lag:application"
PUBLISHER_MODULE = "workers.benchmarks.delivery_publisher"


def run_delivery(
    *,
    streams: Sequence[int],
    chunks: int,
    warmup: int,
    period: float,
    database: str | None,
    channel_layer: str,
    asgi_app: str,
    publishers: int,
    keep_logs: str | None,
    say: Callable[[str], Any],
    shape: dict[str, Any] | None = None,
    webrtc_viewers: Sequence[int] = (),
    webrtc_media: str = "process",
    chunk_sample_rate: float | None = None,
) -> dict[str, Any]:
    """``chunk_sample_rate``: tracing on in the server and publisher processes (None: off, the
    deployment default), exporting to an OTLP receiver in this process (``contracts.otlp_sink``),
    that share of the chunks traced. ``shape``: each chunk's ``width``, ``height``, ``frames``, the viewers' ``codec`` and the
    frames' ``content`` (default the tiny preset's: 64×64, 4 frames, JPEG, of the panned photograph;
    ``workers.benchmarks.content``). The whole benchmark; raises ``ServiceUnavailable`` when PostgreSQL or Redis does not answer."""
    check_redis(settings.REDIS_URL)
    db = use_bench_database(database)
    run = uuid.uuid4().hex[:8]
    viewer_counts = list(webrtc_viewers) or [None]
    if webrtc_viewers:
        if asgi_app != DEPLOYED_APP:
            raise ValueError("--webrtc-viewers measures the deployed application: leave --asgi-app out")
        asgi_app = LOOP_LAG_APP
    token, worker_id, session_ids = _create_rows(run, sum(streams) * len(viewer_counts))
    tmp = Path(tempfile.mkdtemp(prefix="bench-delivery-"))
    lag_file = tmp / "loop-lag.jsonl" if webrtc_viewers else None
    port = free_port()
    env = {
        **os.environ,
        "DATABASE_URL": database_url(db, db["NAME"]),
        "REDIS_URL": settings.REDIS_URL,
        "CELERY_BROKER_URL": redis_url_with_db(settings.REDIS_URL, BENCH_BROKER_DB),
        "PYTHONUNBUFFERED": "1",
        "LOG_LEVEL": os.environ.get("BENCH_LOG_LEVEL", "WARNING"),
        "WEBRTC_MEDIA": webrtc_media,
    }
    if lag_file is not None:
        env["BENCH_LOOP_LAG_FILE"] = str(lag_file)
    env = {k: v for k, v in env.items() if not k.startswith("OTEL_")}
    sink = None
    if chunk_sample_rate is not None:
        # Only when tracing is on: off, no OpenTelemetry module is imported (docs/observability.md).
        from contracts.otlp_sink import OtlpSink

        sink = OtlpSink()
        env |= {
            "OTEL_ENABLED": "true",
            "OTEL_EXPORTER_OTLP_ENDPOINT": sink.endpoint,
            "OTEL_CHUNK_SAMPLE_RATE": str(chunk_sample_rate),
        }
    if channel_layer == "pubsub":
        # A settings overlay in the run's temporary folder: the deployed settings, another layer.
        (tmp / "bench_pubsub_settings.py").write_text(
            "from controlplane.settings import *  # noqa: F403\n"
            "CHANNEL_LAYERS = {'default': {'BACKEND': 'channels_redis.pubsub.RedisPubSubChannelLayer',"
            " 'CONFIG': {'hosts': [REDIS_URL], 'prefix': 'benchps'}}}  # noqa: F405\n"
        )
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(tmp), env.get("PYTHONPATH", "")]))
        env["DJANGO_SETTINGS_MODULE"] = "bench_pubsub_settings"
    publishers = max(publishers, 1)
    shape = {**DEFAULT_SHAPE, **(shape or {})}
    results = []
    try:
        with ProcessGroup(tmp, env, Path(settings.BASE_DIR)) as processes:
            processes.spawn(
                "web",
                "-m",
                "uvicorn",
                asgi_app,
                "--port",
                str(port),
                "--ws",
                "websockets-sansio",
                "--no-access-log",
                "--log-level",
                "warning",
            )
            wait_until(lambda: port_open(port), 60, "the ASGI server", alive=processes.dead)
            say(f"uvicorn on :{port}, database {db['NAME']}, Redis {settings.REDIS_URL}")
            if webrtc_viewers and webrtc_media == "process":
                processes.spawn("media", "manage.py", "runmedia")
                wait_until(
                    lambda: b"serving WebRTC" in (processes.log_dir / "media.log").read_bytes(),
                    60,
                    "the media process",
                    alive=processes.dead,
                )
                say("media process up (WebRTC peer connections run there)")
            offset = 0
            for count in streams:  # fresh sessions per run: chunk indices start at 0 again
                for viewers in viewer_counts:
                    with_webrtc = "" if viewers is None else f" + {viewers} WebRTC viewers"
                    say(f"{count} streams{with_webrtc} × {chunks} chunks, one every {period} s …")
                    results.append(
                        _measure(
                            processes,
                            tmp,
                            port,
                            token,
                            worker_id,
                            session_ids[offset : offset + count],
                            chunks,
                            warmup,
                            period,
                            publishers,
                            shape,
                            webrtc_viewers=viewers,
                            lag_file=lag_file,
                        )
                    )
                    offset += count
                    say(format_run(results[-1]))
            if keep_logs:
                shutil.copytree(tmp, keep_logs, dirs_exist_ok=True)
    finally:
        _delete_rows(run)
        if sink is not None:
            sink.stop()
    at_target = [r for r in results if r["streams"] == TARGET_STREAMS]
    return {
        "benchmark": "delivery",
        "database": db["NAME"],
        "chunks_per_stream": chunks,
        "warmup_chunks": warmup,
        "period_s": period,
        "channel_layer": channel_layer,
        "asgi_app": asgi_app,
        "publishers": publishers,
        "shape": shape,
        "webrtc_viewers": list(webrtc_viewers),
        "webrtc_media": webrtc_media if webrtc_viewers else None,
        # Spans the processes exported, by name (None: tracing off). A process exports its last
        # batch as it stops: the server's may be missing.
        "tracing": None
        if sink is None
        else {"chunk_sample_rate": chunk_sample_rate, "spans_received": sink.names()},
        "runs": results,
        "target_p99_ms": TARGET_P99_MS,
        "target_streams": TARGET_STREAMS,
        "target_met": (at_target[0]["added_delay_ms"]["p99"] <= TARGET_P99_MS) if at_target else None,
    }


def format_verdict(report: dict[str, Any]) -> str:
    """The closing lines (each run's figures are printed as it ends): the spans exported with tracing
    on, and the verdict (none without a run at the target)."""
    lines = []
    if report["tracing"] is not None:
        tracing = report["tracing"]
        lines.append(
            f"tracing on, chunk sample rate {tracing['chunk_sample_rate']}: spans {tracing['spans_received']}"
        )
    if report["target_met"] is not None:
        verdict = "met" if report["target_met"] else "MISSED"
        lines.append(f"target p99 added delay <= {TARGET_P99_MS} ms at {TARGET_STREAMS} streams: {verdict}")
    return "\n".join(lines)


def format_run(result: dict[str, Any]) -> str:
    a, s, c = result["added_delay_ms"], result["server_delivery_ms"], result["socket_to_client_ms"]
    if not a.get("count"):
        return (
            f"  {result['streams']:4d} streams: no chunk reached a client (expected {result['expected']},"
            f" lost {result['lost']}); load average {result['load_after']['loadavg']}"
        )
    late = result["publisher"]["late_ms_p99_max"]
    extra = ""
    if result.get("webrtc") is not None:
        w = result["webrtc"]
        extra += (
            f"\n        WebRTC viewers {w['connected']}/{w['viewers']} connected, pictures"
            f" {w['pictures_received']}/{w['pictures_expected']}, chunks sent {w['chunks_announced']},"
            f" skipped {w['skipped']}{(', errors ' + '; '.join(w['errors'])) if w['errors'] else ''}"
        )
    if result.get("media_cpu_s") is not None:
        extra += (
            f"\n        media process CPU s {result['media_cpu_s']}"
            f" ({result['media_cpu_core_share']:.0%} of a core)"
        )
    if result.get("loop_lag_ms") is not None:
        lag = result["loop_lag_ms"]
        extra += (
            f"\n        web process event loop lag ms p50 {lag.get('p50', 0):.2f}  p99 {lag.get('p99', 0):.2f}"
            f"  max {lag.get('max', 0):.2f} (n={lag.get('count', 0)})"
        )
    return (
        f"  {result['streams']:4d} streams: added delay ms p50 {a['p50']:.2f}  p99 {a['p99']:.2f}"
        f"  max {a['max']:.2f}  (n={a['count']}, {result['within_10ms']:.1%} within 10 ms)\n"
        f"        of which generated_at → consumer send p50 {s['p50']:.2f} p99 {s['p99']:.2f};"
        f" send → client p50 {c['p50']:.2f} p99 {c['p99']:.2f}\n"
        f"        received {result['received']}/{result['expected']}, lost {result['lost']},"
        f" skipped {result['skipped']}; publisher behind schedule p99 {late:.1f} ms;"
        f" mean chunk {result['chunk_bytes_mean']} B\n"
        f"        Redis MB/s in {result['redis_bytes_per_s']['in'] / 1e6:.1f} out"
        f" {result['redis_bytes_per_s']['out'] / 1e6:.1f}\n"
        f"        CPU s: server {result['server_cpu_s']} ({result['server_cpu_core_share']:.0%} of a core,"
        f" {result['server_cpu_ms_per_chunk']} ms/chunk incl. connects), clients {result['clients_cpu_s']},"
        f" publisher {result['publisher']['cpu_s']}\n"
        f"        load average {result['load_before']['loadavg']} → {result['load_after']['loadavg']}"
        f" on {result['load_before']['cpus']} CPUs{extra}"
    )


def _measure(
    processes: ProcessGroup,
    tmp: Path,
    port: int,
    token: str,
    worker_id: int,
    session_ids: list[str],
    chunks: int,
    warmup: int,
    period: float,
    publishers: int = 1,
    shape: dict[str, Any] | None = None,
    *,
    webrtc_viewers: int | None = None,
    lag_file: Path | None = None,
) -> dict[str, Any]:
    shape = {**DEFAULT_SHAPE, **(shape or {})}
    tag = f"s{len(session_ids)}-w{webrtc_viewers or 0}-{int(time.time())}"
    sessions_file = tmp / f"{tag}-sessions.json"
    sessions_file.write_text(json.dumps(session_ids))
    ready, client_out = tmp / f"{tag}.ready", tmp / f"{tag}-clients.json"
    load_before = machine_load()
    server = psutil.Process(processes.processes["web"].pid)
    media = psutil.Process(processes.processes["media"].pid) if "media" in processes.processes else None
    media_cpu_before = sum(media.cpu_times()[:2]) if media is not None else 0.0
    redis_client = redis.Redis.from_url(settings.REDIS_URL)
    redis_net_before = _redis_net_bytes(redis_client)
    server_cpu_before, began = sum(server.cpu_times()[:2]), time.monotonic()
    webrtc_out, webrtc_stop = tmp / f"{tag}-webrtc.json", tmp / f"{tag}-webrtc.stop"
    if webrtc_viewers:
        webrtc_ready = tmp / f"{tag}-webrtc.ready"
        processes.spawn(
            f"{tag}-webrtc",
            "-m",
            WEBRTC_CLIENTS_MODULE,
            "--sessions-file",
            str(sessions_file),
            "--viewers",
            str(webrtc_viewers),
            "--base-url",
            f"ws://127.0.0.1:{port}",
            "--token",
            token,
            "--ready-file",
            str(webrtc_ready),
            "--stop-file",
            str(webrtc_stop),
            "--out",
            str(webrtc_out),
            service=False,
        )
        wait_until(
            webrtc_ready.exists, 180, f"{webrtc_viewers} WebRTC viewers to connect", alive=processes.dead
        )
    processes.spawn(
        f"{tag}-clients",
        "-m",
        CLIENTS_MODULE,
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
        # The publisher encodes its chunks after the clients are ready (seconds at 832×480 on a
        # loaded core): the deadline leaves it that, and a late chunk shows in the delay figures.
        str(chunks * period + 30),
        "--codec",
        shape["codec"],
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
            "-m",
            PUBLISHER_MODULE,
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
            "--width",
            str(shape["width"]),
            "--height",
            str(shape["height"]),
            "--frames",
            str(shape["frames"]),
            "--codec",
            shape["codec"],
            "--content",
            shape["content"],
            service=False,
        )
    wait_until(
        lambda: client_out.exists() and all(o.exists() for o in outs),
        chunks * period + 60,
        f"the {len(session_ids)}-stream run to finish",
        interval=0.5,
        alive=processes.dead,
    )
    measured_until = time.time()
    server_cpu = sum(server.cpu_times()[:2]) - server_cpu_before
    media_cpu = sum(media.cpu_times()[:2]) - media_cpu_before if media is not None else None
    wall = time.monotonic() - began
    webrtc = None
    if webrtc_viewers:
        time.sleep(2 * period)  # the last chunk's pictures are paced over one period after it arrives
        webrtc_stop.write_text("stop")
        wait_until(webrtc_out.exists, 60, "the WebRTC viewers to report", alive=processes.dead)
        processes.processes.pop(f"{tag}-webrtc").wait(timeout=10)
        webrtc = json.loads(webrtc_out.read_text())
        # Less one per peer: aiortc's jitter buffer completes a picture when the next one's first
        # packet arrives, so each peer's last picture stays there.
        webrtc["pictures_expected"] = webrtc_viewers * (chunks * shape["frames"] - 1)
    # The loop's lag over the measured chunks (after the warm-up ones), as the delays are counted.
    loop_lag = None
    if lag_file is not None:
        time.sleep(2 * 0.5)  # the probe's last samples flushed (loop_lag.FLUSH_S)
        loop_lag = summarize(_lag_samples(lag_file, start_at + warmup * period, measured_until))
    redis_net = _redis_net_bytes(redis_client)
    redis_bytes_per_s = {k: round((redis_net[k] - redis_net_before[k]) / wall) for k in redis_net}
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
        "fragment_bytes": runs[0].get("fragment_bytes"),
        "each": runs,
    }
    return {
        "streams": len(session_ids),
        "webrtc_viewers": webrtc_viewers,
        "webrtc": webrtc,
        "loop_lag_ms": loop_lag,
        **figures,
        # The ASGI server's CPU over the phase (connects included): share of one core, per chunk.
        "server_cpu_s": round(server_cpu, 3),
        "server_cpu_core_share": round(server_cpu / wall, 3),
        "server_cpu_ms_per_chunk": round(1000.0 * server_cpu / max(figures["received"], 1), 3),
        # The media process's (WebRTC peer connections) over the same phase, when one runs.
        "media_cpu_s": round(media_cpu, 3) if media_cpu is not None else None,
        "media_cpu_core_share": round(media_cpu / wall, 3) if media_cpu is not None else None,
        # The whole Redis server's network bytes over the phase (in: written to it, out: read from
        # it), connects and the clients' setup included: exact only on a Redis nobody else uses.
        "redis_bytes_per_s": redis_bytes_per_s,
        "publisher": publisher,
        "load_before": load_before,
        "load_after": machine_load(),
    }


def _lag_samples(path: Path, since: float, until: float) -> list[float]:
    """The loop-lag probe's samples (ms, ``sessions.benchmarks.loop_lag``) taken between ``since`` and
    ``until`` (wall clock)."""
    lags = []
    with path.open(encoding="utf-8") as lines:
        for line in lines:
            lags.extend(lag for at, lag in json.loads(line) if since <= at <= until)
    return lags


def _redis_net_bytes(client: redis.Redis) -> dict[str, int]:
    stats = client.info("stats")
    return {"in": int(stats["total_net_input_bytes"]), "out": int(stats["total_net_output_bytes"])}


def _create_rows(run: str, count: int) -> tuple[str, int, list[str]]:
    label = f"bench-delivery-{run}"
    try:
        user = get_user_model().objects.create(username=label)
        token = Token.objects.create(user=user).key
        worker, sessions = bench_sessions(label=label, owner=user, count=count)
    except Exception:
        _delete_rows(run)
        raise
    return token, worker.pk, [str(s.pk) for s in sessions]


def _delete_rows(run: str) -> None:
    label = f"bench-delivery-{run}"
    close_old_connections()
    sessions = GenerationSession.objects.filter(owner__username=label)
    ChunkRecord.objects.filter(session__in=sessions).delete()
    sessions.delete()
    GpuWorker.objects.filter(name=label).delete()
    get_user_model().objects.filter(username=label).delete()  # its token goes with it
