"""Processes die with the process that started them, even when it is killed with SIGKILL
(contracts/process.py): the exec wrapper supervisord's programs run through, and a GPU worker's
stop when it is re-parented anywhere but to the platform's subreaper. Real processes, no Django.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import psutil
from django.conf import settings

from contracts.process import PARENT_PID_ENV, PLATFORM_PID_ENV

ROOT = Path(settings.BASE_DIR)


def gone(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def wait_until(predicate, limit_s: float) -> bool:
    deadline = time.monotonic() + limit_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.05)
    return predicate()


def read_pids(path: Path, count: int, limit_s: float = 15) -> list[int]:
    assert wait_until(lambda: path.exists() and len(path.read_text().split()) >= count, limit_s), path
    return [int(word) for word in path.read_text().split()[:count]]


def start(script: str, env: dict[str, str]) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(script)], cwd=ROOT, env=env, start_new_session=True
    )


def cleanup(*pids: int) -> None:
    for pid in pids:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(pid, signal.SIGKILL)


# The "worker": stops the way a GPU worker does (SIGTERM → its own graceful stop).
WORKER = """
import os, signal, sys, time
from contracts.process import stop_when_orphaned
stop_when_orphaned()
signal.signal(signal.SIGTERM, lambda *a: sys.exit(0))
open(sys.argv[1], "a").write(f"{os.getpid()} ")
while True:
    time.sleep(0.1)
"""


def test_a_wrapped_program_dies_when_its_parent_is_killed(tmp_path):
    # given a parent that started a program through the wrapper, naming itself as the parent
    pids = tmp_path / "pids"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    parent = start(
        f"""
        import os, subprocess, sys, time
        child = subprocess.Popen(
            [sys.executable, "-m", "contracts.process", "--", "sleep", "300"],
            env={{**os.environ, "{PARENT_PID_ENV}": str(os.getpid())}},
        )
        open({str(pids)!r}, "w").write(f"{{child.pid}} ")
        time.sleep(300)
        """,
        env,
    )
    (child,) = read_pids(pids, 1)
    try:
        # the program runs (exec'd in place: same pid)
        assert wait_until(lambda: psutil.Process(child).name() == "sleep", 10)
        # when the parent is killed with SIGKILL
        os.kill(parent.pid, signal.SIGKILL)
        parent.wait()
        # then the program is gone within a few seconds
        assert wait_until(lambda: gone(child), 5)
    finally:
        cleanup(parent.pid, child)


def test_a_program_whose_parent_died_before_it_asked_exits_at_once(tmp_path):
    # given a process told its parent is one that is not its parent (the parent died before prctl)
    result = subprocess.run(
        [sys.executable, "-m", "contracts.process", "--", "sleep", "300"],
        cwd=ROOT,
        env={**os.environ, PARENT_PID_ENV: "999999999"},
        capture_output=True,
        text=True,
        timeout=30,
    )
    # then it exits non-zero without running the program, saying why
    assert result.returncode == 70
    assert "process.orphaned_at_start" in result.stderr


def test_a_worker_outlives_its_spawner_under_the_platform_and_dies_with_the_platform(tmp_path):
    # given a "platform" (a subreaper naming itself in the environment) whose child "spawner"
    # started a worker, as a Celery pool child starts a GPU worker under runplatform
    pids = tmp_path / "pids"
    worker_file = tmp_path / "worker.py"
    worker_file.write_text(textwrap.dedent(WORKER))
    spawner_file = tmp_path / "spawner.py"
    spawner_file.write_text(
        textwrap.dedent(
            f"""
            import os, subprocess, sys, time
            worker = subprocess.Popen([sys.executable, {str(worker_file)!r}, {str(pids)!r}],
                                      env={{**os.environ, "{PARENT_PID_ENV}": str(os.getpid())}})
            time.sleep(300)
            """
        )
    )
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    platform = start(
        f"""
        import os, subprocess, sys, time
        from contracts.process import become_subreaper
        assert become_subreaper()
        os.environ["{PLATFORM_PID_ENV}"] = str(os.getpid())
        spawner = subprocess.Popen([sys.executable, {str(spawner_file)!r}])
        open({str(pids)!r}, "a").write(f"{{spawner.pid}} ")
        while True:  # the subreaper reaps what is re-parented to it
            try:
                os.waitpid(-1, 0)
            except ChildProcessError:
                time.sleep(0.1)
        """,
        env,
    )
    spawner, worker = read_pids(pids, 2)
    if psutil.Process(spawner).ppid() != platform.pid:  # the worker wrote first
        spawner, worker = worker, spawner
    try:
        # when the spawner dies (the platform lives)
        os.kill(spawner, signal.SIGKILL)
        assert wait_until(lambda: gone(spawner), 5)
        # then the worker is re-parented to the platform and goes on
        assert wait_until(lambda: psutil.Process(worker).ppid() == platform.pid, 5)
        time.sleep(1.0)
        assert not gone(worker)
        # when the platform is killed with SIGKILL
        os.kill(platform.pid, signal.SIGKILL)
        platform.wait()
        # then the worker stops within a few seconds
        assert wait_until(lambda: gone(worker), 5)
    finally:
        cleanup(platform.pid, spawner, worker)
