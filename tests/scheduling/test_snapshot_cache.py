"""The live run's narrow, incremental snapshot (``scheduling.live.snapshot``, issue 30) against the
snapshot the run built before it: every session row of the pool loaded as a model instance, the
placements' newest commands aggregated in SQL. Same rows, same snapshot, field by field — after a
whole load, after deltas of every kind of change, and after a rollback."""

from __future__ import annotations

import uuid
from dataclasses import replace
from datetime import timedelta

import pytest
from django.db import transaction
from django.db.models import Max
from django.utils import timezone

from gpu.models import GpuWorker, Region
from scheduling.core.types import GpuView, Snapshot
from scheduling.live.regions import region_layout
from scheduling.live.run import _pool_locked, _scale_out_delays, _session_view, _snapshot
from scheduling.live.snapshot import pool_cache_clear, pool_rows
from scheduling.live.tenants import tenant_shares
from scheduling.live.worker_profiles import default_gpu_type, gpu_profiles
from scheduling.models import SchedulerConfig, WorkerCommand
from sessions import lifecycle
from sessions.models import GenerationSession, Tenant
from tests.factories import GpuWorkerFactory, SessionFactory, UserFactory

Status = GenerationSession.Status


def _reference_snapshot(preset: str, config: SchedulerConfig, clock: float) -> Snapshot:
    """The snapshot as the run built it before issue 30 (model instances, SQL aggregate)."""
    profiles = gpu_profiles()
    spec = profiles[default_gpu_type()]
    workers = list(
        GpuWorker.objects.filter(model_preset=preset, status__in=GpuWorker.LIVE_STATUSES).order_by("pk")
    )
    sessions = list(
        GenerationSession.objects.filter(model_name=preset).exclude(status=Status.TERMINATED).order_by("pk")
    )
    placed_at = {
        str(session_id): last
        for session_id, last in WorkerCommand.objects.filter(
            session_id__in=[s.pk for s in sessions if s.status in (Status.EXECUTING, Status.MIGRATING)],
            kind__in=["start", "resume", "activate"],
        )
        .values("session_id")
        .annotate(last=Max("created_at"))
        .values_list("session_id", "last")
    }
    serving = [w for w in workers if w.holds_sessions]
    gpu_names = {w.pk: w.name for w in serving}
    gpu_specs = {w.pk: profiles.get(w.gpu_type, spec) for w in serving}
    snapshot = Snapshot.build(
        time=clock,
        sessions=[
            _session_view(s, gpu_specs.get(s.worker_id, spec), clock, placed_at, gpu_names) for s in sessions
        ],
        gpus=[
            GpuView(
                id=w.name,
                gpu_type=w.gpu_type if w.gpu_type in profiles else default_gpu_type(),
                status=w.status,
                ready_at=(w.ready_at or w.expected_ready_at).timestamp()
                if (w.ready_at or w.expected_ready_at)
                else None,
                requested_at=w.requested_at.timestamp(),
            )
            for w in serving
        ],
        gpu_types=profiles,
        min_gpus=config.min_gpus,
        max_gpus=config.max_gpus,
    )
    return replace(snapshot, scale_out_delay_s=_scale_out_delays(serving, profiles))


def _assert_same(clock: float | None = None) -> None:
    """The run's snapshot, layout and fair-share inputs equal the reference, in the same order."""
    config = SchedulerConfig.load()
    clock = clock if clock is not None else timezone.now().timestamp()
    pool = _pool_locked("tiny")
    got = _snapshot(pool, config, clock)
    want = _reference_snapshot("tiny", config, clock)
    assert list(got.sessions) == list(want.sessions)
    for sid, view in want.sessions.items():
        assert got.sessions[sid] == view, sid
    assert got == want
    instances = list(GenerationSession.objects.filter(model_name="tiny").exclude(status=Status.TERMINATED))
    workers = list(pool.workers.values())
    assert region_layout(sessions=list(pool.read.rows.values()), workers=workers) == region_layout(
        sessions=instances, workers=workers
    )
    now = timezone.now()
    assert tenant_shares(sessions=pool.read.rows.values(), now=now) == tenant_shares(
        sessions=instances, now=now
    )


def _command(session: GenerationSession, kind: str, at) -> None:
    WorkerCommand.objects.create(
        id=uuid.uuid4(),
        worker=session.worker,
        session=session,
        kind=kind,
        payload={},
        created_at=at,
    )


@pytest.fixture
def pool():
    """Two ready workers and sessions in every state the snapshot distinguishes."""
    pool_cache_clear()
    now = timezone.now()
    a = GpuWorkerFactory(name="a", gpu_type="cpu", model_preset="tiny")
    b = GpuWorkerFactory(name="b", gpu_type="cpu", model_preset="tiny")
    other = GpuWorkerFactory(name="o", gpu_type="cpu", model_preset="other")
    east = Region.objects.create(name="east", rtt_ms={"eu": 20.0})
    tenant = Tenant.objects.create(name="team-b", weight=2.0)
    owner = UserFactory()
    rows = {
        "placed": SessionFactory(owner=owner, status=Status.EXECUTING, worker=a, state_location="worker"),
        "unplaced": SessionFactory(
            owner=owner, status=Status.EXECUTING, worker=b, state_location="worker", last_active_at=now
        ),
        "idle": SessionFactory(
            owner=owner, status=Status.EXECUTING, worker=b, state_location="worker", activity="idle"
        ),
        "parked": SessionFactory(
            owner=owner, status=Status.SUSPENDED, host_worker=a, state_location="host", activity="idle"
        ),
        "waiting": SessionFactory(
            owner=owner,
            activity="active",
            last_active_at=now - timedelta(seconds=5),
            origin="eu",
            region=east,
        ),
        "tenant": SessionFactory(owner=owner, activity="active", tenant=tenant, load=2.0),
        "orphan": SessionFactory(owner=owner, status=Status.EXECUTING, worker=other, state_location="worker"),
        "ended": SessionFactory(
            owner=owner, status=Status.TERMINATED, terminated_at=now, state_location="none"
        ),
        "elsewhere": SessionFactory(owner=owner, model_name="other"),
    }
    _command(rows["placed"], "start", now - timedelta(seconds=30))
    _command(rows["placed"], "resume", now - timedelta(seconds=10))
    _command(rows["placed"], "suspend", now - timedelta(seconds=1))  # not a placement
    return rows


@pytest.mark.django_db
def test_a_whole_load_equals_the_instance_snapshot(pool):
    _assert_same()
    assert pool_rows("tiny").full is False  # the second read in the transaction is a delta


@pytest.mark.django_db
def test_every_kind_of_change_reaches_the_cached_snapshot(pool):
    # given the pool read once
    _assert_same()
    now = timezone.now()
    # when rows change in every way a writer changes them
    placed = GenerationSession.objects.get(pk=pool["placed"].pk)
    assert lifecycle.session_suspend(session=placed)  # executing → suspended (compare-and-set)
    GenerationSession.objects.filter(pk=pool["idle"].pk).update(activity="active", last_active_at=now)
    GenerationSession.objects.filter(pk=pool["tenant"].pk).update(load=0.5)
    GenerationSession.objects.filter(pk=pool["waiting"].pk).update(region=None, origin="")
    _command(pool["unplaced"], "activate", now)  # a newer placement for an executing session
    terminated = pool["parked"]
    GenerationSession.objects.filter(pk=terminated.pk).update(
        status=Status.TERMINATED, terminated_at=now, host_worker=None, state_location="none"
    )
    SessionFactory(model_name="tiny", activity="active")  # a new session
    GenerationSession.objects.filter(pk=pool["elsewhere"].pk).update(model_name="tiny")  # joins the pool
    # then the next read, a delta, equals the reference
    _assert_same()
    assert pool_rows("tiny").full is False


@pytest.mark.django_db
def test_a_row_that_leaves_without_a_stamp_reloads_the_pool(pool):
    # given the pool read once
    _assert_same()
    # when a session row is deleted, and another leaves the pool for another model
    pool["orphan"].delete()
    GenerationSession.objects.filter(pk=pool["waiting"].pk).update(model_name="other")
    # then the next read notices (the live count differs), loads the pool whole, and equals the reference
    assert pool_rows("tiny").full is True
    _assert_same()


@pytest.mark.django_db
def test_the_delta_reads_only_what_changed_and_not_the_chunk_counters(pool):
    # given the pool read once
    pool_rows("tiny")
    # when one session's activity changes and another's chunk counters advance
    GenerationSession.objects.filter(pk=pool["idle"].pk).update(activity="active")
    GenerationSession.objects.filter(pk=pool["placed"].pk).update(delivered_index=7, chunks_generated=8)
    read = pool_rows("tiny")
    # then the delta read the changed row only
    assert (read.full, read.changed) == (False, 1)
    assert read.rows[str(pool["idle"].pk)].activity == "active"


@pytest.mark.django_db
def test_a_run_applies_on_the_cached_snapshot_like_on_a_whole_one(pool):
    from scheduling.live.run import scheduler_run

    # given a run that placed the waiting sessions (their rows and start commands written by it)
    scheduler_run(trigger="tick")
    placed = GenerationSession.objects.get(pk=pool["tenant"].pk)
    assert placed.status == Status.EXECUTING
    assert WorkerCommand.objects.filter(session=placed, kind="start").exists()
    # then what it wrote is in the next snapshot, as in a whole one
    _assert_same()
    # and so after a session idles and the next run decides on that
    GenerationSession.objects.filter(pk=pool["unplaced"].pk).update(activity="idle")
    scheduler_run(trigger="idle", session_id=str(pool["unplaced"].pk))
    _assert_same()


@pytest.mark.django_db(transaction=True)
def test_a_rolled_back_transaction_is_not_trusted(pool):
    # given the pool read in a transaction that commits
    with transaction.atomic():
        pool_rows("tiny")
    # when a transaction changes a row, reads the pool, and rolls back
    with pytest.raises(RuntimeError), transaction.atomic():
        GenerationSession.objects.filter(pk=pool["idle"].pk).update(activity="active")
        assert pool_rows("tiny").rows[str(pool["idle"].pk)].activity == "active"
        raise RuntimeError("roll back")
    # then the next read loads the pool whole and sees the row as it is
    with transaction.atomic():
        read = pool_rows("tiny")
        assert read.full and read.rows[str(pool["idle"].pk)].activity == "idle"
        _assert_same()
