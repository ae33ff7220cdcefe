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
from scheduling.live.regions import (
    FORECAST_KEY,
    HISTORY_KEY,
    PLAN_KEY,
    region_forecast_step,
    region_plan,
    session_region_route,
)
from scheduling.live.run import scheduler_run
from scheduling.live.scaling import release
from scheduling.models import Migration, ScalingAction, SchedulerConfig, WorkerCommand
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


def test_the_region_moves_audit_counts_moves_by_region_with_saving_and_cost(coasts, staff_api):
    _east, _west, east_worker, _west_worker = coasts
    for _ in range(6):
        running_on(east_worker)
    running_sessions_move()
    saving = sum(Migration.objects.values_list("estimated_saving_ms", flat=True))
    cost = sum(Migration.objects.values_list("switch_cost_ms", flat=True))
    # when the audit is read, then east has two moves out, west two in, with their estimates
    report = staff_api.get("/api/audit/region-moves/").json()
    assert report["totals"]["cross_region_moves"] == 2
    by_region = report["totals"]["by_region"]
    assert (by_region["east"]["moves_out"], by_region["east"]["moves_in"]) == (2, 0)
    assert (by_region["west"]["moves_out"], by_region["west"]["moves_in"]) == (0, 2)
    assert by_region["east"]["estimated_saving_ms"] == pytest.approx(saving)
    assert by_region["east"]["switch_cost_ms"] == pytest.approx(cost)
    assert by_region["east"]["succeeded_out"] == 0  # still pending: no worker answered
    # and the CSV has one row per bucket and region, summing to the same
    lines = staff_api.get("/api/audit/region-moves/?format=csv").content.decode().splitlines()
    assert (
        lines[0] == "bucket_start,region,moves_out,moves_in,succeeded_out,estimated_saving_ms,switch_cost_ms"
    )
    rows = [line.split(",") for line in lines[1:]]
    assert sorted((r[1], int(r[2]), int(r[3])) for r in rows) == [("east", 2, 0), ("west", 0, 2)]
    # and the migrations API names both regions
    listed = staff_api.get("/api/migrations/?reason=cross-region").json()["results"]
    assert {(m["source_region"], m["target_region"], m["reason"]) for m in listed} == {
        ("east", "west", "cross-region")
    }
    assert staff_api.get("/api/audit/region-moves/?format=xml").status_code == 400


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


def test_an_idle_region_scales_to_zero_through_its_provisioner_and_back_for_a_session(
    coasts, settings, django_capture_on_commit_callbacks
):
    _east, west, east_worker, west_worker = coasts
    settings.STREAMSERVE = {
        **settings.STREAMSERVE,
        "REGION_FORECAST": "last-value",
        "PROVISIONER": "local",
        "STATIC_WORKERS": "cpu-9@localhost:cpu",
    }
    SchedulerConfig.objects.update_or_create(pk=1, defaults={"scale_in_cooldown_s": 0.0, "min_gpus": 0})
    # given west served by the static backend (its worker hand-started there), one nyc session running
    # in east, and a slot whose forecast expects nobody from sfo or chi: the plan sends west nothing
    Region.objects.filter(pk=west.pk).update(provisioner="static")
    GpuWorker.objects.filter(pk=west_worker.pk).update(provider="static")
    running_on(east_worker, origin="nyc")
    region_forecast_step()
    region_plan()
    # when the scheduler ticks with a per-region minimum of one GPU, then west keeps its worker
    settings.STREAMSERVE = {**settings.STREAMSERVE, "REGION_MIN_GPUS": {"west": 1}}
    scheduler_run(trigger="tick")
    assert not ScalingAction.objects.filter(direction="in").exists()
    # and with the default minimum (0) west gives its last worker back (east keeps its own)
    settings.STREAMSERVE = {**settings.STREAMSERVE, "REGION_MIN_GPUS": {}}
    scheduler_run(trigger="tick")
    (action,) = ScalingAction.objects.filter(direction="in")
    assert list(action.workers.all()) == [west_worker]
    assert GpuWorker.objects.get(pk=west_worker.pk).status == GpuWorker.Status.DRAINING
    assert GpuWorker.objects.get(pk=east_worker.pk).status == GpuWorker.Status.READY
    # and the release (the task's body) stops it through west's static backend
    release(worker_id=west_worker.pk, action_id=action.pk)
    action.refresh_from_db()
    assert (action.outcome, action.provisioner_result["provider"]) == ("succeeded", "static")
    GpuWorker.objects.filter(pk=west_worker.pk).update(status=GpuWorker.Status.RELEASED)

    # when an sfo user arrives (west is its only region within budget) and becomes active
    session = SessionFactory(origin="sfo")
    assert session_region_route(session_id=str(session.pk)) == west
    GenerationSession.objects.filter(pk=session.pk).update(activity="active", last_active_at=timezone.now())
    with django_capture_on_commit_callbacks(execute=True):
        scheduler_run(trigger="active", session_id=str(session.pk))
    # then it waits in west, which scales out again through its own backend
    session.refresh_from_db()
    assert (session.status, session.region) == (GenerationSession.Status.QUEUED, west)
    (back,) = ScalingAction.objects.filter(direction="out")
    assert back.reason.endswith("region west")
    assert (back.outcome, back.provisioner_result["provider"]) == ("requested", "static")
    assert GpuWorker.objects.get(name="cpu-9").region == west
