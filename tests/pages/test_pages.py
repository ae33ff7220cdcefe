"""The pages with Django's test client: access rules, rendering, and the console's audited actions."""

from __future__ import annotations

import json
import re
from datetime import timedelta

import pytest
from django.contrib.admin.models import LogEntry
from django.contrib.contenttypes.models import ContentType
from django.utils import timezone

from gpu.models import GpuWorker
from scheduling.console import cluster_snapshot
from scheduling.models import Migration, ScalingAction, SchedulerConfig, SchedulerDecision
from sessions.models import ChunkRecord, GenerationSession, SessionEvent
from tests.factories import ChunkRecordFactory, GpuWorkerFactory, SessionFactory

pytestmark = pytest.mark.django_db


@pytest.fixture
def user_client(client, user):
    client.force_login(user)
    return client


@pytest.fixture
def staff_client(client, staff):
    client.force_login(staff)
    return client


PAGES = ["/", "/jobs/", "/console/", "/console/audit/"]
STAFF_PAGES = ["/console/", "/console/audit/"]


@pytest.mark.parametrize("url", PAGES)
def test_anonymous_visitors_are_sent_to_the_login_page(client, url):
    response = client.get(url)
    assert response.status_code == 302
    assert response["Location"].startswith("/accounts/login/?next=")


def test_login_page_renders_and_logs_in(client, user):
    page = client.get("/accounts/login/?next=/")
    assert page.status_code == 200
    assert b'<label for="id_username">' in page.content

    response = client.post(
        "/accounts/login/", {"username": user.username, "password": "pw-for-tests-1", "next": "/"}
    )

    assert response.status_code == 302 and response["Location"] == "/"
    assert client.get("/").status_code == 200


def test_login_page_explains_a_bad_password(client, user):
    response = client.post("/accounts/login/", {"username": user.username, "password": "wrong"})
    assert response.status_code == 200
    assert b"didn't match" in response.content


def test_generation_page_renders_for_a_user(user_client):
    response = user_client.get("/")
    assert response.status_code == 200
    html = response.content.decode()
    assert 'id="video"' in html and "js/generate.js" in html
    # Start stays disabled until the page's script has loaded the models and owns the submit.
    assert re.search(r'<button[^>]*id="start-submit"[^>]*\bdisabled\b', html)
    # No staff links for ordinary users.
    assert 'href="/console/"' not in html


def test_jobs_page_renders_for_a_user_and_is_linked_from_the_nav(user_client):
    html = user_client.get("/jobs/").content.decode()
    assert "js/jobs.js" in html and 'id="gallery"' in html
    assert re.search(r'<button[^>]*id="job-submit"[^>]*\bdisabled\b', html)
    assert 'href="/jobs/" aria-current="page"' in html
    assert 'href="/jobs/"' in user_client.get("/").content.decode()


@pytest.mark.parametrize("url", STAFF_PAGES)
def test_staff_pages_are_forbidden_to_ordinary_users(user_client, url):
    response = user_client.get(url)
    assert response.status_code == 403
    assert b"staff only" in response.content


@pytest.mark.parametrize("url", STAFF_PAGES)
def test_staff_pages_render_for_staff(staff_client, url):
    GpuWorkerFactory(name="gpu-a")
    response = staff_client.get(url)
    assert response.status_code == 200
    assert b"vendor/uplot/uPlot.iife.min.js" in response.content


def test_console_page_embeds_the_initial_snapshot(staff_client):
    GpuWorkerFactory(name="gpu-a")
    response = staff_client.get("/console/")
    html = response.content.decode()
    start = html.index('<script id="console-snapshot" type="application/json">') + len(
        '<script id="console-snapshot" type="application/json">'
    )
    snapshot = json.loads(html[start : html.index("</script>", start)])
    assert [w["name"] for w in snapshot["workers"]] == ["gpu-a"]


def test_console_json_endpoints_refuse_non_staff(client, user):
    assert client.get("/console/snapshot/").status_code == 401
    client.force_login(user)
    assert client.get("/console/snapshot/").status_code == 403
    worker = GpuWorkerFactory()
    assert client.post(f"/console/workers/{worker.pk}/drain/").status_code == 403
    worker.refresh_from_db()
    assert worker.status == GpuWorker.Status.READY


def test_snapshot_counts_sessions_load_budget_latency_and_cost(staff):
    now = timezone.now()
    busy = GpuWorkerFactory(name="gpu-a", capacity=4, price_per_hour="2.50")
    GpuWorkerFactory(name="gpu-b", status=GpuWorker.Status.PROVISIONING, ready_at=None, price_per_hour="1.00")
    GpuWorkerFactory(
        name="gone",
        status=GpuWorker.Status.RELEASED,
        requested_at=now - timedelta(hours=3),
        released_at=now - timedelta(hours=2),
    )
    executing = [
        SessionFactory(status="executing", worker=busy, state_location="worker", load=load)
        for load in (1.0, 1.6)
    ]
    SessionFactory(status="suspended", host_worker=busy, state_location="host", activity="idle")
    SessionFactory(status="queued", queue_position=1)
    latencies = [100.0] * 98 + [900.0, 1500.0]
    ChunkRecord.objects.bulk_create(
        ChunkRecord(
            session=executing[0],
            chunk_index=i,
            worker=busy,
            batch_size=2,
            generation_ms=ms,
            created_at=now - timedelta(seconds=10),
        )
        for i, ms in enumerate(latencies)
    )
    ChunkRecordFactory(
        session=executing[1], worker=busy, generation_ms=9999.0, created_at=now - timedelta(minutes=5)
    )
    SchedulerDecision.objects.create(
        trigger="tick",
        decided_at=now,
        policy="turboserve",
        active_sessions=2,
        budget=2,
        target_budget=3,
        duration_ms=1.0,
    )

    snap = cluster_snapshot(now=now)

    assert [w["name"] for w in snap["workers"]] == ["gpu-a", "gpu-b"]
    card = snap["workers"][0]
    assert card["sessions"] == 2 and card["parked"] == 1
    assert card["load"] == pytest.approx(2.6) and card["load_ratio"] == pytest.approx(0.65)
    assert snap["sessions"] == {"active": 2, "executing": 2, "migrating": 0, "suspended": 1, "queued": 1}
    assert snap["budget"]["live"] == 2 and snap["budget"]["target"] == 3
    assert snap["latency"]["count"] == 100 + 0  # the 5-minute-old chunk is outside the window
    assert snap["latency"]["worst_ms"] == 1500.0
    assert 900.0 < snap["latency"]["p99_ms"] < 1500.0
    assert snap["latency"]["slo_pass_rate"] == pytest.approx(0.99)
    assert snap["cost_rate_per_hour"] == pytest.approx(3.5)


def test_timeline_merges_decisions_migrations_scaling_and_operator_actions(staff):
    now = timezone.now()
    a, b = GpuWorkerFactory(name="gpu-a"), GpuWorkerFactory(name="gpu-b")
    session = SessionFactory(status="executing", worker=a, state_location="worker")
    SchedulerDecision.objects.create(
        trigger="arrive",
        decided_at=now - timedelta(seconds=3),
        policy="turboserve",
        active_sessions=1,
        budget=1,
        target_budget=2,
        duration_ms=2.0,
    )
    Migration.objects.create(
        session=session, source=a, target=b, reason="rebalance", started_at=now - timedelta(seconds=2)
    )
    ScalingAction.objects.create(
        created_at=now - timedelta(seconds=1),
        direction="out",
        from_budget=1,
        to_budget=2,
        reason="load above band",
    )

    # Periodic ticks that changed nothing are left out; a tick that acted is kept.
    SchedulerDecision.objects.create(
        trigger="tick",
        decided_at=now - timedelta(seconds=4),
        policy="turboserve",
        active_sessions=1,
        budget=1,
        target_budget=1,
        duration_ms=1.0,
    )
    SchedulerDecision.objects.create(
        trigger="tick",
        decided_at=now - timedelta(seconds=5),
        policy="turboserve",
        active_sessions=1,
        budget=1,
        target_budget=1,
        duration_ms=1.0,
        outputs={"suspend": [str(session.pk)], "migrations": []},
    )

    timeline = cluster_snapshot(now=now)["timeline"]

    assert [item["kind"] for item in timeline] == ["scaling", "migration", "decision", "decision"]
    assert "load above band" in timeline[0]["detail"]
    assert "rebalance" in timeline[1]["detail"]
    assert timeline[2]["title"] == "Decision (arrive): no change"
    assert "budget 1 → target 2" in timeline[2]["detail"]
    assert timeline[3]["title"] == "Decision (tick): 1 suspended"


def test_drain_from_the_console_is_recorded(staff_client, staff):
    worker = GpuWorkerFactory(name="gpu-a")

    response = staff_client.post(f"/console/workers/{worker.pk}/drain/")

    assert response.status_code == 200 and response.json()["status"] == "draining"
    entry = LogEntry.objects.get(
        content_type=ContentType.objects.get_for_model(GpuWorker), object_id=str(worker.pk)
    )
    assert entry.user == staff and "Drained from the console" in entry.change_message
    assert cluster_snapshot()["timeline"][0]["kind"] == "operator"


def test_drain_of_a_worker_that_is_not_ready_is_a_409_without_an_audit_entry(staff_client):
    worker = GpuWorkerFactory(status=GpuWorker.Status.PROVISIONING, ready_at=None)

    response = staff_client.post(f"/console/workers/{worker.pk}/drain/")

    assert response.status_code == 409 and "provisioning" in response.json()["detail"]
    assert not LogEntry.objects.exists()


def test_terminate_from_the_console_is_recorded_with_the_operator(staff_client, staff):
    session = SessionFactory(status="queued", queue_position=1)

    response = staff_client.post(f"/console/sessions/{session.pk}/terminate/")

    assert response.status_code == 200
    session.refresh_from_db()
    assert session.status == GenerationSession.Status.TERMINATED
    depart = session.events.get(kind=SessionEvent.Kind.DEPART)
    assert depart.detail["reason"] == f"operator:{staff.username}"
    assert LogEntry.objects.filter(user=staff, object_id=str(session.pk)).count() == 1
    # Idempotent: a second terminate changes nothing and logs nothing.
    staff_client.post(f"/console/sessions/{session.pk}/terminate/")
    assert LogEntry.objects.filter(object_id=str(session.pk)).count() == 1


def test_config_change_from_the_console_is_recorded(staff_client, staff):
    SchedulerConfig.load()

    response = staff_client.post(
        "/console/config/",
        data=json.dumps({"min_gpus": 2, "max_gpus": 8, "target_utilization": 0.7}),
        content_type="application/json",
    )

    assert response.status_code == 200
    config = SchedulerConfig.load()
    assert (config.min_gpus, config.max_gpus, config.target_utilization) == (2, 8, 0.7)
    entry = LogEntry.objects.get(content_type=ContentType.objects.get_for_model(SchedulerConfig))
    assert entry.user == staff
    assert (
        "min_gpus 1 → 2" in entry.change_message and "target_utilization None → 0.7" in entry.change_message
    )


@pytest.mark.parametrize(
    ("body", "field"),
    [
        ({"min_gpus": 5, "max_gpus": 2}, "max_gpus"),
        ({"target_utilization": 1.5}, "target_utilization"),
        ({"slo_ms": 10}, "slo_ms"),
        ({"min_gpus": "many"}, "min_gpus"),
    ],
)
def test_bad_config_is_a_400_naming_the_field_and_changes_nothing(staff_client, body, field):
    before = SchedulerConfig.load()

    response = staff_client.post("/console/config/", data=json.dumps(body), content_type="application/json")

    assert response.status_code == 400 and field in response.json()
    after = SchedulerConfig.load()
    assert (after.min_gpus, after.max_gpus, after.target_utilization) == (
        before.min_gpus,
        before.max_gpus,
        before.target_utilization,
    )
    assert not LogEntry.objects.exists()


def test_console_actions_need_the_csrf_token(staff):
    from django.test import Client

    client = Client(enforce_csrf_checks=True)
    client.force_login(staff)
    worker = GpuWorkerFactory()
    assert client.post(f"/console/workers/{worker.pk}/drain/").status_code == 403
    worker.refresh_from_db()
    assert worker.status == GpuWorker.Status.READY
