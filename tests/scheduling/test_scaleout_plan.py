"""Scale-out over the parameter pool: the plan the scaler writes, the phases, the expected ready time."""

from __future__ import annotations

from datetime import timedelta

import pytest
from django.utils import timezone

from gpu import services as pool
from gpu.models import GpuWorker
from scheduling.live.liveness import workers_check
from scheduling.live.run import _snapshot
from scheduling.live.scaling import boot_seconds, scale_plan_write, scaling_phase_record
from scheduling.models import ScalingAction, SchedulerConfig
from tests.factories import GpuWorkerFactory

pytestmark = pytest.mark.django_db

MB = 1 << 20


def serving(name: str, digest: str = "w1") -> GpuWorker:
    worker = GpuWorkerFactory(name=name, gpu_type="cpu", model_preset="tiny", last_heartbeat=timezone.now())
    holding = pool.worker_holding_register(
        worker=worker, model_preset="tiny", weights_bytes=64 * MB, address=f"{name}:9000"
    )
    pool.holding_complete(holding_id=holding.pk, digest=digest)
    return worker


def provisioning(name: str) -> GpuWorker:
    return GpuWorkerFactory(
        name=name, gpu_type="cpu", model_preset="tiny", status="provisioning", ready_at=None, provider="local"
    )


def action() -> ScalingAction:
    return ScalingAction.objects.create(
        created_at=timezone.now(), direction="out", from_budget=1, to_budget=3, gpu_type="cpu", reason="test"
    )


def test_the_plan_chains_new_workers_from_the_pool_copy():
    # given one serving worker holding the weights and two new workers
    source = serving("src")
    new = [provisioning("t1"), provisioning("t2")]
    scaling = action()
    # when the scaler plans before they start
    plan = scale_plan_write(action=scaling, preset="tiny", workers=new)
    # then every target is in a chain fed by the pool copy, not by disk
    chains = plan["chains"]
    assert sorted(t for c in chains for t in c["targets"]) == ["t1", "t2"]
    assert {c["source"] for c in chains} == {source.name}
    assert plan["fallback"] == "disk" and plan["sources"]["src"]["address"] == "src:9000"
    # and each worker's row carries its position, upstream chain, source address and digest
    for worker in new:
        worker.refresh_from_db()
        part = worker.weights_plan
        assert part["chain"][0] == "src" and part["chain"][part["position"]] == worker.name
        assert part["source_address"] == "src:9000" and part["digest"] == "w1"
        assert worker.expected_ready_at is not None and worker.expected_ready_at >= worker.requested_at
    # and the action records the plan and its workers
    scaling.refresh_from_db()
    assert scaling.plan["chains"] == chains and scaling.expected_ready_at is not None
    assert set(scaling.workers.values_list("name", flat=True)) == {"t1", "t2"}


def test_without_any_pool_copy_the_plan_is_disk():
    new = [provisioning("t1")]
    plan = scale_plan_write(action=action(), preset="tiny", workers=new)
    assert [c["source_kind"] for c in plan["chains"]] == ["disk"]
    new[0].refresh_from_db()
    assert new[0].weights_plan["source_kind"] == "disk"


def test_a_dead_or_loading_holder_is_never_a_source():
    # given a worker that was serving the weights and died, and one still loading them
    dead = serving("dead")
    pool.worker_fail(worker=dead)
    loading = GpuWorkerFactory(name="loading", gpu_type="cpu", model_preset="tiny")
    pool.worker_holding_register(worker=loading, model_preset="tiny", weights_bytes=MB, address="l:1")
    # when a scale-out is planned
    plan = scale_plan_write(action=action(), preset="tiny", workers=[provisioning("t1")])
    # then the only source is disk
    assert [c["source_kind"] for c in plan["chains"]] == ["disk"]


def test_phases_are_recorded_on_the_action_and_it_completes_when_all_are_ready():
    # given a scale-out of two workers
    serving("src")
    t1, t2 = provisioning("t1"), provisioning("t2")
    scaling = action()
    scale_plan_write(action=scaling, preset="tiny", workers=[t1, t2])
    # when t1 goes through every phase and t2 only comes up
    for phase, source in (("process_up", ""), ("weights_complete", "peer"), ("ready", "")):
        scaling_phase_record(worker_id=t1.pk, phase=phase, source=source)
    scaling_phase_record(worker_id=t2.pk, phase="process_up")
    scaling.refresh_from_db()
    # then the action shows each worker's phases and is not done yet
    assert set(scaling.phases["t1"]) == {"process_up", "weights_complete", "ready", "source"}
    assert scaling.phases["t1"]["source"] == "peer" and set(scaling.phases["t2"]) == {"process_up"}
    assert scaling.ready_at is None and scaling.outcome == "requested"
    # when t2 is ready too, the action is done
    scaling_phase_record(worker_id=t2.pk, phase="ready")
    scaling.refresh_from_db()
    assert scaling.ready_at is not None and scaling.outcome == "succeeded"


def test_an_unknown_phase_is_refused():
    with pytest.raises(ValueError, match="phase"):
        scaling_phase_record(worker_id=provisioning("t1").pk, phase="booted")


def test_expected_ready_time_uses_the_measured_boot():
    # given two past workers that took 4 s and 6 s from request to process up
    now = timezone.now()
    for seconds in (4, 6):
        GpuWorkerFactory(
            gpu_type="cpu",
            requested_at=now - timedelta(minutes=1),
            process_up_at=now - timedelta(minutes=1) + timedelta(seconds=seconds),
        )
    assert boot_seconds(gpu_type="cpu") == 5.0
    # when a new worker is planned from disk
    worker = provisioning("t1")
    plan = scale_plan_write(action=action(), preset="tiny", workers=[worker])
    worker.refresh_from_db()
    # then it is expected at request + boot + planned load
    load_s = plan["chains"][0]["ready_s"][0]
    assert worker.expected_ready_at == worker.requested_at + timedelta(seconds=5.0 + load_s)


def test_the_scheduler_sees_a_loading_worker_with_its_expected_ready_time():
    worker = provisioning("t1")
    expected = timezone.now() + timedelta(seconds=7)
    GpuWorker.objects.filter(pk=worker.pk).update(expected_ready_at=expected)
    from scheduling.live.run import _pool_locked

    snapshot = _snapshot(_pool_locked("tiny"), SchedulerConfig.load(), timezone.now().timestamp())
    view = snapshot.gpus["t1"]
    assert view.status == "provisioning" and view.ready_at == pytest.approx(expected.timestamp())


def test_liveness_heals_the_pool_of_a_lost_host_cache(settings):
    cache = pool.host_cache_register(name="c", host="h", address="h:1", capacity_bytes=100 * MB, pinned=False)
    pool.host_copy_register(cache=cache, model_preset="tiny", weights_bytes=MB)
    from gpu.models import HostCache

    HostCache.objects.filter(pk=cache.pk).update(last_heartbeat=timezone.now() - timedelta(hours=1))
    workers_check()
    assert HostCache.objects.get(pk=cache.pk).status == "lost"
    assert not cache.holdings.exists()


def test_the_disk_plan_knows_the_model_size_from_the_weights_file(settings, tmp_path):
    from workers.runtime.models import build_model
    from workers.runtime.weights import pack_model, save_weights

    settings.STREAMSERVE = {**settings.STREAMSERVE, "WEIGHTS_DIR": str(tmp_path)}
    packed = pack_model(build_model("tiny", device="cpu"))
    save_weights(tmp_path / "tiny.safetensors", packed)
    plan = scale_plan_write(action=action(), preset="tiny", workers=[provisioning("t1")])
    assert plan["weights_bytes"] == packed.manifest.total_bytes


def test_a_profile_with_a_scale_out_model_gives_the_topology_and_the_boot(settings, tmp_path, request):
    import json

    from scheduling.core.provisioning import ScaleOutModel
    from scheduling.core.scaleplan import Topology
    from scheduling.live.worker_profiles import gpu_profiles

    # given a profile whose scale-out model says 2.5 s of boot and 0.25 GB/s within a host
    profile = json.loads((settings.BASE_DIR / "scheduling/data/profiles/cpu-tiny.json").read_text())
    profile["scale_out"] = ScaleOutModel(
        boot_s=2.5, weights_bytes=10**6, topology=Topology.flat(0.5, pcie_gbps=0.25, nvme_gbps=0.1)
    ).to_json()
    (tmp_path / "p.json").write_text(json.dumps(profile))
    settings.STREAMSERVE = {**settings.STREAMSERVE, "WORKER_PROFILE": str(tmp_path / "p.json")}
    gpu_profiles.cache_clear()  # profiles are read once per process
    request.addfinalizer(gpu_profiles.cache_clear)
    serving("src")
    # when a scale-out is planned with no boot measured yet
    assert boot_seconds(gpu_type="cpu") == 2.5
    plan = scale_plan_write(action=action(), preset="tiny", workers=[provisioning("t1")])
    # then the chain (both workers on one host) runs at the profile's host link speed
    assert plan["chains"][0]["source"] == "src" and plan["chains"][0]["gbps"] == pytest.approx(0.25)
    assert plan["boot_seconds"] == 2.5
