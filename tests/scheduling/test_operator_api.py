from __future__ import annotations

from datetime import timedelta

import pytest
from django.utils import timezone

from scheduling.models import Migration, ScalingAction, SchedulerDecision
from tests.factories import GpuWorkerFactory, SessionFactory

pytestmark = pytest.mark.django_db


def test_workers_list_filter_and_drain(staff_api):
    ready = GpuWorkerFactory(gpu_type="h100")
    GpuWorkerFactory(gpu_type="h20")
    SessionFactory(status="executing", worker=ready, state_location="worker")
    body = staff_api.get("/api/workers/?gpu_type=h100").json()
    assert body["count"] == 1 and body["results"][0]["sessions"] == 1
    drained = staff_api.post(f"/api/workers/{ready.pk}/drain/")
    assert drained.status_code == 200 and drained.json()["status"] == "draining"
    assert staff_api.post(f"/api/workers/{ready.pk}/drain/").json()["status"] == "draining"  # idempotent
    released = GpuWorkerFactory(status="released", released_at=timezone.now())
    refused = staff_api.post(f"/api/workers/{released.pk}/drain/")
    assert refused.status_code == 409 and "released" in refused.json()["detail"]


def test_history_endpoints_filter_by_time_and_outcome(staff_api):
    now = timezone.now()
    old = SchedulerDecision.objects.create(
        trigger="tick",
        decided_at=now - timedelta(hours=2),
        policy="turboserve",
        active_sessions=3,
        budget=2,
        target_budget=2,
        duration_ms=0.4,
    )
    SchedulerDecision.objects.create(
        trigger="active",
        decided_at=now,
        policy="turboserve",
        active_sessions=4,
        budget=2,
        target_budget=3,
        duration_ms=0.5,
        rho_max=0.9,
        rho_hat=0.7,
    )
    recent = staff_api.get("/api/decisions/", {"after": (now - timedelta(hours=1)).isoformat()}).json()
    assert recent["count"] == 1 and recent["results"][0]["trigger"] == "active"
    assert staff_api.get("/api/decisions/?trigger=tick").json()["results"][0]["id"] == old.pk
    a, b = GpuWorkerFactory(), GpuWorkerFactory()
    session = SessionFactory()
    Migration.objects.create(
        session=session,
        source=a,
        target=b,
        reason="rebalance",
        started_at=now,
        outcome="succeeded",
        finished_at=now,
        duration_ms=25.0,
        state_bytes=1024,
    )
    Migration.objects.create(
        session=session,
        source=b,
        target=a,
        reason="drain",
        started_at=now,
        outcome="failed",
        finished_at=now,
        error="peer died",
    )
    failed = staff_api.get("/api/migrations/?outcome=failed").json()["results"]
    assert [(m["source"], m["target"], m["error"]) for m in failed] == [(b.name, a.name, "peer died")]
    ScalingAction.objects.create(
        created_at=now, direction="out", from_budget=2, to_budget=3, reason="rho_max>0.8"
    )
    assert staff_api.get("/api/scaling-actions/?direction=in").json()["count"] == 0
    assert staff_api.get("/api/scaling-actions/?direction=out").json()["results"][0]["to_budget"] == 3


def test_scheduler_config_update_and_validation(staff_api):
    body = staff_api.get("/api/scheduler/config/").json()
    assert body["policy"] == "turboserve"
    ok = staff_api.patch(
        "/api/scheduler/config/", {"min_gpus": 2, "max_gpus": 6, "target_utilization": 0.7}, format="json"
    )
    assert ok.status_code == 200 and ok.json()["max_gpus"] == 6
    bad = staff_api.patch("/api/scheduler/config/", {"min_gpus": 9}, format="json")
    assert bad.status_code == 400 and "max_gpus" in bad.json()
    bad = staff_api.patch("/api/scheduler/config/", {"target_utilization": 1.5}, format="json")
    assert bad.status_code == 400 and "target_utilization" in bad.json()


def test_a_boolean_is_not_a_number(staff_api):
    # Found by the schema fuzzer: DRF's FloatField took `true` as 1.0 and answered 200.
    before = staff_api.get("/api/scheduler/config/").json()
    bad = staff_api.patch("/api/scheduler/config/", {"target_utilization": True}, format="json")
    assert bad.status_code == 400 and "target_utilization" in bad.json()
    assert (
        staff_api.get("/api/scheduler/config/").json()["target_utilization"] == before["target_utilization"]
    )


def test_session_migrate_endpoint(staff_api, user_api):
    source = GpuWorkerFactory(gpu_type="cpu")
    target = GpuWorkerFactory(gpu_type="cpu")
    session = SessionFactory(status="executing", worker=source, state_location="worker", epoch=3)
    url = f"/api/sessions/{session.pk}/migrate/"
    assert user_api.post(url, {"target": target.name}, format="json").status_code == 403
    refused = staff_api.post(url, {"target": "nobody"}, format="json")
    assert refused.status_code == 400 and "no worker is named" in str(refused.json()["target"])
    assert staff_api.post(url, {}, format="json").json()["target"]  # the field is required
    missing = staff_api.post(
        "/api/sessions/00000000-0000-0000-0000-000000000000/migrate/", {"target": target.name}, format="json"
    )
    assert missing.status_code == 404
    accepted = staff_api.post(url, {"target": target.name}, format="json")
    assert accepted.status_code == 202 and accepted.json()["epoch"] == 4
    assert Migration.objects.get(pk=accepted.json()["migration"]).target_id == target.pk
