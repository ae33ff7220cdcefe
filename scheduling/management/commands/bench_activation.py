"""Activation → first chunk, and the control plane's share of it (docs/benchmarks-live.md).

Starts the platform against the benchmark database — uvicorn, a Celery worker and beat (on their own
broker database), and ``--workers`` local CPU workers provisioned by the scheduler itself
(min = max GPUs) — and waits until the workers are ready and have served ``--warmup`` sessions, so
provisioning and first-forward warm-up are excluded. Then, one at a time with a pause:

- t0: the REST create call starts (token auth); the WebSocket is opened as soon as it returns the id;
- t_decision: ``SchedulerDecision.decided_at`` of the run that sent the session's start command;
- t_command: that ``WorkerCommand.created_at``; t_ack: its ``answered_at``;
- t_first: the first chunk frame arrives on the socket (then the session is terminated).

Control-plane share = t_ack − t0; model share = the first chunk's ``generation_ms``.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import tempfile
import time
import uuid
from pathlib import Path

from django.conf import settings
from django.core.management.base import BaseCommand, CommandError

from workers.benchlive import (
    BENCH_BROKER_DB,
    BENCH_REDIS_DB,
    ProcessGroup,
    ServiceUnavailable,
    check_redis,
    database_url,
    dumps,
    free_port,
    machine_load,
    port_open,
    redis_url_with_db,
    summarize,
    use_bench_database,
    wait_until,
)
from workers.streaming import decode_chunk_frame

COMPONENTS = (
    ("api_ms", "create call (REST) returns"),
    ("to_decision_ms", "t0 → scheduler decision starts (API + Celery hand-off)"),
    ("decision_to_command_ms", "decision start → start command written (scheduling)"),
    ("command_to_ack_ms", "command written → worker's answer recorded (delivery + chunk boundary)"),
    ("control_plane_ms", "t0 → ack (control plane's share)"),
    ("generation_ms", "first chunk's generation (model's share)"),
    ("first_chunk_ms", "t0 → first chunk on the socket"),
    ("delivery_ms", "first chunk's generated_at → socket receive"),
)


def components(sample: dict) -> dict:
    """Per-session component durations in ms from the raw timestamps (epoch seconds)."""
    t0 = sample["t0"]
    out = {
        "api_ms": (sample["t_created"] - t0) * 1000.0,
        "to_decision_ms": (sample["t_decision"] - t0) * 1000.0,
        "decision_to_command_ms": (sample["t_command"] - sample["t_decision"]) * 1000.0,
        "command_to_ack_ms": (sample["t_ack"] - sample["t_command"]) * 1000.0,
        "control_plane_ms": (sample["t_ack"] - t0) * 1000.0,
        "generation_ms": sample["generation_ms"],
        "first_chunk_ms": (sample["t_first"] - t0) * 1000.0,
        "delivery_ms": (sample["t_first"] - sample["generated_at"]) * 1000.0,
    }
    return {k: round(v, 3) for k, v in out.items()}


class Command(BaseCommand):
    help = "Benchmark activation → first chunk with the control plane's share (real platform processes)."

    def add_arguments(self, parser):
        parser.add_argument("--sessions", type=int, default=20, help="measured activations (default 20)")
        parser.add_argument("--warmup", type=int, default=2, help="activations before measuring (default 2)")
        parser.add_argument("--workers", type=int, default=2, help="local CPU workers kept ready (default 2)")
        parser.add_argument(
            "--pause", type=float, default=1.0, help="seconds between activations (default 1)"
        )
        parser.add_argument(
            "--database",
            default=None,
            help="database on the configured server (default <configured name>_bench, created and migrated)",
        )
        parser.add_argument(
            "--redis-db",
            type=int,
            default=BENCH_REDIS_DB,
            help=f"Redis database of the platform's channel layer, cache and scheduler lock (default {BENCH_REDIS_DB})",
        )
        parser.add_argument(
            "--ready-timeout", type=float, default=240.0, help="seconds to wait for ready workers"
        )
        parser.add_argument("--keep-logs", default=None, help="copy the processes' logs to this folder")
        parser.add_argument("--json", action="store_true", help="print one JSON object only")

    def handle(self, *args, **options):
        n, warmup, n_workers = options["sessions"], options["warmup"], options["workers"]
        if n < 1 or warmup < 0 or n_workers < 1:
            raise CommandError("--sessions and --workers must be at least 1, --warmup at least 0")
        redis_url = redis_url_with_db(settings.REDIS_URL, options["redis_db"])
        try:
            check_redis(settings.REDIS_URL)
            db = use_bench_database(options["database"])
        except ServiceUnavailable as exc:
            raise CommandError(str(exc)) from exc
        say = (lambda *_: None) if options["json"] else self.stdout.write
        logging.getLogger("httpx").setLevel(logging.WARNING)
        import redis

        from gpu.provisioners.registry import get_provisioner

        tmp = Path(tempfile.mkdtemp(prefix="bench-activation-"))
        port = free_port()
        env = {
            **os.environ,
            "DATABASE_URL": database_url(db, db["NAME"]),
            "REDIS_URL": redis_url,
            "CELERY_BROKER_URL": redis_url_with_db(settings.REDIS_URL, BENCH_BROKER_DB),
            "PROVISIONER": "local",
            "WORKER_DEVICE": "cpu",
            "CHECKPOINT_DIR": str(tmp / "checkpoints"),
            "PYTHONUNBUFFERED": "1",
        }
        redis.Redis.from_url(env["CELERY_BROKER_URL"]).flushdb()
        get_provisioner("local").release_all()  # leftovers of an interrupted run (benchmark database only)
        run = uuid.uuid4().hex[:8]
        token = self._prepare(run, n_workers)
        samples, load_before = [], machine_load()
        try:
            with ProcessGroup(tmp, env, Path(settings.BASE_DIR)) as processes:
                processes.spawn(
                    "web",
                    "-m",
                    "uvicorn",
                    "controlplane.asgi:application",
                    "--port",
                    str(port),
                    "--ws",
                    "websockets",
                    "--no-access-log",
                )
                processes.spawn(
                    "celery",
                    "-m",
                    "celery",
                    "-A",
                    "controlplane",
                    "worker",
                    "-Q",
                    "scheduler,default",
                    "-c",
                    "2",
                    "-n",
                    f"bench-{port}@%h",
                    "--loglevel",
                    "INFO",
                )
                processes.spawn(
                    "beat",
                    "-m",
                    "celery",
                    "-A",
                    "controlplane",
                    "beat",
                    "--loglevel",
                    "INFO",
                    "-s",
                    str(tmp / "beat-schedule"),
                )
                wait_until(lambda: port_open(port), 90, "the ASGI server", alive=processes.dead)
                say(
                    f"platform up (uvicorn :{port}, database {db['NAME']}); waiting for {n_workers} ready workers …"
                )
                began = time.monotonic()
                wait_until(
                    lambda: self._ready_workers() >= n_workers,
                    options["ready_timeout"],
                    f"{n_workers} ready local workers",
                    interval=0.5,
                    alive=processes.dead,
                )
                say(
                    f"{n_workers} workers ready after {time.monotonic() - began:.0f} s; {warmup} warm-up activations"
                )
                base = f"http://127.0.0.1:{port}"
                for i in range(warmup + n):
                    sample = asyncio.run(self._activate(base, f"ws://127.0.0.1:{port}", token, seed=i))
                    if processes.dead():
                        raise CommandError(f"a platform process died: {processes.dead()}")
                    if i >= warmup:
                        samples.append(sample)
                        say(
                            f"  session {i - warmup + 1}/{n}: first chunk after {(sample['t_first'] - sample['t0']) * 1000:.0f} ms"
                        )
                    time.sleep(options["pause"])
                self._attach_control_plane(samples)
                if options["keep_logs"]:
                    import shutil

                    shutil.copytree(tmp, options["keep_logs"], dirs_exist_ok=True)
        finally:
            try:
                get_provisioner("local").release_all()
            finally:
                self._cleanup(run)

        complete = [s for s in samples if s.get("t_ack") is not None]
        per_session = [components(s) for s in complete]
        figures = {key: summarize(c[key] for c in per_session) for key, _ in COMPONENTS}
        report = {
            "benchmark": "activation",
            "database": db["NAME"],
            "sessions": n,
            "measured": len(per_session),
            "incomplete": len(samples) - len(complete),
            "first_index_not_zero": sum(1 for s in samples if s["first_index"] != 0),
            "decision_triggers": {
                t: sum(1 for s in complete if s.get("decision_trigger") == t)
                for t in sorted({s.get("decision_trigger") for s in complete})
            },
            "warmup": warmup,
            "workers": n_workers,
            "pause_s": options["pause"],
            "components_ms": figures,
            "control_plane_share_p50": round(
                figures["control_plane_ms"]["p50"] / figures["first_chunk_ms"]["p50"], 3
            )
            if per_session
            else None,
            "samples": per_session,
            "load_before": load_before,
            "load_after": machine_load(),
        }
        if options["json"]:
            self.stdout.write(dumps(report))
            return
        self.stdout.write(
            f"{report['measured']} activations measured ({report['incomplete']} incomplete);"
            f" placing decisions by trigger {report['decision_triggers']}"
        )
        for key, label in COMPONENTS:
            f = figures[key]
            self.stdout.write(
                f"  {label:<72} p50 {f['p50']:8.1f}  p99 {f['p99']:8.1f}  max {f['max']:8.1f} ms"
            )
        self.stdout.write(
            f"load average before {load_before['loadavg']} after {report['load_after']['loadavg']}"
            f" on {load_before['cpus']} CPUs"
        )

    # --- steps -------------------------------------------------------------------------------

    def _prepare(self, run: str, n_workers: int) -> str:
        from django.contrib.auth import get_user_model
        from rest_framework.authtoken.models import Token

        from scheduling.models import SchedulerConfig
        from scheduling.services import beat_schedule_install

        beat_schedule_install()
        # A fixed pool: the autoscaler keeps exactly n_workers, so no activation waits on provisioning.
        SchedulerConfig.objects.update_or_create(
            pk=1, defaults={"min_gpus": n_workers, "max_gpus": n_workers}
        )
        user = get_user_model().objects.create(username=f"bench-activation-{run}")
        return Token.objects.create(user=user).key

    @staticmethod
    def _ready_workers() -> int:
        from django.db import close_old_connections

        from gpu.models import GpuWorker

        close_old_connections()
        return GpuWorker.objects.filter(status=GpuWorker.Status.READY).count()

    async def _activate(self, base: str, ws_base: str, token: str, *, seed: int) -> dict:
        import httpx
        import websockets

        async with httpx.AsyncClient(
            base_url=base, headers={"Authorization": f"Token {token}"}, timeout=30
        ) as api:
            await api.get("/api/models/")  # connection established before t0, as a live integrator's is
            t0 = time.time()
            response = await api.post(
                "/api/sessions/", json={"prompt": "a lighthouse in a storm", "model": "tiny", "seed": seed}
            )
            t_created = time.time()
            if response.status_code != 201:
                raise CommandError(f"session create failed: {response.status_code} {response.text[:300]}")
            session_id = response.json()["id"]
            async with websockets.connect(
                f"{ws_base}/ws/sessions/{session_id}/?token={token}", max_size=None
            ) as ws:
                deadline = time.monotonic() + 60
                while True:
                    message = await asyncio.wait_for(ws.recv(), timeout=max(deadline - time.monotonic(), 0.1))
                    if isinstance(message, bytes):
                        t_first = time.time()
                        header, _ = decode_chunk_frame(message)
                        break
                await ws.send(json.dumps({"type": "terminate"}))
            return {
                "session": session_id,
                "t0": t0,
                "t_created": t_created,
                "t_first": t_first,
                "first_index": int(header["index"]),
                "generation_ms": float(header["generation_ms"]),
                "generated_at": float(header["generated_at"]),
                "worker": header.get("worker"),
            }

    @staticmethod
    def _attach_control_plane(samples: list[dict]) -> None:
        """The start command of each session, its answer, and the decision that sent it."""
        from django.db import close_old_connections

        from scheduling.models import WorkerCommand

        close_old_connections()
        for sample in samples:
            command = (
                WorkerCommand.objects.select_related("decision")
                .filter(
                    session_id=sample["session"],
                    kind__in=[WorkerCommand.Kind.START, WorkerCommand.Kind.RESUME],
                )
                .order_by("created_at")
                .first()
            )
            if command is None or command.answered_at is None or command.decision is None:
                sample["t_ack"] = None
                continue
            sample["t_decision"] = command.decision.decided_at.timestamp()
            sample["t_command"] = command.created_at.timestamp()
            sample["t_ack"] = command.answered_at.timestamp()
            sample["command_status"] = command.status
            sample["decision_trigger"] = command.decision.trigger

    @staticmethod
    def _cleanup(run: str) -> None:
        """The benchmark's user and sessions go (with their events, prompts and chunk records); released
        worker rows, decisions and the cost ledger stay in the benchmark database as its history."""
        from django.contrib.auth import get_user_model
        from django.db import close_old_connections

        from sessions.models import GenerationSession

        close_old_connections()
        label = f"bench-activation-{run}"
        GenerationSession.objects.filter(owner__username=label).delete()
        get_user_model().objects.filter(username=label).delete()
