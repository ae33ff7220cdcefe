"""The operator console's scale-out views: worker phases, the scale plan, the parameter pool."""

from __future__ import annotations

from datetime import timedelta

import pytest
from django.utils import timezone

from gpu import services as pool
from scheduling.console import cluster_snapshot
from scheduling.models import ScalingAction
from tests.factories import GpuWorkerFactory

pytestmark = pytest.mark.django_db


def test_snapshot_shows_phases_plan_and_pool():
    # given a worker whose weights came from a peer, and one still loading with an expected time
    now = timezone.now()
    requested = now - timedelta(seconds=20)
    src = GpuWorkerFactory(name="src")
    done = GpuWorkerFactory(
        name="new",
        requested_at=requested,
        process_up_at=requested + timedelta(seconds=2),
        weights_complete_at=requested + timedelta(seconds=3.5),
        weights_source="peer",
        weights_source_detail="src (src: 5590848 B)",
        ready_at=requested + timedelta(seconds=4),
    )
    GpuWorkerFactory(
        name="loading", status="provisioning", ready_at=None, requested_at=requested,
        expected_ready_at=requested + timedelta(seconds=6),
    )  # fmt: skip
    for worker in (src, done):
        holding = pool.worker_holding_register(
            worker=worker, model_preset="tiny", weights_bytes=100, address="a:1"
        )
        pool.holding_complete(holding_id=holding.pk, digest="d")
    cache = pool.host_cache_register(name="c1", host="h1", address="h1", capacity_bytes=1000, pinned=False)
    pool.host_copy_register(cache=cache, model_preset="tiny", weights_bytes=100)
    action = ScalingAction.objects.create(
        created_at=requested, direction="out", from_budget=1, to_budget=2, gpu_type="cpu", reason="load",
        plan={"chains": [{"source": "src", "targets": ["new"], "gbps": 1.0, "expected_seconds": 1.0}]},
        expected_ready_at=requested + timedelta(seconds=5), ready_at=requested + timedelta(seconds=4),
        phases={"new": {"source": "peer"}},
    )  # fmt: skip
    action.workers.set([done])

    snap = cluster_snapshot(now=now)

    # then the worker cards carry each phase in seconds from the request, and the source
    cards = {w["name"]: w for w in snap["workers"]}
    assert cards["new"]["phases"] == {
        "process_up_s": 2.0,
        "weights_complete_s": 3.5,
        "ready_s": 4.0,
        "expected_ready_s": None,
    }
    assert cards["new"]["weights_source"] == "peer"
    assert (
        cards["loading"]["phases"]["expected_ready_s"] == 6.0
        and cards["loading"]["phases"]["ready_s"] is None
    )
    # and the pool lists the model's copies and the host cache against the bound
    (model,) = snap["parameter_pool"]["models"]
    assert (model["model"], model["gpu_copies"], model["host_copies"], model["loading"]) == ("tiny", 2, 0, 1)
    assert snap["parameter_pool"]["host_copies_bound"] == 1
    assert snap["parameter_pool"]["host_caches"][0]["used_bytes"] == 100
    # and the timeline's scale-out names the plan, the times and the source
    (item,) = [i for i in snap["timeline"] if i["kind"] == "scaling"]
    assert "plan: src → new" in item["detail"] and "all ready in 4.0 s" in item["detail"]
    assert "weights from peer" in item["detail"]


def test_console_page_has_the_pool_section(client, staff):
    client.force_login(staff)
    page = client.get("/console/").content.decode()
    assert 'id="pool-models"' in page and "Parameter pool" in page


def test_parameter_pool_endpoint_is_staff_only(staff_api, user_api):
    worker = GpuWorkerFactory(name="src")
    holding = pool.worker_holding_register(
        worker=worker, model_preset="tiny", weights_bytes=100, address="a:1"
    )
    pool.holding_complete(holding_id=holding.pk, digest="d")
    assert user_api.get("/api/parameter-pool/").status_code == 403
    body = staff_api.get("/api/parameter-pool/").json()
    assert body["host_copies_bound"] == 1
    assert body["models"][0]["copies"][0]["holder"] == "src"


def test_worker_and_scaling_action_api_expose_the_phases(staff_api):
    worker = GpuWorkerFactory(name="w", weights_source="disk", weights_complete_at=timezone.now())
    body = staff_api.get(f"/api/workers/{worker.pk}/").json()
    assert body["weights_source"] == "disk" and body["weights_complete_at"] is not None
