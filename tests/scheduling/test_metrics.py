"""/metrics: every family with values that match the database fixtures; token protection."""

from __future__ import annotations

from datetime import timedelta
from decimal import Decimal

import pytest
from django.utils import timezone
from prometheus_client.parser import text_string_to_metric_families

from gpu.models import GpuWorker
from scheduling import metrics
from scheduling.models import Migration, ScalingAction, SchedulerDecision
from sessions.models import GenerationSession, Tenant
from tests.factories import ChunkRecordFactory, GpuWorkerFactory, JobFactory, SessionFactory, UserFactory

pytestmark = pytest.mark.django_db
Status = GpuWorker.Status
S = GenerationSession.Status

FAMILIES = {
    "streamserve_chunk_generation_seconds",
    "streamserve_chunk_delivery_seconds",
    "streamserve_sessions",
    "streamserve_sessions_by_activity",
    "streamserve_jobs",
    "streamserve_gpu_workers",
    "streamserve_cost_rate_dollars_per_hour",
    "streamserve_gpu_capacity_sessions",
    "streamserve_gpu_worker_heartbeat_age_seconds",
    "streamserve_gpu_worker_sessions",
    "streamserve_gpu_worker_utilization_ratio",
    "streamserve_gpu_worker_memory_used_bytes",
    "streamserve_gpu_worker_power_watts",
    "streamserve_gpu_worker_temperature_celsius",
    "streamserve_migrations",
    "streamserve_migrations_pending",
    "streamserve_scaling_actions",
    "streamserve_scaling_actions_pending",
    "streamserve_scheduler_decisions",
    "streamserve_scheduler_decision_seconds",
    "streamserve_metrics_window_seconds",
    "streamserve_metrics_collect_seconds",
    "streamserve_scaleout_phase_seconds",
    "streamserve_weight_copies",
    "streamserve_worker_expected_ready_seconds",
    "streamserve_tenant_sessions",
    "streamserve_tenant_jobs_queued",
    "streamserve_tenant_gpu_seconds",
    "streamserve_tenant_weight",
}


@pytest.fixture(autouse=True)
def fresh_collector(monkeypatch):
    # Incremental counters live per process; each test starts from its own database.
    monkeypatch.setattr(metrics, "_registry", None)


def scrape(client, **headers) -> dict[str, dict[tuple, float]]:
    response = client.get("/metrics", **headers)
    assert response.status_code == 200, response.content
    assert response["Content-Type"].startswith("text/plain; version=")
    samples: dict[str, dict[tuple, float]] = {}
    for family in text_string_to_metric_families(response.content.decode()):
        samples.setdefault(family.name, {})
        for sample in family.samples:
            samples.setdefault(sample.name, {})[tuple(sorted(sample.labels.items()))] = sample.value
    return samples


def value(samples, name, **labels) -> float:
    return samples[name][tuple(sorted(labels.items()))]


def buckets(samples, name, **labels) -> dict[str, float]:
    return {
        dict(key)["le"]: v
        for key, v in samples[f"{name}_bucket"].items()
        if {k: val for k, val in key if k != "le"} == labels
    }


@pytest.fixture
def cluster():
    now = timezone.now()
    h100_a = GpuWorkerFactory(
        name="h100-a", gpu_type="h100", last_heartbeat=now - timedelta(seconds=2),
        utilization_pct=87.5, memory_used_bytes=40 * 2**30, power_watts=512.0, temperature_c=61.0,
    )  # fmt: skip
    h100_b = GpuWorkerFactory(name="h100-b", gpu_type="h100", last_heartbeat=now - timedelta(seconds=1))
    GpuWorkerFactory(
        name="h100-boot",
        gpu_type="h100",
        status=Status.PROVISIONING,
        ready_at=None,
        price_per_hour=Decimal("2.0"),
    )
    h20 = GpuWorkerFactory(
        name="h20-a",
        gpu_type="h20",
        status=Status.DRAINING,
        price_per_hour=Decimal("1.6"),
        capacity=12,
        last_heartbeat=now,
    )
    GpuWorkerFactory(name="h100-old", gpu_type="h100", status=Status.RELEASED, released_at=now)
    GpuWorkerFactory(name="h100-dead", gpu_type="h100", status=Status.FAILED, released_at=now)

    owner = UserFactory()  # one user: password hashing per session would dominate the test's time
    SessionFactory(owner=owner, status=S.QUEUED, queue_position=1)
    SessionFactory(owner=owner, status=S.QUEUED, queue_position=2)
    executing = [
        SessionFactory(owner=owner, status=S.EXECUTING, worker=h100_a, state_location="worker")
        for _ in range(3)
    ]
    SessionFactory(
        owner=owner, status=S.SUSPENDED, activity="idle", state_location="host", host_worker=h100_a
    )
    for _ in range(2):
        SessionFactory(owner=owner, status=S.TERMINATED, terminated_at=now)

    # Chunks in the window on h100 and h20, and one an hour old (outside the window).
    for ms, delivery in [(80, 5), (400, 20), (900, None), (1100, 8), (2500, 30)]:
        ChunkRecordFactory(session=executing[0], worker=h100_a, generation_ms=ms, delivery_ms=delivery)
    ChunkRecordFactory(session=executing[1], worker=h20, generation_ms=700, delivery_ms=4)
    ChunkRecordFactory(session=executing[1], worker=h100_b, generation_ms=1200, delivery_ms=None)
    ChunkRecordFactory(session=executing[2], worker=None, generation_ms=300)  # its worker row was deleted
    ChunkRecordFactory(
        session=executing[2], worker=h100_b, generation_ms=50, created_at=now - timedelta(hours=1)
    )

    for trigger, ms, age in [("tick", 2, 10), ("tick", 12, 20), ("arrive", 40, 30), ("manual", 500, 7200)]:
        SchedulerDecision.objects.create(
            trigger=trigger,
            decided_at=now - timedelta(seconds=age),
            policy="turboserve",
            active_sessions=3,
            budget=2,
            target_budget=2,
            duration_ms=ms,
        )
    migrations = []
    for outcome in ["succeeded", "succeeded", "failed", "pending"]:
        migrations.append(
            Migration.objects.create(
                session=executing[0],
                source=h100_a,
                target=h100_b,
                reason="rebalance",
                outcome=outcome,
                started_at=now,
                finished_at=None if outcome == "pending" else now,
            )
        )
    for direction, outcome, to in [("out", "succeeded", 3), ("in", "failed", 1), ("out", "requested", 4)]:
        ScalingAction.objects.create(
            created_at=now, direction=direction, from_budget=2, to_budget=to, reason="test", outcome=outcome
        )
    return {"pending_migration": migrations[-1]}


def test_every_family_is_exposed_with_values_matching_the_database(client, cluster):
    samples = scrape(client)

    assert set(samples) >= FAMILIES
    # Workers by status and type; cost rate of billed (live) workers; capacity of ready ones.
    assert value(samples, "streamserve_gpu_workers", status="ready", gpu_type="h100") == 2
    assert value(samples, "streamserve_gpu_workers", status="provisioning", gpu_type="h100") == 1
    assert value(samples, "streamserve_gpu_workers", status="draining", gpu_type="h20") == 1
    assert value(samples, "streamserve_gpu_workers", status="released", gpu_type="h100") == 1
    assert value(samples, "streamserve_gpu_workers", status="failed", gpu_type="h100") == 1
    assert value(samples, "streamserve_cost_rate_dollars_per_hour", gpu_type="h100") == pytest.approx(
        3.6 + 3.6 + 2.0
    )
    assert value(samples, "streamserve_cost_rate_dollars_per_hour", gpu_type="h20") == pytest.approx(1.6)
    assert value(samples, "streamserve_gpu_capacity_sessions", gpu_type="h100") == 8
    # Sessions: terminated ones are not counted.
    assert value(samples, "streamserve_sessions", status="queued") == 2
    assert value(samples, "streamserve_sessions", status="executing") == 3
    assert value(samples, "streamserve_sessions", status="suspended") == 1
    assert value(samples, "streamserve_sessions", status="migrating") == 0
    assert value(samples, "streamserve_sessions_by_activity", activity="active") == 5
    assert value(samples, "streamserve_sessions_by_activity", activity="idle") == 1
    assert value(samples, "streamserve_gpu_worker_sessions", worker="h100-a", gpu_type="h100") == 3
    assert value(samples, "streamserve_gpu_worker_sessions", worker="h100-boot", gpu_type="h100") == 0
    assert (
        1.5
        <= value(samples, "streamserve_gpu_worker_heartbeat_age_seconds", worker="h100-a", gpu_type="h100")
        < 60
    )
    a = {"worker": "h100-a", "gpu_type": "h100"}
    assert value(samples, "streamserve_gpu_worker_utilization_ratio", **a) == pytest.approx(0.875)
    assert value(samples, "streamserve_gpu_worker_memory_used_bytes", **a) == 40 * 2**30
    assert value(samples, "streamserve_gpu_worker_power_watts", **a) == 512.0
    assert value(samples, "streamserve_gpu_worker_temperature_celsius", **a) == 61.0
    assert len(samples["streamserve_gpu_worker_power_watts"]) == 1  # no reading, no sample
    assert ("worker", "h100-boot") not in dict(
        k for key in samples["streamserve_gpu_worker_heartbeat_age_seconds"] for k in key
    ).items()


def test_chunk_latency_histogram_covers_the_window_only(client, cluster):
    samples = scrape(client)

    h100 = buckets(samples, "streamserve_chunk_generation_seconds", gpu_type="h100")
    assert h100["0.05"] == 0  # the 50 ms chunk is an hour old
    # Two h100 workers merged into one series: 80, 400, 900, 1100, 2500 ms on one, 1200 ms on the other.
    h100_counts = tuple(h100[le] for le in ("0.1", "0.5", "1.0", "1.25", "3.0", "+Inf"))
    assert h100_counts == (1, 2, 3, 5, 6, 6)
    assert value(samples, "streamserve_chunk_generation_seconds_gsum", gpu_type="h100") == pytest.approx(6.18)
    assert value(samples, "streamserve_chunk_generation_seconds_gcount", gpu_type="h100") == 6
    unknown = buckets(samples, "streamserve_chunk_generation_seconds", gpu_type="unknown")
    assert (unknown["0.25"], unknown["0.5"], unknown["+Inf"]) == (0, 1, 1)
    h20 = buckets(samples, "streamserve_chunk_generation_seconds", gpu_type="h20")
    assert (h20["0.5"], h20["0.75"], h20["+Inf"]) == (0, 1, 1)
    delivery = buckets(samples, "streamserve_chunk_delivery_seconds", gpu_type="h100")
    assert (delivery["0.05"], delivery["+Inf"]) == (4, 4)  # the chunk without a delivery time is left out
    assert value(samples, "streamserve_chunk_delivery_seconds_gsum", gpu_type="h100") == pytest.approx(0.063)


def test_scheduler_decision_time_and_counts(client, cluster):
    samples = scrape(client)

    decision = buckets(samples, "streamserve_scheduler_decision_seconds")
    assert (decision["0.001"], decision["0.0025"], decision["0.015"], decision["0.05"], decision["+Inf"]) == (
        0,
        1,
        2,
        3,
        3,
    )
    assert value(samples, "streamserve_scheduler_decision_seconds_gsum") == pytest.approx(0.054)
    # The counter counts every decision, the window only shapes the histogram.
    assert value(samples, "streamserve_scheduler_decisions_total", trigger="tick") == 2
    assert value(samples, "streamserve_scheduler_decisions_total", trigger="arrive") == 1
    assert value(samples, "streamserve_scheduler_decisions_total", trigger="manual") == 1


def test_outcome_counters_count_settled_rows_and_follow_later_changes(client, cluster):
    first = scrape(client)
    assert value(first, "streamserve_migrations_total", outcome="succeeded") == 2
    assert value(first, "streamserve_migrations_total", outcome="failed") == 1
    assert ("outcome", "pending") not in [k for key in first["streamserve_migrations_total"] for k in key]
    assert value(first, "streamserve_migrations_pending") == 1
    assert value(first, "streamserve_scaling_actions_total", direction="out", outcome="succeeded") == 1
    assert value(first, "streamserve_scaling_actions_total", direction="in", outcome="failed") == 1
    assert value(first, "streamserve_scaling_actions_pending") == 1

    pending = cluster["pending_migration"]
    Migration.objects.filter(pk=pending.pk).update(outcome="succeeded", finished_at=timezone.now())
    second = scrape(client)
    assert value(second, "streamserve_migrations_total", outcome="succeeded") == 3
    assert value(second, "streamserve_migrations_pending") == 0


def test_incremental_counter_matches_a_full_count_as_rows_come_go_and_settle(cluster, monkeypatch):
    monkeypatch.setattr(metrics, "_TAIL_IDS", 2)  # so that rows leave the re-read tail quickly
    counter = metrics.OutcomeCounter(
        Migration, labels=("outcome",), outcome="outcome", pending_value="pending"
    )
    source = GpuWorker.objects.get(name="h100-a")
    target = GpuWorker.objects.get(name="h100-b")
    session = GenerationSession.objects.filter(status=S.EXECUTING).first()

    def truth():
        rows = Migration.objects.exclude(outcome="pending").values_list("outcome", flat=True)
        counts: dict[tuple[str], int] = {}
        for outcome in rows:
            counts[(outcome,)] = counts.get((outcome,), 0) + 1
        return counts

    def add(outcome):
        now = timezone.now()
        return Migration.objects.create(
            session=session,
            source=source,
            target=target,
            reason="r",
            outcome=outcome,
            started_at=now,
            finished_at=None if outcome == "pending" else now,
        )

    assert counter.refresh() == truth()
    waiting = [add("pending") for _ in range(3)]
    for _ in range(4):
        add("succeeded")
    assert counter.refresh() == truth()
    # Pending rows that have left the tail settle later, one is aborted, one is deleted.
    Migration.objects.filter(pk=waiting[0].pk).update(outcome="failed", finished_at=timezone.now())
    Migration.objects.filter(pk=waiting[1].pk).update(outcome="aborted", finished_at=timezone.now())
    waiting[2].delete()
    add("failed")
    assert counter.refresh() == truth()
    assert counter.pending == {cluster["pending_migration"].pk}  # the only row still pending
    assert counter.refresh() == truth()  # idempotent: nothing counted twice


def test_an_empty_database_still_exposes_every_family(client):
    samples = scrape(client)
    assert set(samples) >= FAMILIES
    assert value(samples, "streamserve_sessions", status="queued") == 0
    assert value(samples, "streamserve_gpu_workers", status="ready", gpu_type="") == 0
    assert value(samples, "streamserve_jobs", state="paused", kind="video") == 0


def test_jobs_in_flight_by_state_and_kind(client):
    worker = GpuWorkerFactory()
    JobFactory.create_batch(2)
    JobFactory(kind="video", frames=8, state="running", worker=worker)
    JobFactory(state="cancelled", finished_at=timezone.now())
    samples = scrape(client)
    assert value(samples, "streamserve_jobs", state="queued", kind="image") == 2
    assert value(samples, "streamserve_jobs", state="running", kind="video") == 1
    assert value(samples, "streamserve_jobs", state="running", kind="image") == 0
    assert ("state", "cancelled") not in {k for key in samples["streamserve_jobs"] for k in key}


def test_sessions_jobs_gpu_seconds_and_weights_by_tenant(client):
    vision = Tenant.objects.create(name="vision", weight=3.0)
    session = SessionFactory(tenant=vision, status=S.QUEUED)
    SessionFactory(tenant=None, status=S.QUEUED)
    JobFactory(tenant=vision)
    # a batch of two 600 ms steps: 0.3 GPU-s a chunk; one of the default tenant's chunks alone, 0.2 s
    ChunkRecordFactory(session=session, batch_size=2, generation_ms=600.0)
    ChunkRecordFactory(session=SessionFactory(tenant=None), batch_size=1, generation_ms=200.0)
    samples = scrape(client)
    assert value(samples, "streamserve_tenant_sessions", tenant="vision", status="queued") == 1
    assert value(samples, "streamserve_tenant_sessions", tenant="default", status="queued") == 2
    assert value(samples, "streamserve_tenant_jobs_queued", tenant="vision") == 1
    assert value(samples, "streamserve_tenant_gpu_seconds", tenant="vision") == pytest.approx(0.3)
    assert value(samples, "streamserve_tenant_gpu_seconds", tenant="default") == pytest.approx(0.2)
    assert value(samples, "streamserve_tenant_weight", tenant="vision") == 3.0


def test_token_protection(client, cluster, settings):
    settings.STREAMSERVE = {**settings.STREAMSERVE, "METRICS_TOKEN": "s3cret-token"}

    missing = client.get("/metrics")
    wrong = client.get("/metrics", HTTP_AUTHORIZATION="Bearer not-it")
    basic = client.get("/metrics", HTTP_AUTHORIZATION="Basic s3cret-token")

    for response in (missing, wrong, basic):
        assert response.status_code == 401
        assert response["WWW-Authenticate"].startswith("Bearer")
        assert b"streamserve_" not in response.content
    assert "streamserve_sessions" in scrape(client, HTTP_AUTHORIZATION="Bearer s3cret-token")


def test_only_get_is_allowed(client):
    assert client.post("/metrics").status_code == 405


def test_scaleout_phases_pool_copies_and_expected_ready_times(client):
    # given a worker that became ready 8 s after its request, its weights from a peer at 5 s
    from gpu import services as pool

    now = timezone.now()
    requested = now - timedelta(seconds=10)
    ready = GpuWorkerFactory(
        requested_at=requested,
        process_up_at=requested + timedelta(seconds=1.5),
        weights_complete_at=requested + timedelta(seconds=5),
        weights_source="peer",
        ready_at=requested + timedelta(seconds=8),
    )
    holding = pool.worker_holding_register(worker=ready, model_preset="tiny", weights_bytes=10)
    pool.holding_complete(holding_id=holding.pk, digest="d")
    # and a loading worker expected ready in about 30 s
    GpuWorkerFactory(
        name="loading",
        status=Status.PROVISIONING,
        ready_at=None,
        expected_ready_at=now + timedelta(seconds=30),
    )
    samples = scrape(client)
    # then each phase is in its bucket, by source
    up = buckets(samples, "streamserve_scaleout_phase_seconds", phase="process_up", source="peer")
    assert up["1.0"] == 0 and up["2.0"] == 1
    weights = buckets(samples, "streamserve_scaleout_phase_seconds", phase="weights_complete", source="peer")
    assert weights["2.0"] == 0 and weights["5.0"] == 1
    assert buckets(samples, "streamserve_scaleout_phase_seconds", phase="ready", source="peer")["10.0"] == 1
    assert value(samples, "streamserve_weight_copies", model="tiny", kind="gpu", state="complete") == 1
    expected = value(samples, "streamserve_worker_expected_ready_seconds", worker="loading", gpu_type="h100")
    assert 20 < expected <= 30
