"""A running session moves across regions between two real worker processes, without a gap or a
duplicate chunk.

Two ``manage.py gpuworker`` processes (tiny preset on CPU, K = 2) register with the test database,
one in region east and one in region west; the real scheduler places two chi sessions (load 1.5
each: 3 on east's K = 2, overloaded) on east's worker; the slot's ``running_sessions_move`` decides
by the shared rule that one of them moves west and starts an ordinary live migration
(``migrate_out``/``migrate_in``, the state over torch.distributed Gloo between the two processes).
The chunk-record stream in Redis (every chunk a worker generated, before any ingest de-duplicates)
must show each session's indices contiguous and unique, the moved one's on east then on west.
"""

from __future__ import annotations

import json
import os
import uuid
from pathlib import Path

import pytest
import redis
from django.conf import settings as django_settings
from django.utils import timezone

from contracts.wire.channel import stream_key
from contracts.wire.records import STREAM as RECORD_STREAM
from gpu.models import GpuWorker, Region
from scheduling.live.outbox import redis_client
from scheduling.live.region_moves import running_sessions_move
from scheduling.live.regions import FORECAST_KEY, HISTORY_KEY, PLAN_KEY
from scheduling.live.run import scheduler_run
from scheduling.models import Migration, SchedulerConfig
from sessions.models import GenerationSession
from tests.e2e.conftest import wait_for
from tests.factories import SessionFactory
from workers.benchmarks.live import ProcessGroup

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.slow]  # two worker processes

ROOT = Path(__file__).resolve().parents[2]
WORKER_ARGS = ("--device", "cpu", "--preset", "tiny", "--capacity", "2", "--weights-from", "disk")
WORKER_ARGS += ("--heartbeat", "60")


@pytest.fixture
def two_regions(transactional_db, tmp_path, settings):
    """East and west (chi within 20 and 25 ms of them), one ready gpuworker process in each;
    stopped (and deregistered) afterwards."""
    settings.STREAMSERVE = {**settings.STREAMSERVE, "REGION_RTT_BUDGET_MS": 60.0, "REGION_MOVES_PER_SLOT": 4}
    client = redis.Redis.from_url(django_settings.REDIS_URL)
    client.delete(RECORD_STREAM, PLAN_KEY, HISTORY_KEY, FORECAST_KEY)
    db = django_settings.DATABASES["default"]
    env = {
        **os.environ,
        "DATABASE_URL": f"postgres://{db['USER']}@{db['HOST']}:{db['PORT']}/{db['NAME']}",
        "REDIS_URL": django_settings.REDIS_URL,
        # The workers' reports enqueue scheduler tasks: onto this test's Redis db, never consumed.
        "CELERY_BROKER_URL": django_settings.REDIS_URL,
        "MEDIA_ROOT": str(tmp_path / "media"),
        "WEIGHTS_DIR": str(tmp_path / "weights"),
        "CHECKPOINT_DIR": str(tmp_path / "checkpoints"),
        "PYTHONUNBUFFERED": "1",
    }
    tag = uuid.uuid4().hex[:6]
    names = [f"east-{tag}", f"west-{tag}"]
    east = Region.objects.create(name="east", rtt_ms={"chi": 20, "nyc": 3})
    west = Region.objects.create(name="west", rtt_ms={"chi": 25, "sfo": 3})
    # No scale-out: the two workers are the whole pool.
    SchedulerConfig.objects.update_or_create(pk=1, defaults={"min_gpus": 0, "max_gpus": 2})
    group = ProcessGroup(tmp_path / "logs", env, ROOT, grace_s=15.0)
    with group:
        for name in names:
            group.spawn(name, "manage.py", "gpuworker", "--name", name, *WORKER_ARGS)
        wait_for(
            lambda: (
                group.dead() is None
                and GpuWorker.objects.filter(name__in=names, status=GpuWorker.Status.READY).count() == 2
            ),
            timeout=90,
            message=f"two ready workers ({group.dead()})",
        )
        GpuWorker.objects.filter(name=names[0]).update(region=east)
        GpuWorker.objects.filter(name=names[1]).update(region=west)
        yield [GpuWorker.objects.get(name=name) for name in names], (east, west)
    client.delete(*(stream_key(name) for name in names), "default", "celery", RECORD_STREAM)
    redis_client().delete(PLAN_KEY, HISTORY_KEY, FORECAST_KEY)


def generated(session_id: str) -> list[tuple[int, str]]:
    """Every chunk a worker generated for the session, in stream order: (index, worker)."""
    client = redis.Redis.from_url(django_settings.REDIS_URL)
    rows = (json.loads(fields[b"row"]) for _id, fields in client.xrange(RECORD_STREAM))
    return [
        (r["index"], r["worker"]) for r in rows if r["session"] == session_id and r.get("delivery_ms") is None
    ]


def test_a_running_session_moves_to_another_regions_worker_without_a_gap_or_a_duplicate(two_regions):
    (east_worker, west_worker), (east, west) = two_regions
    # Given two chi sessions routed east, placed by the scheduler on east's worker (3 on K = 2)
    sessions = [
        SessionFactory(origin="chi", region=east, activity="active", last_active_at=timezone.now(), load=1.5)
        for _ in range(2)
    ]
    for session in sessions:
        scheduler_run(trigger="active", session_id=str(session.pk))
    ids = [str(s.pk) for s in sessions]
    assert set(GenerationSession.objects.filter(pk__in=ids).values_list("worker", flat=True)) == {
        east_worker.pk
    }
    wait_for(lambda: all(len(generated(sid)) >= 3 for sid in ids), 90, message="chunks on east")

    # When the slot's moves run
    (started,) = running_sessions_move()

    # Then one session migrates to west's worker, recorded as a cross-region move with its estimate
    moved = started.move.session
    assert (started.move.source, started.move.target, started.target_worker) == (
        "east",
        "west",
        west_worker.name,
    )
    wait_for(
        lambda: Migration.objects.filter(pk=started.migration).exclude(outcome="pending").exists(),
        90,
        message="the migration's outcome",
    )
    migration = Migration.objects.get(pk=started.migration)
    assert (migration.outcome, migration.cross_region, migration.source_region, migration.target_region) == (
        "succeeded",
        True,
        east,
        west,
    ), migration.error
    assert migration.estimated_saving_ms > migration.switch_cost_ms > 0
    # A figure for the docs (shown with -s), not an assertion: the move's measured duration.
    print(
        f"cross-region move: {migration.state_bytes} B in {migration.duration_ms:.0f} ms; estimated "
        f"switching cost {migration.switch_cost_ms:.1f} ms, saving {migration.estimated_saving_ms:.0f} ms"
    )
    row = GenerationSession.objects.get(pk=moved)
    assert (row.status, row.worker, row.region) == ("executing", west_worker, west)

    # and the moved session goes on on west where it stopped on east: no gap, no duplicate
    wait_for(
        lambda: sum(w == west_worker.name for _, w in generated(moved)) >= 3, 90, message="chunks on west"
    )
    chunks = generated(moved)
    indices = [i for i, _ in chunks]
    assert sorted(indices) == list(range(indices[0], indices[0] + len(indices))), chunks
    assert len(set(indices)) == len(indices), chunks
    workers = [w for _, w in sorted(chunks)]
    switch = workers.index(west_worker.name)
    assert set(workers[:switch]) == {east_worker.name} and set(workers[switch:]) == {west_worker.name}, chunks
    # and the other one stayed on east, its chunks contiguous too
    (other,) = set(ids) - {moved}
    stayed = generated(other)
    assert {w for _, w in stayed} == {east_worker.name}
    assert sorted(i for i, _ in stayed) == list(range(stayed[0][0], stayed[0][0] + len(stayed)))
