"""Tenants (issue 29): who a user acts for, the tenants API, quotas refused with a 429 naming the quota,
and GPU-seconds charged from the audit's records so that the tenants plus the pool's overhead are the
ledger."""

from __future__ import annotations

import json
from datetime import UTC, datetime, timedelta
from decimal import Decimal

import pytest
from asgiref.sync import sync_to_async
from django.utils import timezone

from gpu.models import CostLedgerEntry
from gpu.services import ledger_accrue
from sessions import tenants, usage
from sessions.models import GenerationSession, Job, Tenant, TenantMembership
from tests.factories import ChunkRecordFactory, GpuWorkerFactory, JobFactory, SessionFactory, UserFactory
from tests.sessions.sockets import connect_as

pytestmark = pytest.mark.django_db


def create_session(client, headers=None, **overrides):
    body = {"prompt": "a lighthouse at dusk", "model": "tiny", "resolution": "64x64", **overrides}
    return client.post("/api/sessions/", body, format="json", headers=headers)


def create_job(client, **overrides):
    return client.post(
        "/api/jobs/", {"kind": "image", "prompt": "a fox", "model": "tiny", **overrides}, format="json"
    )


def team(name: str, *members, default: bool = False, **fields) -> Tenant:
    tenant = Tenant.objects.create(name=name, **fields)
    for user in members:
        tenants.membership_add(tenant=tenant, user=user, is_default=default)
    return tenant


# --- who a request acts for -------------------------------------------------------------------------


def test_a_user_in_no_tenant_acts_for_the_default_one_and_joins_it(user_api, user):
    response = create_session(user_api)
    assert response.status_code == 201, response.content
    assert response.json()["tenant"] == "default"
    membership = TenantMembership.objects.get(user=user)
    assert (membership.tenant.name, membership.is_default) == ("default", True)
    assert GenerationSession.objects.get().tenant == membership.tenant


def test_a_user_acts_for_their_default_or_the_tenant_named_by_header_or_field(user_api, user):
    research = team("research", user, default=True)
    vision = team("vision", user)

    by_default = create_session(user_api)
    by_header = create_session(user_api, headers={"X-StreamServe-Tenant": "vision"})
    by_field = create_job(user_api, tenant="vision")

    assert by_default.json()["tenant"] == "research"
    assert by_header.json()["tenant"] == "vision"
    assert by_field.status_code == 201, by_field.content
    assert Job.objects.get().tenant == vision
    assert GenerationSession.objects.filter(tenant=research).count() == 1


def test_naming_a_tenant_one_does_not_belong_to_is_a_400_on_tenant(user_api, user, other_user):
    team("vision", other_user)
    response = create_session(user_api, tenant="vision")
    assert response.status_code == 400
    assert "not a member of tenant 'vision'" in response.json()["tenant"][0]
    assert GenerationSession.objects.count() == 0


def test_the_openai_adapter_acts_for_the_tenant_the_header_names(user_api, user, other_user):
    vision = team("vision", user)
    team("audio", other_user)
    body = {"prompt": "waves", "model": "tiny", "seconds": 2}

    mine = user_api.post("/v1/videos", body, format="json", headers={"X-StreamServe-Tenant": "vision"})
    theirs = user_api.post("/v1/videos", body, format="json", headers={"X-StreamServe-Tenant": "audio"})

    assert mine.status_code == 200, mine.content
    assert Job.objects.get(pk=mine.json()["id"]).tenant == vision
    assert theirs.status_code == 400
    assert (theirs.json()["error"]["param"], theirs.json()["error"]["code"]) == ("tenant", "invalid_tenant")
    assert "not a member of tenant 'audio'" in theirs.json()["error"]["message"]
    assert Job.objects.count() == 1


# --- quotas -------------------------------------------------------------------------------------------


def test_over_its_live_sessions_quota_a_tenant_is_refused_with_a_429_and_keeps_its_sessions(user_api, user):
    tenant = team("vision", user, default=True, max_live_sessions=1)
    running = SessionFactory(owner=user, tenant=tenant, status=GenerationSession.Status.QUEUED)

    response = create_session(user_api)

    assert response.status_code == 429
    body = response.json()
    assert (body["code"], body["tenant"], body["quota"], body["limit"], body["used"]) == (
        "tenant_quota_exceeded",
        "vision",
        "max_live_sessions",
        1,
        1,
    )
    assert body["resets_at"] is None
    assert GenerationSession.objects.get() == running
    running.refresh_from_db()
    assert running.status == GenerationSession.Status.QUEUED


def test_over_its_daily_gpu_seconds_a_hard_tenant_gets_429_with_reset_time(user_api, user):
    tenant = team("vision", user, default=True, gpu_seconds_per_day=1.0)
    session = SessionFactory(owner=user, tenant=tenant)
    # Three chunks of a 1.2 s step in a batch of three: 1.2 GPU-seconds, over the quota of 1.
    for index in range(3):
        ChunkRecordFactory(session=session, chunk_index=index, batch_size=3, generation_ms=1200.0)

    response = create_session(user_api)

    assert response.status_code == 429
    body = response.json()
    assert (body["quota"], body["limit"], body["used"]) == ("gpu_seconds_per_day", 1.0, 1.2)
    tomorrow = tenants.day_start(timezone.now()) + timedelta(days=1)
    assert datetime.fromisoformat(body["resets_at"]) == tomorrow
    assert 0 < int(response["Retry-After"]) <= 86400
    assert "gpu_seconds_per_day = 1" in body["detail"]


def test_a_soft_gpu_quota_lets_work_in(user_api, user):
    tenant = team("vision", user, default=True, gpu_seconds_per_day=1.0, gpu_quota_enforcement="soft")
    ChunkRecordFactory(session=SessionFactory(owner=user, tenant=tenant), generation_ms=5000.0)
    assert tenants.gpu_quota_state(tenant=tenant).over
    assert create_session(user_api).status_code == 201


def test_over_its_queued_jobs_quota_a_tenant_is_refused_on_rest_and_openai(user_api, user):
    tenant = team("vision", user, default=True, max_queued_jobs=1)
    JobFactory(owner=user, tenant=tenant)

    response = create_job(user_api)
    openai = user_api.post("/v1/images/generations", {"prompt": "a fox", "model": "tiny"}, format="json")

    assert response.status_code == 429
    assert (response.json()["quota"], response.json()["limit"]) == ("max_queued_jobs", 1)
    assert openai.status_code == 429
    assert openai.json()["error"]["code"] == "tenant_quota_exceeded"
    assert Job.objects.count() == 1


@pytest.mark.usefixtures("close_thread_connections")
@pytest.mark.asyncio
@pytest.mark.django_db(transaction=True)
async def test_over_its_quota_a_tenant_gets_an_error_frame_on_the_realtime_socket():
    def given():
        user = UserFactory()
        team("vision", user, default=True, max_live_sessions=0)
        return user

    user = await sync_to_async(given)()
    socket = await connect_as(user, "/v1/realtime/video")
    await socket.send_to(text_data=json.dumps({"type": "session.start", "model": "tiny", "prompt": "a fox"}))
    frame = json.loads(await socket.receive_from(timeout=10))
    await socket.disconnect()
    assert frame["type"] == "error"
    assert "over its quota max_live_sessions = 0" in frame["message"]
    assert await sync_to_async(GenerationSession.objects.count)() == 0


# --- the tenants API ----------------------------------------------------------------------------------


def test_staff_create_and_change_tenants_and_members(staff_api, user):
    created = staff_api.post(
        "/api/tenants/", {"name": "vision", "weight": 3, "gpu_seconds_per_day": 3600}, format="json"
    )
    assert created.status_code == 201, created.content
    pk = created.json()["id"]
    assert (
        staff_api.post(
            f"/api/tenants/{pk}/members/", {"username": user.username, "is_default": True}
        ).status_code
        == 200
    )
    changed = staff_api.patch(f"/api/tenants/{pk}/", {"max_live_sessions": 2}, format="json")
    assert changed.json()["members"] == [{"username": user.username, "is_default": True}]
    assert Tenant.objects.get(pk=pk).max_live_sessions == 2
    removed = staff_api.delete(f"/api/tenants/{pk}/members/?username={user.username}")
    assert removed.json()["members"] == []


@pytest.mark.parametrize(
    ("body", "field", "reason"),
    [
        ({"name": "a b"}, "name", "letters, numbers"),
        ({"name": 123}, "name", "Not a valid string"),
        ({"name": "t", "weight": 0}, "weight", "greater than or equal"),
        ({"name": "t", "weight": "NaN"}, "weight", "valid number"),
        ({"name": "t", "weight": True}, "weight", "valid number"),
        ({"name": "t", "gpu_seconds_per_day": -1}, "gpu_seconds_per_day", "greater than or equal"),
        ({"name": "t", "priority_class": "vip"}, "priority_class", "not a valid choice"),
        ({"name": "t", "gpu_quota_enforcement": "maybe"}, "gpu_quota_enforcement", "not a valid choice"),
    ],
)
def test_bad_tenant_input_is_a_400_naming_field_and_reason(staff_api, body, field, reason):
    response = staff_api.post("/api/tenants/", body, format="json")
    assert response.status_code == 400
    assert reason in str(response.json()[field])
    assert not Tenant.objects.filter(name=body["name"]).exists()


def test_members_read_only_their_tenants_and_write_nothing(user_api, user, other_user):
    mine = team("vision", user)
    theirs = team("audio", other_user)
    listing = user_api.get("/api/tenants/")
    assert [t["name"] for t in listing.json()["results"]] == ["vision"]
    assert user_api.get(f"/api/tenants/{theirs.pk}/").status_code == 404
    assert user_api.get(f"/api/tenants/{theirs.pk}/usage/").status_code == 404
    assert user_api.patch(f"/api/tenants/{mine.pk}/", {"weight": 9}, format="json").status_code == 403
    assert user_api.post("/api/tenants/", {"name": "mine"}, format="json").status_code == 403
    assert user_api.get("/api/audit/tenants/").status_code == 403


def test_a_member_reads_their_usage_and_quotas(user_api, user):
    tenant = team("vision", user, max_live_sessions=4)
    session = SessionFactory(owner=user, tenant=tenant)
    ChunkRecordFactory(session=session, batch_size=2, generation_ms=500.0)

    body = user_api.get(f"/api/tenants/{tenant.pk}/usage/").json()

    assert body["tenant"] == "vision"
    assert body["totals"]["by_tenant"]["vision"]["stream_gpu_seconds"] == pytest.approx(0.25)
    assert "pool_overhead" not in body["totals"]
    assert body["quotas"]["max_live_sessions"] == {"limit": 4, "used": 1}
    assert body["quotas"]["gpu_seconds_per_day"]["used"] == pytest.approx(0.25)


# --- GPU-seconds, measured --------------------------------------------------------------------------


def test_chunks_are_charged_their_batch_share_jobs_their_run_and_the_rest_is_pool_overhead(staff_api):
    # Given: a worker billed three whole minutes ($3.60/h: $0.001 a second) ...
    start = (timezone.now() - timedelta(minutes=10)).replace(second=0, microsecond=0)
    worker = GpuWorkerFactory(requested_at=start, ready_at=start + timedelta(seconds=40))
    worker.released_at = start + timedelta(minutes=3)
    worker.status = worker.Status.RELEASED
    worker.save()
    ledger_accrue(until=start + timedelta(minutes=5))
    vision, audio = team("vision"), team("audio")
    # ... a batch of four 0.4 s steps shared by both tenants (0.1 s a chunk), a chunk alone, a job
    in_minute_1 = start + timedelta(seconds=70)
    for tenant, n in ((vision, 3), (audio, 1)):
        session = SessionFactory(tenant=tenant)
        for index in range(n):
            ChunkRecordFactory(
                session=session, worker=worker, chunk_index=index, batch_size=4, generation_ms=400.0,
                created_at=in_minute_1,
            )  # fmt: skip
    ChunkRecordFactory(
        session=SessionFactory(tenant=None), worker=worker, batch_size=1, generation_ms=250.0,
        created_at=in_minute_1,
    )  # fmt: skip
    JobFactory(
        tenant=audio,
        worker=worker,
        state=Job.State.FAILED,
        run_s=5.0,
        finished_at=start + timedelta(seconds=150),
    )

    # When: the pool's usage is read per minute
    params = {
        "start": start.isoformat(),
        "end": (start + timedelta(minutes=5)).isoformat(),
        "bucket": "minute",
    }
    body = staff_api.get("/api/audit/tenants/", params).json()
    csv_rows = staff_api.get("/api/audit/tenants/", {**params, "format": "csv"}).content.decode().splitlines()

    # Then: each chunk costs its share of the step, the job its run; the default tenant takes the
    # rows without one; the boot, the idle slots are the pool's
    by_tenant = body["totals"]["by_tenant"]
    assert by_tenant["vision"]["stream_gpu_seconds"] == pytest.approx(0.3)
    assert by_tenant["audio"]["stream_gpu_seconds"] == pytest.approx(0.1)
    assert by_tenant["audio"]["job_gpu_seconds"] == pytest.approx(5.0)
    assert by_tenant["default"]["gpu_seconds"] == pytest.approx(0.25)
    assert Decimal(str(by_tenant["audio"]["cost_usd"])) == Decimal("0.0051")
    ledger = CostLedgerEntry.objects.filter(worker=worker)
    ledger_seconds = sum(e.gpu_seconds for e in ledger)
    ledger_cost = sum(e.cost_usd for e in ledger)
    assert ledger_seconds == 180.0
    # ... and, per bucket and over the range, the tenants plus the overhead are the ledger
    for figures in [*body["buckets"], body["totals"]]:
        charged = figures["by_tenant"].values()
        assert sum(f["gpu_seconds"] for f in charged) + figures["pool_overhead"][
            "gpu_seconds"
        ] == pytest.approx(figures["ledger"]["gpu_seconds"])
        assert sum(Decimal(str(f["cost_usd"])) for f in charged) + Decimal(
            str(figures["pool_overhead"]["cost_usd"])
        ) == Decimal(str(figures["ledger"]["cost_usd"]))
    assert body["totals"]["ledger"]["gpu_seconds"] == ledger_seconds
    assert Decimal(str(body["totals"]["ledger"]["cost_usd"])) == ledger_cost
    assert body["totals"]["pool_overhead"]["gpu_seconds"] == pytest.approx(180.0 - 5.65)
    # ... the first minute (boot and idle) is all overhead; the CSV has one row per bucket and tenant
    assert body["buckets"][0]["by_tenant"] == {}
    assert body["buckets"][0]["pool_overhead"]["gpu_seconds"] == 60.0
    assert csv_rows[0] == ",".join(usage.USAGE_CSV_HEADER)
    minute_1 = (start + timedelta(minutes=1)).astimezone(UTC).isoformat()
    assert [row.split(",")[1] for row in csv_rows[1:] if row.startswith(minute_1)] == [
        "audio",
        "default",
        "vision",
        "(pool overhead)",
    ]


def test_fair_share_usage_reads_gpu_seconds_per_tenant_in_a_window():
    vision = team("vision")
    now = timezone.now()
    ChunkRecordFactory(
        session=SessionFactory(tenant=vision), batch_size=2, generation_ms=800.0, created_at=now
    )
    ChunkRecordFactory(session=SessionFactory(tenant=None), generation_ms=300.0, created_at=now)
    ChunkRecordFactory(session=SessionFactory(tenant=vision), created_at=now - timedelta(hours=2))
    assert usage.tenants_gpu_seconds(since=now - timedelta(hours=1), until=now + timedelta(seconds=1)) == (
        pytest.approx({"vision": 0.4, "default": 0.3})
    )
