"""The whole platform as separate processes, for benchmarks and the soak run.

uvicorn, a Celery worker and beat against the benchmark database (their own broker and channel-layer
Redis databases), with the local provisioner starting CPU workers as the scheduler asks. Leaving the
context stops every process and releases every worker the run started.
"""

from __future__ import annotations

import argparse
import os
import secrets
import shutil
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import redis
from django.conf import settings
from django.db import close_old_connections

from gpu.models import GpuWorker
from gpu.provisioners.registry import get_provisioner
from scheduling.models import SchedulerConfig
from scheduling.services import beat_schedule_install
from scheduling.supervision import DEPLOYED_ASGI_APP, beat_argv, scheduler_argv, web_argv
from workers.benchmarks.live import (
    BENCH_BROKER_DB,
    BENCH_REDIS_DB,
    ProcessGroup,
    check_redis,
    database_url,
    free_port,
    port_open,
    redis_url_with_db,
    use_bench_database,
    wait_until,
)


@dataclass
class LivePlatform:
    port: int
    database: str
    processes: ProcessGroup
    log_dir: Path

    @property
    def http(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def ws(self) -> str:
        return f"ws://127.0.0.1:{self.port}"


PLATFORM_OPTIONS = ("database", "redis_db", "ready_timeout", "keep_logs")


def add_platform_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of every command that starts ``live_platform`` (``bench_activation``, ``soak``);
    ``platform_options`` hands them to the run."""
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


def platform_options(options: dict[str, Any]) -> dict[str, Any]:
    return {name: options[name] for name in PLATFORM_OPTIONS}


def ready_workers() -> int:
    close_old_connections()
    return GpuWorker.objects.filter(status=GpuWorker.Status.READY).count()


@contextmanager
def live_platform(
    *,
    prefix: str,
    database: str | None,
    redis_db: int,
    min_gpus: int,
    max_gpus: int,
    ready_timeout: float,
    keep_logs: str | None,
    say: Callable[[str], Any],
    sessions_per_user: int = 10,
    extra_env: dict[str, str] | None = None,
    asgi_app: str = DEPLOYED_ASGI_APP,
) -> Iterator[LivePlatform]:
    """Start the platform, wait for ``min_gpus`` ready workers, yield it; stop it all on exit."""
    redis_url = redis_url_with_db(settings.REDIS_URL, redis_db)
    check_redis(settings.REDIS_URL)
    db = use_bench_database(database)
    tmp = Path(tempfile.mkdtemp(prefix=f"{prefix}-"))
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
        # The run's own signing key unless one is configured (DEBUG stays as configured: off by default).
        "SECRET_KEY": os.environ.get("SECRET_KEY") or secrets.token_urlsafe(32),
        # One benchmark user holds every session of the run.
        "MAX_LIVE_SESSIONS_PER_USER": str(max(sessions_per_user, 10)),
        **(extra_env or {}),
    }
    redis.Redis.from_url(env["CELERY_BROKER_URL"]).flushdb()
    get_provisioner("local").release_all()  # leftovers of an interrupted run (benchmark database only)
    beat_schedule_install()
    # The autoscaler keeps between min_gpus and max_gpus workers.
    SchedulerConfig.objects.update_or_create(pk=1, defaults={"min_gpus": min_gpus, "max_gpus": max_gpus})
    try:
        with ProcessGroup(tmp, env, Path(settings.BASE_DIR)) as processes:
            processes.spawn("web", *web_argv(port=port, app=asgi_app), python=False)
            processes.spawn("celery", *scheduler_argv(node_name=f"{prefix}-{port}@%h"), python=False)
            processes.spawn("beat", *beat_argv(schedule=tmp / "beat"), python=False)
            wait_until(lambda: port_open(port), 90, "the ASGI server", alive=processes.dead)
            say(
                f"platform up (uvicorn :{port}, database {db['NAME']}); waiting for {min_gpus} ready workers …"
            )
            began = time.monotonic()
            wait_until(
                lambda: ready_workers() >= min_gpus,
                ready_timeout,
                f"{min_gpus} ready local workers",
                interval=0.5,
                alive=processes.dead,
            )
            say(f"{min_gpus} workers ready after {time.monotonic() - began:.0f} s")
            try:
                yield LivePlatform(port=port, database=db["NAME"], processes=processes, log_dir=tmp)
            finally:
                if keep_logs:
                    shutil.copytree(tmp, keep_logs, dirs_exist_ok=True)
    finally:
        get_provisioner("local").release_all()
