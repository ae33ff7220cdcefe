"""The real platform for end-to-end tests: uvicorn, Celery worker + beat, local provisioner workers.

Processes share the test database (committed data: these tests run outside the per-test
transaction) and Redis; Celery gets its own broker database so a developer's running platform
cannot pick up the tests' tasks. Everything is torn down and the database flushed afterwards.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from django.conf import settings
from django.core.management import call_command

ROOT = Path(__file__).resolve().parents[2]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_for(predicate, timeout: float, interval: float = 0.2, message: str = "condition"):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout}s waiting for {message}")


class Platform:
    def __init__(self, tmp: Path) -> None:
        self.tmp = tmp
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.ws_url = f"ws://127.0.0.1:{self.port}"
        self.processes: dict[str, subprocess.Popen] = {}
        profile = json.loads((ROOT / "scheduling/data/profiles/cpu-tiny.json").read_text())
        # K=2 and a latency that grows with every co-located session (as on a GPU at capacity), so a
        # handful of sessions exercises scale-out and rebalancing; the rest is the measured CPU profile.
        profile.update(
            capacity=2.0,
            name="cpu-tiny-e2e",
            provisioning_delay_s=6.0,
            latency_ms=[[1, 100.0], [2, 200.0], [3, 300.0], [4, 400.0]],
        )
        (tmp / "profile.json").write_text(json.dumps(profile))
        db = settings.DATABASES["default"]
        self.env = {
            **os.environ,
            "DATABASE_URL": f"postgres://{db['USER']}@{db['HOST']}:{db['PORT']}/{db['NAME']}",
            "REDIS_URL": settings.REDIS_URL,
            "CELERY_BROKER_URL": "redis://127.0.0.1:6379/13",
            "WORKER_PROFILE": str(tmp / "profile.json"),
            "CHECKPOINT_DIR": str(tmp / "checkpoints"),
            "WEIGHTS_DIR": str(tmp / "weights"),
            "CHECKPOINT_EVERY": "4",
            "HEARTBEAT_INTERVAL_S": "0.5",
            "HEARTBEAT_TIMEOUT_S": "3",
            "PROVISIONER": "local",
            "PROVISION_TIMEOUT_S": "90",
            "PYTHONUNBUFFERED": "1",
            "DEBUG": "true",
        }

    def spawn(self, name: str, *args: str) -> subprocess.Popen:
        log = open(self.tmp / f"{name}.log", "wb")  # noqa: SIM115 - closed with the process
        process = subprocess.Popen(
            [sys.executable, *args],
            cwd=ROOT,
            env=self.env,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        self.processes[name] = process
        return process

    def start(self) -> None:
        import redis

        redis.Redis.from_url(self.env["CELERY_BROKER_URL"]).flushdb()
        self.spawn(
            "web",
            "-m",
            "uvicorn",
            "controlplane.asgi:application",
            "--port",
            str(self.port),
            "--ws",
            "websockets",
            "--no-access-log",
        )
        self.spawn(
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
            f"e2e-{self.port}@%h",
            "--loglevel",
            "INFO",
        )
        self.spawn(
            "beat",
            "-m",
            "celery",
            "-A",
            "controlplane",
            "beat",
            "--loglevel",
            "INFO",
            "-s",
            str(self.tmp / "beat-schedule"),
        )
        wait_for(self._web_up, 60, message="the ASGI server")

    def _web_up(self) -> bool:
        try:
            with socket.create_connection(("127.0.0.1", self.port), timeout=0.5):
                return True
        except OSError:
            return False

    def stop(self) -> None:
        from gpu.provisioners.registry import get_provisioner

        for name in ("beat", "celery", "web"):
            process = self.processes.get(name)
            if process and process.poll() is None:
                os.killpg(process.pid, signal.SIGTERM)
        for process in self.processes.values():
            try:
                process.wait(timeout=15)
            except subprocess.TimeoutExpired:
                os.killpg(process.pid, signal.SIGKILL)
        try:
            get_provisioner("local").release_all()
        except Exception as exc:
            print("release_all failed:", exc)

    def logs(self) -> str:
        out = []
        for path in sorted(self.tmp.rglob("*.log")):
            out.append(f"===== {path.name}\n" + path.read_text(errors="replace")[-4000:])
        return "\n".join(out)


@pytest.fixture(scope="module")
def platform(django_db_setup, django_db_blocker, tmp_path_factory, request):
    from scheduling.models import SchedulerConfig
    from scheduling.services import beat_schedule_install

    with django_db_blocker.unblock():
        call_command("flush", "--noinput", verbosity=0)
        beat_schedule_install(tick_s=1)
        SchedulerConfig.objects.update_or_create(
            pk=1,
            defaults={"min_gpus": 1, "max_gpus": 3, "scale_in_cooldown_s": 5.0, "target_utilization": 0.5},
        )
        platform = Platform(tmp_path_factory.mktemp("platform"))
        platform.start()
        try:
            yield platform
        finally:
            failed = request.session.testsfailed
            platform.stop()
            if failed:
                import shutil

                keep = ROOT / "artifacts" / "e2e-logs"
                shutil.rmtree(keep, ignore_errors=True)
                shutil.copytree(platform.tmp, keep, ignore=shutil.ignore_patterns("checkpoints"))
                for log in (ROOT / "var" / "log").glob("local-*.log"):
                    shutil.copy(log, keep)
                print(f"platform logs kept in {keep}")
                print(platform.logs())
            call_command("flush", "--noinput", verbosity=0)


@pytest.fixture
def live_db(platform):
    """The platform's processes are up (the test's own database access comes from its marker)."""
    return platform


def run(coro):
    return asyncio.run(coro)
