"""The real platform for end-to-end tests: uvicorn, Celery worker + beat, local provisioner workers.

Processes share the test database (committed data: these tests run outside the per-test
transaction) and Redis; Celery gets its own broker database so a developer's running platform
cannot pick up the tests' tasks (one per xdist worker: tests/isolation.py). Everything is torn down
and the database flushed afterwards.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import socket
import subprocess
import time
from pathlib import Path
from urllib.parse import urlparse

import psutil
import pytest
from django.conf import settings
from django.core.management import call_command

from scheduling.supervision import beat_argv, media_argv, scheduler_argv, web_argv
from tests import isolation
from workers.benchmarks.live import ProcessGroup, free_port

ROOT = Path(__file__).resolve().parents[2]


def wait_for(predicate, timeout: float, interval: float = 0.2, message: str = "condition"):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout}s waiting for {message}")


class Platform:
    """``profile``: fields replacing the measured CPU profile's (default: the e2e profile below);
    ``env``: variables replacing the defaults (a private Redis or PostgreSQL, a policy …)."""

    def __init__(
        self,
        tmp: Path,
        *,
        profile: dict | None = None,
        env: dict[str, str] | None = None,
        media: bool = False,
    ) -> None:
        self.tmp = tmp
        self.media = media
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.ws_url = f"ws://127.0.0.1:{self.port}"
        measured = json.loads((ROOT / "scheduling/data/profiles/cpu-tiny.json").read_text())
        # K=2 and a latency that grows with every co-located session (as on a GPU at capacity), so a
        # handful of sessions exercises scale-out and rebalancing; the rest is the measured CPU profile.
        measured.update(
            profile
            if profile is not None
            else {
                "capacity": 2.0,
                "name": "cpu-tiny-e2e",
                "provisioning_delay_s": 6.0,
                "latency_ms": [[1, 100.0], [2, 200.0], [3, 300.0], [4, 400.0]],
            }
        )
        (tmp / "profile.json").write_text(json.dumps(measured))
        db = settings.DATABASES["default"]
        self.default_database_url = f"postgres://{db['USER']}@{db['HOST']}:{db['PORT']}/{db['NAME']}"
        self.env = {
            **os.environ,
            "DATABASE_URL": self.default_database_url,
            "REDIS_URL": settings.REDIS_URL,
            "CELERY_BROKER_URL": isolation.e2e_broker_url(settings.REDIS_URL),
            "WORKER_PROFILE": str(tmp / "profile.json"),
            "CHECKPOINT_DIR": str(tmp / "checkpoints"),
            "WEIGHTS_DIR": str(tmp / "weights"),
            "CHECKPOINT_EVERY": "4",
            "HEARTBEAT_INTERVAL_S": "0.5",
            "HEARTBEAT_TIMEOUT_S": "3",
            # The platform ticks: its workers run with the production orphan timeout (the suite's
            # default, for workers started without a control plane, is 0).
            "WORKER_ORPHAN_TIMEOUT_S": "60",
            "PROVISIONER": "local",
            "PROVISION_TIMEOUT_S": "90",
            "PYTHONUNBUFFERED": "1",
            "DEBUG": "true",
            # The viewer rule off: most tests drive sessions through the API without a socket
            # (tests/e2e/test_viewers.py turns it on with short values).
            "SESSION_VIEWER_GRACE_S": "0",
            "SESSION_IDLE_TIMEOUT_S": "0",
            **(env or {}),
        }
        self.group = ProcessGroup(tmp, self.env, ROOT, grace_s=15.0)
        self.processes: dict[str, subprocess.Popen] = self.group.processes

    def spawn(self, name: str, *argv: str) -> subprocess.Popen:
        """Start ``argv`` in its own process group, output to ``<tmp>/<name>.log``."""
        return self.group.spawn(name, *argv, python=False)

    def start(self) -> None:
        import redis

        redis.Redis.from_url(self.env["CELERY_BROKER_URL"]).flushdb()
        self.spawn("web", *web_argv(port=self.port))
        self.spawn("celery", *scheduler_argv(node_name=f"e2e-{self.port}@%h"))
        self.spawn("beat", *beat_argv(schedule=self.tmp / "beat-schedule"))
        if self.media:
            # WebRTC viewers' peer connections (WEBRTC_MEDIA=process, the default), as runplatform runs
            # it; only for the tests that play WebRTC (a process start of CPU for every other platform:
            # without one a WebRTC offer gets `webrtc_unavailable` and the page stays on the socket).
            self.spawn("media", *media_argv())
        wait_for(self._web_up, 60, message="the ASGI server")

    def _web_up(self) -> bool:
        try:
            with socket.create_connection(("127.0.0.1", self.port), timeout=0.5):
                return True
        except OSError:
            return False

    @property
    def scope(self) -> str:
        """The deployment scope its local workers carry (``gpu.provisioners.local.deployment_scope``)."""
        url = urlparse(self.env["DATABASE_URL"])
        return f"{url.hostname or 'local'}:{url.port or ''}/{url.path.lstrip('/')}"

    def stop(self) -> None:
        from gpu.provisioners.registry import get_provisioner

        self.group.stop()
        if self.env["DATABASE_URL"] == self.default_database_url:
            try:
                get_provisioner("local").release_all()
            except Exception as exc:
                print("release_all failed:", exc)
        # And any worker of this platform the rows no longer name (one still loading its model when
        # the scheduler's processes stopped): it must not register with the next test's platform.
        stop_workers_of_scope(self.scope)

    def logs(self) -> str:
        out = []
        for path in sorted(self.tmp.rglob("*.log")):
            out.append(f"===== {path.name}\n" + path.read_text(errors="replace")[-4000:])
        return "\n".join(out)


def stop_workers_of_scope(scope: str) -> None:
    """SIGTERM, then SIGKILL, every local worker process started for the deployment ``scope``."""
    from gpu.provisioners.local import WORKER_SCOPE_ENV

    found = []
    for process in psutil.process_iter():
        with contextlib.suppress(psutil.Error):
            if process.environ().get(WORKER_SCOPE_ENV) == scope:
                found.append(process)
    for process in found:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(process.pid, signal.SIGTERM)
    _gone, alive = psutil.wait_procs(found, timeout=15)
    for process in alive:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(process.pid, signal.SIGKILL)


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
        platform = Platform(
            tmp_path_factory.mktemp("platform"), media=getattr(request.module, "PLATFORM_MEDIA", False)
        )
        platform.start()
        try:
            yield platform
        finally:
            failed = request.session.testsfailed
            platform.stop()
            if failed:
                import shutil

                keep = ROOT / "artifacts" / f"e2e-logs{isolation.suffix()}"
                shutil.rmtree(keep, ignore_errors=True)
                shutil.copytree(platform.tmp, keep, ignore=shutil.ignore_patterns("checkpoints"))
                for log in (ROOT / "var" / "log").glob("local-*.log"):
                    shutil.copy(log, keep)
                print(f"platform logs kept in {keep}")
                print(platform.logs())
            call_command("flush", "--noinput", verbosity=0)


@pytest.fixture(scope="module")
def demo_platform(django_db_setup, django_db_blocker, tmp_path_factory):
    """The platform as `make run` serves it (the default model, one worker); a user's API token."""
    from scheduling.models import SchedulerConfig
    from scheduling.services import beat_schedule_install

    with django_db_blocker.unblock():
        call_command("flush", "--noinput", verbosity=0)
        beat_schedule_install(tick_s=1)
        SchedulerConfig.objects.update_or_create(pk=1, defaults={"min_gpus": 1, "max_gpus": 1})
        platform = Platform(tmp_path_factory.mktemp("demo-platform"))
        platform.env.pop("SERVED_MODELS", None)  # the deployment default, as under `make run`
        platform.start()
        try:
            from rest_framework.authtoken.models import Token

            from tests.factories import UserFactory

            token = Token.objects.create(user=UserFactory()).key
            yield platform, token
        finally:
            platform.stop()
            call_command("flush", "--noinput", verbosity=0)


@pytest.fixture
def live_db(platform):
    """The platform's processes are up (the test's own database access comes from its marker)."""
    return platform


def run(coro):
    return asyncio.run(coro)
