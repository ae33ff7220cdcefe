"""Running sessions move across regions when the saving beats the switching cost, and an idle region
scales to zero (real PostgreSQL and Redis; the workers' side of a move is in
``test_region_moves_workers.py``)."""

from __future__ import annotations

import json

import pytest
from django.utils import timezone

from gpu.models import GpuWorker, Region
from scheduling.live.outbox import redis_client
from scheduling.live.region_moves import running_sessions_move
from scheduling.live.regions import FORECAST_KEY, HISTORY_KEY, PLAN_KEY
from scheduling.models import Migration, WorkerCommand
from sessions.models import GenerationSession
from tests.factories import GpuWorkerFactory, SessionFactory

pytestmark = pytest.mark.django_db


@pytest.fixture(autouse=True)
def no_previous_plan(settings):
    settings.STREAMSERVE = {**settings.STREAMSERVE, "REGION_RTT_BUDGET_MS": 60.0, "REGION_PLAN_BETA": 1.0}
    redis_client().delete(PLAN_KEY, HISTORY_KEY, FORECAST_KEY)
    yield
    redis_client().delete(PLAN_KEY, HISTORY_KEY, FORECAST_KEY)


@pytest.fixture
def coasts(db):
    """East near nyc, west near sfo (70 ms across: beyond the budget); chi near both (20 / 25 ms).
    One ready worker of K = 4 in each."""
    east = Region.objects.create(name="east", rtt_ms={"nyc": 3, "sfo": 70, "chi": 20})
    west = Region.objects.create(name="west", rtt_ms={"nyc": 70, "sfo": 3, "chi": 25})
    return east, west, GpuWorkerFactory(region=east, capacity=4), GpuWorkerFactory(region=west, capacity=4)


def running_on(worker: GpuWorker, origin: str = "chi", load: float = 1.0) -> GenerationSession:
    return SessionFactory(
        origin=origin,
        region=worker.region,
        status=GenerationSession.Status.EXECUTING,
        worker=worker,
        activity="active",
        last_active_at=timezone.now(),
        state_location=GenerationSession.StateLocation.WORKER,
        load=load,
    )


def test_an_overloaded_region_moves_running_sessions_to_a_region_within_budget(coasts):
    east, west, east_worker, west_worker = coasts
    # given six chi sessions running on east's worker (6 on K = 4) and west's worker idle
    sessions = [running_on(east_worker) for _ in range(6)]
    # when a slot's moves run
    started = running_sessions_move()
    # then two of them (the rule's default horizon pays for their switch) migrate to west's worker,
    # which leaves east at its capacity
    assert len(started) == 2
    migrations = Migration.objects.filter(cross_region=True).order_by("pk")
    assert [(m.source, m.target, m.source_region, m.target_region) for m in migrations] == [
        (east_worker, west_worker, east, west)
    ] * 2
    assert {m.reason for m in migrations} == {"cross-region"}
    assert all(m.estimated_saving_ms > m.switch_cost_ms > 25.0 for m in migrations)
    moved = GenerationSession.objects.filter(pk__in=[m.session_id for m in migrations])
    assert {(s.status, s.region_id) for s in moved} == {(GenerationSession.Status.MIGRATING, west.pk)}
    # and both sides are commanded, as in any live migration
    for m in migrations:
        assert WorkerCommand.objects.filter(
            worker=east_worker, session=m.session, kind="migrate_out"
        ).exists()
        assert WorkerCommand.objects.filter(worker=west_worker, session=m.session, kind="migrate_in").exists()
    # and the next slot moves nothing more (east is no longer overloaded; the migrating ones stay put)
    assert running_sessions_move() == []
    assert len(sessions) - moved.count() == 4


def test_no_running_session_moves_when_the_switch_costs_more_or_beyond_the_budget(coasts, settings):
    _east, _west, east_worker, _west_worker = coasts
    for _ in range(6):
        running_on(east_worker)
    # given a WAN so slow that the state's transfer outweighs the saving over the horizon
    settings.STREAMSERVE = {**settings.STREAMSERVE, "REGION_WAN_GBPS_PAIRS": {"east:west": 1e-6}}
    assert running_sessions_move() == []
    # and nyc sessions in an overloaded east never go west (70 ms: beyond their budget)
    settings.STREAMSERVE = {**settings.STREAMSERVE, "REGION_WAN_GBPS_PAIRS": {}}
    GenerationSession.objects.update(origin="nyc")
    assert running_sessions_move() == []
    # and with moves disabled, chi sessions stay too
    GenerationSession.objects.update(origin="chi")
    settings.STREAMSERVE = {**settings.STREAMSERVE, "REGION_MOVES_PER_SLOT": 0}
    assert running_sessions_move() == []
    assert not Migration.objects.exists()


def test_the_plan_moves_a_running_session_to_a_cheaper_region_when_the_price_pays(coasts):
    east, west, east_worker, _west_worker = coasts
    # given east three times dearer, a stored plan that sends all of chi west, and one chi session
    # running in east (not overloaded)
    Region.objects.filter(pk=east.pk).update(price_multiplier=3.0)
    plan = {"regions": ["east", "west"], "origins": ["chi", "nyc", "sfo"], "plan": [[0, 1], [1, 0], [0, 1]]}
    redis_client().set(PLAN_KEY, json.dumps(plan))
    session = running_on(east_worker)
    # when the slot's moves run, then it moves west: the price term beats 5 ms more RTT and the stall
    (started,) = running_sessions_move()
    assert (started.move.session, started.move.why, started.move.target) == (str(session.pk), "plan", "west")
    migration = Migration.objects.get(session=session)
    assert (migration.source_region, migration.target_region) == (east, west)
