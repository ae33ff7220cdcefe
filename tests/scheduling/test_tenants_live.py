"""Fair share and quotas where the live loop decides (issue 29), on real rows through ``scheduler_run``:
the admission queue orders the tenant under its share first (FCFS within a tenant), and a tenant over
its GPU-second quota waits without making the pool scale out. Nothing leaves the test's transaction
(commands and provisioning go out after commit)."""

from __future__ import annotations

from datetime import timedelta

import pytest
from django.utils import timezone

from gpu.models import GpuWorker
from scheduling.console import cluster_snapshot
from scheduling.live.run import scheduler_run
from scheduling.live.worker_profiles import default_gpu_type
from scheduling.models import ScalingAction, SchedulerConfig
from sessions.models import GenerationSession, Tenant
from tests.factories import ChunkRecordFactory, GpuWorkerFactory, SessionFactory

pytestmark = pytest.mark.django_db

Status = GenerationSession.Status


def waiting(tenant: Tenant, arrived_s_ago: float) -> GenerationSession:
    at = timezone.now() - timedelta(seconds=arrived_s_ago)
    return SessionFactory(tenant=tenant, activity="active", status=Status.QUEUED, last_active_at=at)


def used(tenant: Tenant | None, gpu_seconds: float) -> None:
    """``gpu_seconds`` charged to ``tenant`` a minute ago (a chunk alone in its batch)."""
    ChunkRecordFactory(
        session=SessionFactory(tenant=tenant, status=Status.TERMINATED, terminated_at=timezone.now(),
                               state_location="none"),
        worker=None, generation_ms=gpu_seconds * 1000.0, batch_size=1,
        created_at=timezone.now() - timedelta(minutes=1),
    )  # fmt: skip


@pytest.fixture
def full_pool():
    """A pool that may not grow past its one worker, still booting: every active session waits."""
    SchedulerConfig.objects.update_or_create(pk=1, defaults={"min_gpus": 0, "max_gpus": 1})
    return GpuWorkerFactory(
        name="gpu-a", model_preset="tiny", gpu_type=default_gpu_type(), status=GpuWorker.Status.PROVISIONING,
        ready_at=None,
    )  # fmt: skip


def test_the_queue_puts_the_tenant_under_its_share_first_fcfs_within_each(full_pool):
    vision = Tenant.objects.create(name="vision", weight=3.0)
    audio = Tenant.objects.create(name="audio", weight=1.0)
    # audio used 40 s for a weight of 1 (40 a unit), vision 90 s for 3 (30 a unit): vision is under
    used(audio, 40.0)
    used(vision, 90.0)
    a1, a2 = waiting(audio, 50), waiting(audio, 40)
    v1, v2 = waiting(vision, 30), waiting(vision, 20)
    scheduler_run(trigger="tick")

    order = sorted(
        GenerationSession.objects.filter(queue_position__isnull=False), key=lambda s: s.queue_position
    )
    assert [s.pk for s in order] == [v1.pk, v2.pk, a1.pk, a2.pk]


@pytest.mark.parametrize("over_quota", [False, True])
def test_a_tenant_over_its_gpu_quota_waits_without_scaling_the_pool_out(over_quota):
    SchedulerConfig.objects.update_or_create(pk=1, defaults={"min_gpus": 0, "max_gpus": 4})
    vision = Tenant.objects.create(name="vision", gpu_seconds_per_day=10.0, gpu_quota_enforcement="soft")
    used(vision, 20.0 if over_quota else 5.0)
    sessions = [waiting(vision, 10), waiting(vision, 5)]

    scheduler_run(trigger="tick")

    assert ScalingAction.objects.filter(direction="out").exists() is not over_quota
    for session in sessions:
        session.refresh_from_db()
        assert session.status == Status.QUEUED


def test_the_console_shows_each_tenant_s_sessions_jobs_and_recent_share():
    vision = Tenant.objects.create(name="vision", weight=3.0)
    waiting(vision, 5)
    used(vision, 3.0)
    used(None, 1.0)

    snapshot = cluster_snapshot(include_timeline=False)

    rows = {row["name"]: row for row in snapshot["tenants"]}
    assert rows["vision"]["weight_share"] == 0.75 and rows["vision"]["queued"] == 1
    assert rows["vision"]["gpu_seconds_5m"] == 3.0 and rows["vision"]["share_5m"] == 0.75
    assert rows["default"]["share_5m"] == 0.25
    assert {s["tenant"] for s in snapshot["session_list"]} == {"vision"}
