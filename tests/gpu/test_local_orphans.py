"""GPU workers outlive the Celery child that started them: adopted by their row, or stopped as orphans."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import textwrap
import time
from datetime import timedelta
from pathlib import Path

import psutil
import pytest
from django.conf import settings
from django.utils import timezone

from gpu.models import GpuWorker
from gpu.provisioners import local as local_module
from gpu.provisioners.local import (
    WORKER_NAME_ENV,
    WORKER_SCOPE_ENV,
    LocalProvisioner,
    parse_external_id,
)

SLEEPER = "import time; print('up', flush=True); time.sleep(300)"
ROOT = Path(settings.BASE_DIR)


def stand_in(worker: GpuWorker) -> list[str]:
    return [sys.executable, "-c", SLEEPER]


def running(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def wait_for(predicate, what: str, limit_s: float = 20.0) -> None:
    deadline = time.monotonic() + limit_s
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.05)
    raise AssertionError(f"gave up waiting for {what}")


@pytest.fixture
def started_pids():
    pids: list[int] = []
    yield pids
    for pid in pids:  # whatever a test left running goes, by the pids it started
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(pid, signal.SIGKILL)
        child = local_module._CHILDREN.pop(pid, None)
        if child is not None:
            child.wait()


def local(tmp_path: Path, **options) -> LocalProvisioner:
    options.setdefault("stop_grace_s", 3.0)
    return LocalProvisioner(
        command_factory=stand_in,
        log_dir=tmp_path / "log",
        cuda_devices=lambda: [],
        max_cpu_workers=4,
        **options,
    )


# The "Celery pool child": a separate process that runs the provisioner's request (as the
# scheduler's scale-out task does), reports what it started, and is then killed.
CHILD = textwrap.dedent(
    """
    import os, sys, time
    import django
    django.setup()
    from gpu.provisioners.local import LocalProvisioner
    provisioner = LocalProvisioner(
        command_factory=lambda w: [sys.executable, "-c", {sleeper!r}],
        log_dir={log_dir!r}, cuda_devices=lambda: [], max_cpu_workers=4,
    )
    result = provisioner.request(count=1, gpu_type="cpu")
    print("STARTED", result.started[0].id, result.started[0].external_id, flush=True)
    time.sleep(300)
    """
)


@pytest.mark.django_db(transaction=True)
def test_a_worker_started_by_a_celery_child_survives_its_death_and_stays_tracked(tmp_path, started_pids):
    db = settings.DATABASES["default"]
    env = {
        **os.environ,
        "DJANGO_SETTINGS_MODULE": "controlplane.settings",
        "DATABASE_URL": f"postgres://{db['USER']}@{db['HOST']}:{db['PORT']}/{db['NAME']}",
    }
    # Given a child process (a Celery pool child) that started a worker through the local provisioner
    child = subprocess.Popen(
        [sys.executable, "-c", CHILD.format(sleeper=SLEEPER, log_dir=str(tmp_path / "log"))],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        line = child.stdout.readline()
        assert line.startswith("STARTED"), line
        _, worker_id, external_id = line.split()
        pid, _ = parse_external_id(external_id)
        started_pids.append(pid)
        assert psutil.Process(pid).ppid() == child.pid
        # When the child dies as a prefork child does when its Celery worker is killed
        os.killpg(child.pid, signal.SIGKILL)
        child.wait(10)
    finally:
        if child.poll() is None:
            os.killpg(child.pid, signal.SIGKILL)
            child.wait()
    # Then the worker keeps running, re-parented (to PID 1 or a subreaper), no longer the child's
    assert running(pid)
    assert psutil.Process(pid).ppid() != child.pid
    # and another process's reconcile adopts it through its row: alive, not failed, not an orphan
    provisioner = local(tmp_path, orphan_grace_s=0.0)
    result = provisioner.reconcile()
    assert result.failed == [] and result.stopped_orphans == []
    worker = GpuWorker.objects.get(pk=int(worker_id))
    assert worker.status == GpuWorker.Status.PROVISIONING
    assert running(pid)
    # and releasing it stops the process it does not parent
    released = provisioner.release(worker)
    assert released.ok, released.detail
    wait_for(lambda: not running(pid), "the released worker to exit")


@pytest.mark.django_db
def test_reconcile_stops_a_worker_that_no_row_tracks(tmp_path, started_pids):
    provisioner = local(tmp_path, orphan_grace_s=0.0)
    kept, orphaned = provisioner.request(count=2, gpu_type="cpu").started
    kept_pid, orphan_pid = parse_external_id(kept.external_id)[0], parse_external_id(orphaned.external_id)[0]
    started_pids.extend([kept_pid, orphan_pid])
    # Given one worker whose row is gone (e.g. deleted by an operator; or failed beyond the
    # retry window, where the leftover sweep no longer looks)
    GpuWorker.objects.filter(pk=orphaned.id).delete()
    # When reconcile runs
    result = provisioner.reconcile()
    # Then the untracked worker is stopped and the tracked one is left alone
    assert [entry.split(" ")[0] for entry in result.stopped_orphans] == [orphaned.name]
    assert "stopped on SIGTERM" in result.stopped_orphans[0]
    assert not running(orphan_pid)
    assert running(kept_pid)
    assert result.as_dict()["stopped_orphans"] == result.stopped_orphans


@pytest.mark.django_db
def test_a_worker_failed_long_ago_whose_process_survived_is_stopped(tmp_path, started_pids):
    provisioner = local(tmp_path, orphan_grace_s=0.0)
    (ref,) = provisioner.request(count=1, gpu_type="cpu").started
    pid = parse_external_id(ref.external_id)[0]
    started_pids.append(pid)
    # Given its row failed two hours ago (outside PROVISION_RETRY_WINDOW_S) while it kept running
    long_ago = timezone.now() - timedelta(hours=2)
    GpuWorker.objects.filter(pk=ref.id).update(
        status=GpuWorker.Status.FAILED, requested_at=long_ago, released_at=long_ago
    )
    result = provisioner.reconcile()
    assert [entry.split(" ")[0] for entry in result.stopped_orphans] == [ref.name]
    assert not running(pid)


@pytest.mark.django_db
def test_young_workers_and_other_deployments_workers_are_never_orphans(tmp_path, started_pids):
    # Given a worker process of another deployment (another database) on this host, without a row here
    other = subprocess.Popen(
        [sys.executable, "-c", SLEEPER],
        env={**os.environ, WORKER_NAME_ENV: "local-cpu-elsewhere", WORKER_SCOPE_ENV: "otherhost:5432/other"},
        stdout=subprocess.DEVNULL,
        start_new_session=True,
    )
    local_module._CHILDREN[other.pid] = other
    started_pids.append(other.pid)
    # and one of ours whose row is gone but which started moments ago
    provisioner = local(tmp_path)  # default grace: LEFTOVER_GRACE_S
    (ref,) = provisioner.request(count=1, gpu_type="cpu").started
    pid = parse_external_id(ref.external_id)[0]
    started_pids.append(pid)
    GpuWorker.objects.filter(pk=ref.id).delete()
    # When reconcile runs, neither is touched
    assert provisioner.reconcile().stopped_orphans == []
    assert running(other.pid) and running(pid)
    # and past the grace, only ours goes
    provisioner.orphan_grace_s = 0.0
    assert [e.split(" ")[0] for e in provisioner.reconcile().stopped_orphans] == [ref.name]
    assert running(other.pid) and not running(pid)
