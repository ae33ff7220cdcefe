"""One-row rules are enforced by PostgreSQL itself, not only by the services."""

from __future__ import annotations

from datetime import timedelta

import pytest
from django.db import IntegrityError, transaction
from django.utils import timezone

from gpu.models import GpuWorker
from scheduling.models import Migration, ScalingAction, SchedulerConfig
from sessions.models import GenerationSession
from tests.factories import ChunkRecordFactory, GpuWorkerFactory, JobFactory, SessionFactory

pytestmark = pytest.mark.django_db


def violates(name: str, fn) -> None:
    with pytest.raises(IntegrityError) as excinfo, transaction.atomic():
        fn()
    assert name in str(excinfo.value)


def test_terminated_session_cannot_keep_a_worker():
    worker = GpuWorkerFactory()
    violates(
        "session_terminated_has_no_worker",
        lambda: SessionFactory(status="terminated", terminated_at=timezone.now(), worker=worker),
    )


def test_executing_session_needs_a_worker_and_state_locations_are_consistent():
    violates("session_executing_has_worker", lambda: SessionFactory(status="executing"))
    violates(
        "session_state_on_host_has_host", lambda: SessionFactory(status="suspended", state_location="host")
    )
    violates(
        "session_queue_position_only_when_queued",
        lambda: SessionFactory(status="suspended", queue_position=3),
    )
    violates("session_load_positive", lambda: SessionFactory(load=0))


def test_chunk_index_is_unique_per_session():
    session = SessionFactory()
    ChunkRecordFactory(session=session, chunk_index=0)
    violates("chunk_index_unique_per_session", lambda: ChunkRecordFactory(session=session, chunk_index=0))
    ChunkRecordFactory(chunk_index=0)  # same index in another session is fine


def test_worker_lifecycle_timestamps_are_required():
    violates(
        "gpuworker_released_has_time",
        lambda: GpuWorkerFactory(status=GpuWorker.Status.RELEASED, released_at=None),
    )
    violates(
        "gpuworker_ready_has_time", lambda: GpuWorkerFactory(status=GpuWorker.Status.READY, ready_at=None)
    )
    now = timezone.now()
    violates(
        "gpuworker_release_after_request",
        lambda: GpuWorkerFactory(status="released", requested_at=now, released_at=now - timedelta(seconds=1)),
    )


def test_migration_and_scaling_rows_are_coherent():
    worker = GpuWorkerFactory()
    session = SessionFactory()
    violates(
        "migration_distinct_workers",
        lambda: Migration.objects.create(
            session=session, source=worker, target=worker, reason="rebalance", started_at=timezone.now()
        ),
    )
    violates(
        "scaling_direction_matches_budgets",
        lambda: ScalingAction.objects.create(
            created_at=timezone.now(), direction="out", from_budget=4, to_budget=2, reason="test"
        ),
    )


def test_scheduler_config_bounds():
    violates("config_bounds_ordered", lambda: SchedulerConfig.objects.create(min_gpus=5, max_gpus=2))
    violates("config_utilization_range", lambda: SchedulerConfig.objects.create(target_utilization=1.5))


def test_session_status_transitions_keep_constraints():
    session = SessionFactory()
    assert session.status == GenerationSession.Status.QUEUED
    assert session.state_location == GenerationSession.StateLocation.NONE


def test_job_rows_are_coherent():
    worker = GpuWorkerFactory()
    violates("job_running_has_worker", lambda: JobFactory(state="running"))
    violates("job_queued_has_no_worker", lambda: JobFactory(worker=worker))
    violates("job_ended_has_time", lambda: JobFactory(state="failed"))
    violates("job_done_has_result", lambda: JobFactory(state="done", finished_at=timezone.now()))
    violates("job_image_is_one_frame", lambda: JobFactory(frames=8))
    violates("job_steps_done_bounded", lambda: JobFactory(state="running", worker=worker, steps_done=5))
