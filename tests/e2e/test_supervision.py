"""One crash never stops the platform: ``runplatform`` under supervisord, Celery worker and beat killed;
and nothing outlives the platform itself killed with SIGKILL.

Starts the real supervised platform (web, Celery worker, beat) on a free port with the suite's own
database and Redis database, ``kill -9``s the Celery worker's main process and then beat, and
checks that the web server answers throughout and that each comes back (bounded). Run under the
heavy lock: it starts processes.
"""

from __future__ import annotations

import contextlib
import http.client
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
import xmlrpc.client
from pathlib import Path

import psutil
import pytest
from django.conf import settings
from supervisor.xmlrpc import SupervisorTransport

from scheduling.health import beat_check, celery_check
from workers.benchmarks.live import free_port

ROOT = Path(settings.BASE_DIR)
BOUND_S = 90.0


def wait_for(predicate, limit_s: float, what: str):
    deadline = time.monotonic() + limit_s
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.25)
    raise AssertionError(f"timed out after {limit_s:.0f}s waiting for {what}")


def http_status(url: str) -> int | None:
    try:
        with urllib.request.urlopen(url, timeout=2) as response:
            return response.status
    except urllib.error.HTTPError as exc:
        return exc.code
    except OSError:
        return None  # refused or timed out


class Supervised:
    """The platform started as ``make run`` starts it, and its supervisord's XML-RPC view."""

    def __init__(self, tmp: Path) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.run_dir = tmp / "run"
        self.log_path = tmp / "platform.log"
        db = settings.DATABASES["default"]
        env = {
            **os.environ,
            "DATABASE_URL": f"postgres://{db['USER']}@{db['HOST']}:{db['PORT']}/{db['NAME']}",
            "REDIS_URL": settings.REDIS_URL,
            "CELERY_BROKER_URL": settings.CELERY_BROKER_URL,
            # No GPU worker: this test is about the platform's own processes.
            "PROVISIONER": "static",
            "STATIC_WORKERS": "",
            "PYTHONUNBUFFERED": "1",
        }
        with open(self.log_path, "wb") as log:
            self.process = subprocess.Popen(
                [sys.executable, "manage.py", "runplatform", "--host", "127.0.0.1", "--port", str(self.port),
                 "--no-demo-user", "--run-dir", str(self.run_dir)],
                cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
            )  # fmt: skip

    def programs(self) -> dict[str, dict]:
        # A fresh proxy per call: a failed call (socket not there yet) leaves a transport unusable.
        transport = SupervisorTransport(None, None, f"unix://{self.run_dir / 'supervisor.sock'}")
        rpc = xmlrpc.client.ServerProxy("http://127.0.0.1", transport=transport)
        try:
            return {info["name"]: info for info in rpc.supervisor.getAllProcessInfo()}
        except (OSError, xmlrpc.client.Error, http.client.HTTPException):
            return {}

    def all_running(self) -> dict[str, dict] | None:
        programs = self.programs()
        # The media process too: WebRTC runs there by default (WEBRTC_MEDIA=process).
        ok = set(programs) == {"web", "scheduler", "beat", "media"}
        return programs if ok and all(p["statename"] == "RUNNING" for p in programs.values()) else None

    def stop(self) -> None:
        pids = [info["pid"] for info in self.programs().values() if info.get("pid")]
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.process.pid, signal.SIGTERM)
        try:
            self.process.wait(timeout=90)
        except subprocess.TimeoutExpired:
            for pid in pids:  # supervisord hung: its programs go by the pids it reported
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(pid, signal.SIGKILL)
            os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait()

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")[-6000:]


@pytest.mark.django_db(transaction=True)
def test_a_killed_celery_worker_or_beat_comes_back_and_the_web_server_never_stops(tmp_path):
    platform = Supervised(tmp_path)
    try:
        # Given the supervised platform up: every program running, ready, the worker answering pings
        before = wait_for(platform.all_running, 120, "web, scheduler, beat and media RUNNING")
        wait_for(lambda: http_status(f"{platform.url}/readyz") == 200, 60, "/readyz")
        wait_for(lambda: celery_check(timeout_s=1.0).ok, 60, "the Celery worker to answer a ping")

        # When the Celery worker's main process is killed with SIGKILL
        killed_at = time.monotonic()
        os.kill(before["scheduler"]["pid"], signal.SIGKILL)

        # Then the web server answers throughout (no 1012 close, no refused connection)
        statuses = []
        while time.monotonic() - killed_at < 5:
            statuses.append(http_status(f"{platform.url}/healthz"))
            time.sleep(0.2)
        assert set(statuses) == {200}, statuses
        # and the worker is restarted by the supervisor and answers again, within the bound
        wait_for(
            lambda: (p := platform.all_running()) and p["scheduler"]["pid"] != before["scheduler"]["pid"],
            BOUND_S,
            "the Celery worker to be restarted",
        )
        wait_for(lambda: celery_check(timeout_s=1.0).ok, BOUND_S - (time.monotonic() - killed_at), "a ping")
        assert time.monotonic() - killed_at < BOUND_S
        after = platform.programs()
        # and nothing else was restarted
        assert after["web"]["pid"] == before["web"]["pid"]
        assert after["beat"]["pid"] == before["beat"]["pid"]

        # When beat is killed too, it comes back and publishes again; web still untouched
        wait_for(lambda: beat_check(max_age_s=10).ok, 30, "beat's heartbeat")
        killed_at = time.monotonic()
        os.kill(before["beat"]["pid"], signal.SIGKILL)
        wait_for(
            lambda: (p := platform.all_running()) and p["beat"]["pid"] != before["beat"]["pid"],
            BOUND_S,
            "beat to be restarted",
        )
        beat_back = time.monotonic()
        wait_for(
            lambda: beat_check(max_age_s=time.monotonic() - beat_back + 0.5).ok,
            BOUND_S - (time.monotonic() - killed_at),
            "the restarted beat to publish",
        )
        assert platform.programs()["web"]["pid"] == before["web"]["pid"]
        assert http_status(f"{platform.url}/readyz") == 200
    except AssertionError:
        print(platform.log())
        raise
    finally:
        platform.stop()
    # The platform stops cleanly on SIGTERM (supervisord stops every program, then exits).
    assert platform.process.returncode == 0, platform.log()


def gone(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


@pytest.mark.django_db(transaction=True)
def test_no_process_of_the_platform_outlives_it_when_it_is_killed_with_sigkill(tmp_path):
    platform = Supervised(tmp_path)
    descendants: list[int] = []
    try:
        # Given the supervised platform up, and every process under it (supervisord, its
        # programs, their children: Celery's pool, …)
        wait_for(platform.all_running, 120, "web, scheduler, beat and media RUNNING")
        wait_for(lambda: celery_check(timeout_s=1.0).ok, 60, "the Celery worker to answer a ping")
        descendants = [p.pid for p in psutil.Process(platform.process.pid).children(recursive=True)]
        assert len(descendants) >= 4, descendants  # supervisord, web, scheduler (+ pool), beat

        # When runplatform itself is killed with SIGKILL (no chance to stop anything)
        os.kill(platform.process.pid, signal.SIGKILL)
        platform.process.wait()

        # Then every one of them is gone within the programs' stop grace (SIGTERM first)
        left = wait_for(
            lambda: not [pid for pid in descendants if not gone(pid)] or None,
            30,
            "the platform's processes to exit",
        )
        assert left
    except AssertionError:
        print(platform.log())
        raise
    finally:
        if platform.process.poll() is None:  # failed before the kill
            platform.stop()
        for pid in descendants:  # the ones this test saw left behind
            if not gone(pid):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
