"""The local provisioner with real subprocesses (stand-in command lines; the default is gpuworker)."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import sys
import time
from datetime import timedelta
from decimal import Decimal
from pathlib import Path

import psutil
import pytest
from django.conf import settings
from django.core.exceptions import ImproperlyConfigured
from django.utils import timezone

from gpu.models import GpuWorker, Region
from gpu.provisioners import get_provisioner, provisioner_class
from gpu.provisioners import local as local_module
from gpu.provisioners.local import (
    LocalProvisioner,
    gpu_type_of,
    gpuworker_command,
    parse_external_id,
)
from gpu.provisioners.static import StaticProvisioner
from gpu.services import worker_fail, worker_mark_ready

pytestmark = pytest.mark.django_db

Status = GpuWorker.Status

SLEEPER = "import time; print('up', flush=True); time.sleep(300)"
STUBBORN = "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); print('up', flush=True); time.sleep(300)"
CRASHER = "import sys; print('boom: cannot load model', flush=True); sys.exit(3)"


def stand_in(code: str):
    return lambda worker: [sys.executable, "-c", code]


@pytest.fixture
def make_local(tmp_path):
    made: list[LocalProvisioner] = []

    def make(code: str = SLEEPER, **options) -> LocalProvisioner:
        options.setdefault("log_dir", tmp_path / "log")
        options.setdefault("stop_grace_s", 5.0)
        options.setdefault("max_cpu_workers", 4)
        options.setdefault("cuda_devices", lambda: [])
        provisioner = LocalProvisioner(command_factory=stand_in(code), **options)
        made.append(provisioner)
        return provisioner

    yield make
    # Whatever a test left running goes, by the pids it started (never by name).
    for worker in GpuWorker.objects.filter(provider="local").exclude(external_id=""):
        pid, _ = parse_external_id(worker.external_id)
        with contextlib.suppress(ProcessLookupError, PermissionError):
            if pid != os.getpid() and os.getpgid(pid) == pid:
                os.killpg(pid, signal.SIGKILL)
        child = local_module._CHILDREN.pop(pid, None)
        if child is not None:
            child.wait()


def wait_for(predicate, what: str, limit_s: float = 20.0):
    deadline = time.monotonic() + limit_s
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.05)
    raise AssertionError(f"gave up waiting for {what}")


def pid_of(worker: GpuWorker) -> int:
    return parse_external_id(worker.external_id)[0]


def running(pid: int) -> bool:
    # No waitpid here: reaping is the provisioner's job (it keeps the exit code).
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def log_says(provisioner: LocalProvisioner, worker: GpuWorker, text: str) -> bool:
    path = provisioner.log_path(worker)
    return path.exists() and text in path.read_text()


def test_default_command_is_the_real_gpuworker_command_line():
    worker = GpuWorker(name="local-cpu-abc", device="cuda:1", model_preset="wan-1.3b", gpu_type="h100")
    assert gpuworker_command(worker) == [
        sys.executable,
        str(Path(settings.BASE_DIR) / "manage.py"),
        "gpuworker",
        "--name",
        "local-cpu-abc",
        "--device",
        "cuda:1",
        "--preset",
        "wan-1.3b",
        "--gpu-type",
        "h100",
        "--weights-from",
        "auto",
    ]
    assert LocalProvisioner().command_factory is gpuworker_command


def test_request_creates_provisioning_rows_and_their_processes(make_local):
    provisioner = make_local()
    result = provisioner.request(count=2, gpu_type="cpu", preset="tiny", capacity=3, price_per_hour="0.25")

    assert result.ok and len(result.started) == 2
    workers = list(GpuWorker.objects.filter(pk__in=result.worker_ids))
    assert len({w.name for w in workers}) == 2
    for worker in workers:
        assert worker.status == Status.PROVISIONING
        assert worker.requested_at is not None and worker.released_at is None
        assert (worker.provider, worker.device, worker.gpu_type, worker.model_preset) == (
            "local",
            "cpu",
            "cpu",
            "tiny",
        )
        assert (worker.capacity, worker.price_per_hour) == (3, Decimal("0.2500"))
        pid = pid_of(worker)
        assert running(pid)
        assert os.getpgid(pid) == pid  # its own process group
        wait_for(lambda w=worker: log_says(provisioner, w, "up"), f"{worker.name} log")
    # The audit summary is plain JSON.
    summary = json.loads(json.dumps(result.as_dict()))
    assert summary["granted"] == 2 and summary["action"] == "request"


def test_before_start_sees_committed_rows_before_any_process_runs(make_local):
    # given a scaler that writes each worker's plan in the before_start hook
    provisioner = make_local()
    seen: list[tuple[str, str]] = []

    def write_plans(workers):
        for worker in workers:
            seen.append((worker.name, worker.external_id))
            GpuWorker.objects.filter(pk=worker.pk).update(weights_plan={"source": "peer-0"})

    # when two workers are requested
    result = provisioner.request(count=2, gpu_type="cpu", before_start=write_plans)
    # then the hook saw both rows before they had a process, and each row carries its plan
    assert sorted(name for name, _ in seen) == sorted(w.name for w in result.started)
    assert all(external_id == "" for _, external_id in seen)
    assert all(
        w.weights_plan == {"source": "peer-0"} for w in GpuWorker.objects.filter(pk__in=result.worker_ids)
    )


def test_a_failing_before_start_does_not_stop_the_scale_out(make_local):
    def broken(workers):
        raise RuntimeError("planner down")

    result = make_local().request(count=1, gpu_type="cpu", before_start=broken)
    assert result.ok and len(result.started) == 1


def test_cpu_workers_are_bounded_and_the_shortfall_is_reported(make_local):
    provisioner = make_local(max_cpu_workers=2)
    first = provisioner.request(count=3, gpu_type="cpu")
    second = provisioner.request(count=1, gpu_type="cpu")

    assert len(first.started) == 2 and not first.ok
    assert "LOCAL_MAX_CPU_WORKERS" in first.shortfall
    assert second.started == [] and "2 of at most 2" in second.shortfall
    assert GpuWorker.objects.filter(provider="local", status=Status.PROVISIONING).count() == 2


def test_release_stops_the_process_on_sigterm_and_marks_released(make_local):
    provisioner = make_local()
    worker = GpuWorker.objects.get(pk=provisioner.request(count=1, gpu_type="cpu").worker_ids[0])
    worker_mark_ready(worker=worker)
    pid = pid_of(worker)

    result = provisioner.release(worker)

    worker.refresh_from_db()
    assert result.ok and "SIGTERM" in result.detail
    assert worker.status == Status.RELEASED and worker.released_at is not None
    assert not running(pid)
    again = provisioner.release(worker)
    assert again.ok and again.detail == "already released"


def test_release_kills_a_worker_that_ignores_sigterm_after_the_grace(make_local):
    provisioner = make_local(STUBBORN, stop_grace_s=0.5)
    worker = GpuWorker.objects.get(pk=provisioner.request(count=1, gpu_type="cpu").worker_ids[0])
    wait_for(lambda: log_says(provisioner, worker, "up"), "SIGTERM handler installed")

    result = provisioner.release(worker)

    assert result.ok and "SIGKILL" in result.detail
    assert not running(pid_of(worker))
    assert GpuWorker.objects.get(pk=worker.pk).status == Status.RELEASED


def test_reconcile_marks_a_killed_ready_worker_failed_without_replacing_it(make_local):
    provisioner = make_local()
    worker = GpuWorker.objects.get(pk=provisioner.request(count=1, gpu_type="cpu").worker_ids[0])
    worker_mark_ready(worker=worker)
    os.kill(pid_of(worker), signal.SIGKILL)
    wait_for(lambda: not running(pid_of(worker)), "the kill")

    result = provisioner.reconcile()

    worker.refresh_from_db()
    assert worker.status == Status.FAILED and worker.released_at is not None
    assert [f.worker.name for f in result.failed] == [worker.name]
    assert result.failed[0].was == Status.READY
    assert result.replacements == []  # the scheduler re-places and re-scales, not the provisioner
    assert GpuWorker.objects.filter(provider="local", status__in=GpuWorker.LIVE_STATUSES).count() == 0


def test_a_worker_crashing_while_provisioning_is_retried_a_bounded_number_of_times(make_local):
    provisioner = make_local(CRASHER, max_retries=2)
    first = GpuWorker.objects.get(
        pk=provisioner.request(count=1, gpu_type="cpu", preset="tiny").worker_ids[0]
    )
    outcomes = []
    for _ in range(4):
        live = list(GpuWorker.objects.filter(provider="local", status=Status.PROVISIONING))
        for worker in live:
            wait_for(lambda w=worker: not running(pid_of(w)), f"{worker.name} to crash")
        outcomes.append(provisioner.reconcile())

    # 1 attempt + 2 retries, then the failure is reported instead of replaced.
    assert [len(o.replacements) for o in outcomes] == [1, 1, 0, 0]
    assert len(outcomes[2].exhausted) == 1 and "max retries 2" in outcomes[2].exhausted[0]
    assert GpuWorker.objects.filter(provider="local", status=Status.FAILED).count() == 3
    assert not GpuWorker.objects.filter(provider="local", status__in=GpuWorker.LIVE_STATUSES).exists()
    reason = outcomes[0].failed[0].reason
    assert first.name == outcomes[0].failed[0].worker.name
    assert "exited with code 3" in reason and "boom: cannot load model" in reason
    json.dumps(outcomes[0].as_dict())


def test_a_ready_worker_resets_the_retry_budget(make_local):
    provisioner = make_local(CRASHER, max_retries=0)
    crashed = GpuWorker.objects.get(pk=provisioner.request(count=1, gpu_type="cpu").worker_ids[0])
    wait_for(lambda: not running(pid_of(crashed)), "crash")
    assert provisioner.reconcile().exhausted  # no retry allowed at all
    # A worker of the same kind then comes up: earlier failures no longer count.
    healthy = make_local(SLEEPER)
    ok = GpuWorker.objects.get(pk=healthy.request(count=1, gpu_type="cpu").worker_ids[0])
    worker_mark_ready(worker=ok)
    assert provisioner.consecutive_failures(gpu_type="cpu", preset="tiny", now=ok.ready_at) == 0


def test_reconcile_fails_a_worker_stuck_in_provisioning_only_after_the_timeout(make_local):
    provisioner = make_local(provision_timeout_s=60, max_retries=1)
    worker = GpuWorker.objects.get(pk=provisioner.request(count=1, gpu_type="cpu").worker_ids[0])
    pid = pid_of(worker)

    early = provisioner.reconcile(worker.requested_at + timedelta(seconds=59))
    assert early.failed == [] and running(pid)

    late = provisioner.reconcile(worker.requested_at + timedelta(seconds=61))
    worker.refresh_from_db()
    assert worker.status == Status.FAILED
    assert "still provisioning 61s after the request (timeout 60s)" in late.failed[0].reason
    assert not running(pid)  # what was left of it is stopped
    assert len(late.replacements) == 1 and len(late.replacements[0].started) == 1
    replacement = GpuWorker.objects.get(pk=late.replacements[0].worker_ids[0])
    assert replacement.status == Status.PROVISIONING and running(pid_of(replacement))


def test_cuda_devices_get_one_worker_each_on_a_free_index(make_local):
    provisioner = make_local(cuda_devices=lambda: ["NVIDIA H100 80GB HBM3", "NVIDIA H100 80GB HBM3"])
    first = provisioner.request(count=3, gpu_type="h100", preset="wan-1.3b", price_per_hour="2.99")
    workers = list(GpuWorker.objects.filter(pk__in=first.worker_ids).order_by("device_index"))

    assert [(w.device, w.device_index, w.gpu_type) for w in workers] == [
        ("cuda:0", 0, "h100"),
        ("cuda:1", 1, "h100"),
    ]
    assert "2 of 2 h100 CUDA device(s) free" in first.shortfall
    provisioner.release(workers[0])
    again = provisioner.request(count=1, gpu_type="h100", preset="wan-1.3b")
    assert GpuWorker.objects.get(pk=again.worker_ids[0]).device == "cuda:0"
    # Without a type, a host with GPUs hands out GPUs (none is free now), never CPU workers.
    nothing = provisioner.request(count=1)
    assert nothing.started == [] and "0 of 2 CUDA device(s) free" in nothing.shortfall


def test_matching_devices_are_preferred_and_a_differently_named_profile_still_gets_one(make_local):
    provisioner = make_local(cuda_devices=lambda: ["NVIDIA A100-SXM4-40GB", "NVIDIA H100 80GB HBM3"])
    h100 = provisioner.request(count=1, gpu_type="h100")
    assert GpuWorker.objects.get(pk=h100.worker_ids[0]).device == "cuda:1"
    # A profile key that is no NVML model name: any free device, recorded under the asked type.
    custom = provisioner.request(count=1, gpu_type="a100-40g")
    worker = GpuWorker.objects.get(pk=custom.worker_ids[0])
    assert (worker.device, worker.gpu_type) == ("cuda:0", "a100-40g")


def test_worker_device_setting_forces_cpu_or_cuda(make_local, settings):
    forced_cpu = make_local(worker_device="cpu", cuda_devices=lambda: ["NVIDIA H100 80GB HBM3"])
    worker = GpuWorker.objects.get(pk=forced_cpu.request(count=1, gpu_type="h100").worker_ids[0])
    assert (worker.device, worker.gpu_type) == ("cpu", "h100")
    cuda_only = make_local(worker_device="cuda")
    refused = cuda_only.request(count=1)
    assert (
        refused.started == []
        and "no CUDA device" in refused.shortfall
        and "WORKER_DEVICE=cuda" in refused.shortfall
    )
    settings.STREAMSERVE = {**settings.STREAMSERVE, "WORKER_DEVICE": "tpu"}
    with pytest.raises(ImproperlyConfigured, match="WORKER_DEVICE"):
        LocalProvisioner(cuda_devices=lambda: [])


def test_gpu_type_is_read_from_the_device_name():
    assert gpu_type_of("NVIDIA H100 80GB HBM3") == "h100"
    assert gpu_type_of("NVIDIA A100-SXM4-40GB") == "a100"
    assert gpu_type_of("NVIDIA L4") == "l4"
    assert gpu_type_of("NVIDIA GeForce RTX 4090") == "cuda"


def test_a_fresh_provisioner_finds_processes_by_pid_after_a_restart(make_local):
    before = make_local()
    worker = GpuWorker.objects.get(pk=before.request(count=1, gpu_type="cpu").worker_ids[0])
    after = make_local()  # a new control-plane process: no in-memory handles

    assert after.probe([worker])[worker.pk].alive
    assert after.release(worker).ok
    assert not running(pid_of(worker))


def test_a_reused_pid_is_not_mistaken_for_the_worker_nor_signalled(make_local):
    provisioner = make_local()
    impostor = GpuWorker.objects.create(
        name="local-cpu-impostor",
        provider="local",
        status=Status.PROVISIONING,
        requested_at=timezone.now(),
        external_id=f"{os.getpid()}@1.00",  # our own pid, but another start time
    )
    probe = provisioner.probe([impostor])[impostor.pk]
    assert not probe.alive and f"process {os.getpid()} is gone" in probe.detail
    assert provisioner.stop(impostor) == "process had already exited"  # and we are still here


def test_reconcile_stops_a_process_left_running_for_a_failed_worker(make_local):
    provisioner = make_local()
    worker = GpuWorker.objects.get(pk=provisioner.request(count=1, gpu_type="cpu").worker_ids[0])
    worker_mark_ready(worker=worker)
    worker_fail(worker=worker)  # e.g. the scheduler's heartbeat timeout
    failed_at = GpuWorker.objects.get(pk=worker.pk).released_at

    # Within the grace it may still be exiting by itself: left alone.
    assert provisioner.reconcile(failed_at + timedelta(seconds=5)).stopped_leftovers == []
    assert running(pid_of(worker))
    result = provisioner.reconcile(failed_at + timedelta(seconds=31))

    assert result.stopped_leftovers == [worker.name]
    assert not running(pid_of(worker))


def test_a_start_that_cannot_exec_leaves_a_failed_row_and_an_error(make_local, tmp_path):
    provisioner = LocalProvisioner(
        command_factory=lambda worker: [str(tmp_path / "no-such-binary")],
        log_dir=tmp_path,
        cuda_devices=lambda: [],
    )
    result = provisioner.request(count=1, gpu_type="cpu")
    assert result.started == [] and "cannot start" in result.errors[0]
    failed = GpuWorker.objects.get(provider="local")
    assert failed.status == Status.FAILED and failed.released_at >= failed.requested_at


def test_registry_resolves_names_and_dotted_paths(settings):
    settings.STREAMSERVE = {**settings.STREAMSERVE, "PROVISIONER": "local"}
    assert isinstance(get_provisioner(), LocalProvisioner)
    assert provisioner_class("static") is StaticProvisioner
    assert provisioner_class("gpu.provisioners.local:LocalProvisioner") is LocalProvisioner
    # The spelling PROVISIONER had before the one `package.module:ClassName` syntax still resolves.
    assert provisioner_class("gpu.provisioners.local.LocalProvisioner") is LocalProvisioner
    with pytest.raises(ImproperlyConfigured, match="neither a built-in backend"):
        provisioner_class("nomad")
    with pytest.raises(ImproperlyConfigured, match="cannot be imported"):
        provisioner_class("gpu.provisioners.nomad:NomadProvisioner")
    with pytest.raises(ImproperlyConfigured, match="not a Provisioner subclass"):
        provisioner_class("gpu.models:GpuWorker")


def test_requests_back_off_exponentially_once_retries_are_exhausted(make_local):
    provisioner = make_local(CRASHER, max_retries=0, backoff_s=30)

    def crash_and_reconcile(result):
        worker = GpuWorker.objects.get(pk=result.worker_ids[0])
        wait_for(lambda: not running(pid_of(worker)), "crash")
        assert provisioner.reconcile().exhausted
        worker.refresh_from_db()
        return worker

    first = crash_and_reconcile(provisioner.request(count=1, gpu_type="cpu", preset="tiny"))
    refused = provisioner.request(count=1, gpu_type="cpu", preset="tiny")
    assert (
        refused.started == []
        and "backing off: 1 consecutive provisioning failures of cpu/tiny" in refused.shortfall
    )
    remaining, failures = provisioner.backoff_remaining(gpu_type="cpu", preset="tiny", now=first.released_at)
    assert (remaining, failures) == (30.0, 1)
    assert GpuWorker.objects.filter(provider="local").count() == 1  # refused requests create no rows

    # Once the backoff has passed, one attempt goes through; its failure doubles the wait.
    GpuWorker.objects.filter(pk=first.pk).update(
        requested_at=first.requested_at - timedelta(seconds=31),
        released_at=first.released_at - timedelta(seconds=31),
    )
    second = crash_and_reconcile(provisioner.request(count=1, gpu_type="cpu", preset="tiny"))
    assert provisioner.backoff_remaining(gpu_type="cpu", preset="tiny", now=second.released_at) == (60.0, 2)
    assert "next attempt allowed in" in provisioner.request(count=1, gpu_type="cpu", preset="tiny").shortfall


def test_release_all_stops_every_worker_with_one_shared_grace(make_local):
    provisioner = make_local(STUBBORN, stop_grace_s=0.5)
    workers = list(GpuWorker.objects.filter(pk__in=provisioner.request(count=3, gpu_type="cpu").worker_ids))
    for worker in workers:
        wait_for(lambda w=worker: log_says(provisioner, w, "up"), "SIGTERM handlers installed")

    results = provisioner.release_all()

    assert sorted(r.worker.name for r in results) == sorted(w.name for w in workers)
    assert all(r.ok and r.status == Status.RELEASED for r in results)
    assert not any(running(pid_of(w)) for w in workers)


def test_release_accepts_a_worker_that_deregistered_itself_on_sigterm(make_local, tmp_path):
    from gpu.services import worker_release

    class SelfDeregistering(LocalProvisioner):
        # gpuworker's SIGTERM path releases its own row before it exits.
        def stop(self, worker):
            detail = super().stop(worker)
            worker_release(worker=GpuWorker.objects.get(pk=worker.pk))
            return detail

    provisioner = SelfDeregistering(
        command_factory=stand_in(SLEEPER), log_dir=tmp_path / "log", cuda_devices=lambda: []
    )
    worker = GpuWorker.objects.get(pk=provisioner.request(count=1, gpu_type="cpu").worker_ids[0])

    result = provisioner.release(worker)

    assert result.ok and result.status == Status.RELEASED and "SIGTERM" in result.detail


def request_in(provisioner: LocalProvisioner, region: Region) -> GpuWorker:
    """One CPU worker of ``provisioner`` put in ``region`` before it starts (as the scaler does)."""

    def into_region(workers):
        GpuWorker.objects.filter(pk__in=[w.pk for w in workers]).update(region=region)

    result = provisioner.request(count=1, gpu_type="cpu", before_start=into_region)
    return GpuWorker.objects.get(pk=result.worker_ids[0])


def test_two_pools_side_by_side_each_reconcile_their_own_regions_workers_only(make_local):
    # given two regions, each served by its own local provisioner, with one ready worker each
    east, west = Region.objects.create(name="east"), Region.objects.create(name="west")
    east_pool, west_pool = make_local(regions=[east.pk]), make_local(regions=[west.pk])
    workers = {pool: request_in(pool, region) for pool, region in ((east_pool, east), (west_pool, west))}
    for worker in workers.values():
        worker_mark_ready(worker=worker)
    # when both processes die and east's pool reconciles
    for worker in workers.values():
        os.kill(pid_of(worker), signal.SIGKILL)
        wait_for(lambda w=worker: not running(pid_of(w)), "the kill")
    result = east_pool.reconcile()
    # then only east's worker is failed; west's is not even looked at
    assert (result.checked, [f.worker.name for f in result.failed]) == (1, [workers[east_pool].name])
    statuses = {w.region.name: GpuWorker.objects.get(pk=w.pk).status for w in workers.values()}
    assert statuses == {"east": Status.FAILED, "west": Status.READY}
    # and west's own reconcile fails west's, leaving east's row as it was
    result = west_pool.reconcile()
    assert [f.worker.name for f in result.failed] == [workers[west_pool].name]
    assert GpuWorker.objects.get(pk=workers[east_pool].pk).status == Status.FAILED


def test_a_replacement_joins_the_failed_workers_region(make_local):
    # given a worker of east's pool that crashes while provisioning
    east = Region.objects.create(name="east")
    pool = make_local(CRASHER, regions=[east.pk], max_retries=1)
    first = request_in(pool, east)
    wait_for(lambda: not running(pid_of(first)), "the crash")
    # when the pool reconciles, then its replacement is requested in east too
    (replacement,) = pool.reconcile().replacements
    assert GpuWorker.objects.get(pk=replacement.worker_ids[0]).region == east
