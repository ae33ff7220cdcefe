"""The live global router against real PostgreSQL and Redis: sessions go where the OT plan sends
them, never beyond their RTT budget, and a single region changes nothing."""

from __future__ import annotations

import json
from datetime import timedelta
from decimal import Decimal

import pytest
from django.utils import timezone

from gpu.models import GpuWorker, Region
from scheduling.console import cluster_snapshot
from scheduling.live.outbox import Outbox, redis_client
from scheduling.live.regions import (
    FORECAST_KEY,
    HISTORY_KEY,
    PLAN_KEY,
    parked_sessions_reroute,
    region_forecast_step,
    session_region_route,
)
from scheduling.live.run import scheduler_run
from scheduling.live.scaling import scale_out
from scheduling.models import Migration, ScalingAction, SchedulerConfig, SchedulerDecision
from scheduling.receivers import session_event_received
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
    """East near nyc, west near sfo (70 ms across: beyond the budget); chi near both."""
    east = Region.objects.create(name="east", rtt_ms={"nyc": 3, "sfo": 70, "chi": 20, "lon": 100})
    west = Region.objects.create(name="west", rtt_ms={"nyc": 70, "sfo": 3, "chi": 25, "lon": 140})
    GpuWorkerFactory(region=east, capacity=4)
    GpuWorkerFactory(region=west, capacity=4)
    GpuWorkerFactory(region=west, capacity=4)
    return east, west


def arrive(origin: str) -> GenerationSession:
    session = SessionFactory(origin=origin)
    session_region_route(session_id=str(session.pk))
    session.refresh_from_db()
    return session


def test_sessions_go_to_the_region_near_their_origin(coasts):
    east, west = coasts
    # when sessions arrive from both coasts, then each is routed to its near region
    assert [arrive(o).region for o in ["nyc", "sfo", "nyc", "sfo"]] == [east, west, east, west]


def test_the_plan_spills_to_the_next_region_within_budget_when_full(coasts):
    east, west = coasts
    # given chi, 20 ms from east (4 slots) and 25 ms from west (8 slots), same prices
    # when six sessions arrive from chi, then the plan fills east first and spills into west
    regions = [arrive("chi").region for _ in range(6)]
    assert regions == [east] * 4 + [west] * 2


def test_a_region_beyond_the_budget_is_never_assigned(coasts):
    east, _west = coasts
    # when nyc sends more sessions than east holds, then they overflow in east (west is 70 ms away)
    assert {arrive("nyc").region for _ in range(7)} == {east}
    # and an origin with no region within its budget gets none
    assert arrive("lon").region is None


def test_the_price_multiplier_moves_the_plan(coasts):
    east, west = coasts
    # given east's GPUs made dear: 100 × (3.6 $/h / 4) × 2 = 180 ms-equivalents above west
    Region.objects.filter(pk=east.pk).update(price_multiplier=3.0)
    # when a chi session arrives, then the plan sends it to the cheaper west despite 5 ms more RTT
    assert arrive("chi").region == west


@pytest.mark.usefixtures("coasts")
def test_the_previous_plan_is_smoothed_and_stored(settings):
    settings.STREAMSERVE = {**settings.STREAMSERVE, "REGION_PLAN_BETA": 0.5}
    # given a stored plan that sent all of chi to west
    origins, names = ["chi", "lon", "nyc", "sfo"], ["east", "west"]
    previous = [[0.0, 1.0], [0.0, 0.0], [1.0, 0.0], [0.0, 1.0]]
    redis_client().set(PLAN_KEY, json.dumps({"regions": names, "origins": origins, "plan": previous}))
    # when a chi session arrives (the fresh plan sends chi to east)
    arrive("chi")
    # then the stored plan is halfway between the two
    stored = json.loads(redis_client().get(PLAN_KEY))
    assert stored["plan"][0] == pytest.approx([0.5, 0.5])


def test_the_router_plans_on_the_forecast(coasts, settings):
    east, west = coasts
    settings.STREAMSERVE = {**settings.STREAMSERVE, "REGION_FORECAST": "last-value"}
    # given a slot in which nyc had four sessions, gone since: the forecast expects them back
    nyc = [arrive("nyc") for _ in range(4)]
    assert region_forecast_step() == {"chi": 0.0, "lon": 0.0, "nyc": 4.0, "sfo": 0.0}
    GenerationSession.objects.filter(pk__in=[s.pk for s in nyc]).update(
        status=GenerationSession.Status.TERMINATED, terminated_at=timezone.now()
    )
    # when a chi session arrives, then the plan keeps east's four slots for nyc (west is beyond its
    # budget) and sends chi west
    assert arrive("chi").region == west
    # and without a forecast chi goes to east, 5 ms nearer
    redis_client().delete(FORECAST_KEY)
    assert arrive("chi").region == east


def test_the_forecast_step_fits_ets_on_the_history_of_these_origins(coasts, settings):
    settings.STREAMSERVE = {**settings.STREAMSERVE, "REGION_FORECAST": "ets"}
    # given a sample taken when the regions knew other origins, then 20 slots of rising nyc load
    client = redis_client()
    client.rpush(HISTORY_KEY, json.dumps({"origins": ["nyc"], "load": [100.0]}))
    for load in range(20):
        client.rpush(
            HISTORY_KEY,
            json.dumps(
                {"origins": ["chi", "lon", "nyc", "sfo"], "load": [0, 0, load, 0], "active": [0, 0, load, 0]}
            ),
        )
    SessionFactory(origin="nyc", load=20.0)
    # when a slot runs, then ETS (fitted on this run of samples only) expects the rise to go on
    forecast = region_forecast_step()
    assert forecast["nyc"] > 20.0
    assert forecast["chi"] == 0.0
    stored = json.loads(client.get(FORECAST_KEY))
    assert stored["demand"][2] == forecast["nyc"]
    # and the floor's input, nyc's active load, is its largest forecast over the provisioning delay
    # and one slot: beyond the next slot's on a rise
    assert stored["floor"][2] > forecast["nyc"]
    assert stored["floor"][0] == 0.0


def test_the_forecast_floor_raises_each_regions_autoscaler_target(coasts, settings):
    east, west = coasts
    settings.STREAMSERVE = {**settings.STREAMSERVE, "REGION_FORECAST": "last-value"}
    SchedulerConfig.objects.update_or_create(pk=1, defaults={"scale_in_cooldown_s": 0.0, "min_gpus": 0})
    # given a slot in which twelve active nyc sessions ran east and two parked sfo ones west, all
    # gone since, and the plan made on that forecast (nyc has only east within its budget)
    gone = [active_in(east, origin="nyc") for _ in range(12)]
    gone += [SessionFactory(origin="sfo", region=west, status="suspended", activity="idle") for _ in range(2)]
    region_forecast_step()
    assert json.loads(redis_client().get(FORECAST_KEY))["floor"] == [0.0, 0.0, 12.0, 0.0]
    session_region_route(session_id=str(SessionFactory(origin="sfo").pk))
    GenerationSession.objects.filter(pk__in=[s.pk for s in gone]).update(
        status=GenerationSession.Status.TERMINATED, terminated_at=timezone.now()
    )
    # when the scheduler ticks with the floor off (the default), then nothing is bought
    assert settings.STREAMSERVE["REGION_FORECAST_FLOOR"] is False
    scheduler_run(trigger="tick")
    assert not ScalingAction.objects.filter(direction="out").exists()
    assert {d.inputs["floor_load"] for d in SchedulerDecision.objects.all()} == {None}
    before = SchedulerDecision.objects.order_by("pk").last().pk
    # and with it on, east scales out ahead of nyc's twelve units (its floor input), west does not
    settings.STREAMSERVE = {**settings.STREAMSERVE, "REGION_FORECAST_FLOOR": True}
    scheduler_run(trigger="tick")
    (action,) = ScalingAction.objects.filter(direction="out")
    assert action.reason.endswith("region east")
    floors = {
        d.inputs["region"]: d.inputs["floor_load"] for d in SchedulerDecision.objects.filter(pk__gt=before)
    }
    assert floors["east"] == pytest.approx(12.0)
    assert floors.get("west", 0.0) == 0.0


def test_one_region_routes_nothing():
    # given only the local region, with a known origin
    Region.objects.create(name=Region.DEFAULT_NAME, rtt_ms={"nyc": 3})
    GpuWorkerFactory(status=GpuWorker.Status.READY)
    # when a session arrives from nyc, then it keeps no region and no plan is stored
    assert arrive("nyc").region is None
    assert redis_client().get(PLAN_KEY) is None


def test_the_arrive_event_routes_the_session(coasts):
    _east, west = coasts
    # given a committed session from sfo, when the scheduler receives its arrive event
    session = SessionFactory(origin="sfo")
    session_event_received(session_id=str(session.pk), kind="arrive", detail={})
    # then the session is in west
    session.refresh_from_db()
    assert session.region == west


def test_the_console_rows_show_origin_and_region(coasts):
    east, _west = coasts
    # given a routed session from nyc
    arrive("nyc")
    # when the console's snapshot is built, then its session row carries both
    (row,) = cluster_snapshot()["session_list"]
    assert (row["origin"], row["region"]) == ("nyc", east.name)


@pytest.mark.usefixtures("coasts")
def test_the_console_shows_each_region_and_each_origins_forecast(settings):
    settings.STREAMSERVE = {**settings.STREAMSERVE, "REGION_FORECAST": "last-value"}
    # given a worker without a region (the local region), sessions routed to each coast and a slot
    GpuWorkerFactory(gpu_type="h20", price_per_hour=Decimal("1.8"))
    for origin in ["nyc", "sfo", "sfo"]:
        arrive(origin)
    region_forecast_step()
    arrive("nyc")
    # when the console's snapshot is built
    snapshot = cluster_snapshot()
    # then each region shows its GPUs, slots, sessions and cost rate
    regions = {r["name"]: r for r in snapshot["regions"]}
    assert set(regions) == {"east", "west", "local"}
    assert [(r["gpus"], r["slots"], r["sessions"], r["cost_rate_per_hour"]) for r in regions.values()] == [
        (1, 4, 2, 3.6),
        (1, 4, 0, 1.8),
        (2, 8, 2, 7.2),
    ]
    assert regions["local"]["gpus_by_type"] == {"h20": 1}
    # and each origin its load now against the forecast made a slot ago
    by_origin = {o["origin"]: (o["load"], o["forecast"]) for o in snapshot["origins"]}
    assert by_origin["nyc"] == (2.0, 1.0)
    assert by_origin["sfo"] == (2.0, 2.0)


def active_in(region: Region, origin: str = "chi", **kwargs) -> GenerationSession:
    return SessionFactory(
        origin=origin, region=region, activity="active", last_active_at=timezone.now(), **kwargs
    )


def test_sessions_run_only_on_their_regions_workers(coasts):
    east, _west = coasts
    # given three sessions routed east (one worker there, two idle in west)
    sessions = [active_in(east) for _ in range(3)]
    # when the scheduler runs on each activation
    for session in sessions:
        scheduler_run(trigger="active", session_id=str(session.pk))
    # then all three execute on east's worker, and every decision names its region
    placed = GenerationSession.objects.filter(pk__in=[s.pk for s in sessions])
    assert {(s.status, s.worker.region_id) for s in placed} == {(GenerationSession.Status.EXECUTING, east.pk)}
    assert {d.inputs["region"] for d in SchedulerDecision.objects.all()} == {"east"}


def test_a_session_its_region_cannot_place_runs_in_the_nearest_region_within_budget(coasts):
    east, west = coasts
    # given east's only worker still booting
    GpuWorker.objects.filter(region=east).update(status=GpuWorker.Status.PROVISIONING)
    # when a chi session routed east becomes active (west is 25 ms from chi: within the budget)
    session = active_in(east)
    scheduler_run(trigger="active", session_id=str(session.pk))
    # then it is re-routed to west and executes there now
    session.refresh_from_db()
    assert (session.region, session.status, session.worker.region) == (
        west,
        GenerationSession.Status.EXECUTING,
        west,
    )
    assert SchedulerDecision.objects.get(inputs__region="west").inputs["rerouted_in"] == [str(session.pk)]
    # and a nyc session (west is 70 ms away) waits for east instead
    waiting = active_in(east, origin="nyc")
    scheduler_run(trigger="active", session_id=str(waiting.pk))
    waiting.refresh_from_db()
    assert (waiting.region, waiting.status, waiting.queue_position) == (
        east,
        GenerationSession.Status.QUEUED,
        1,
    )


def test_each_region_scales_on_its_own_load_within_its_limits(coasts):
    east, west = coasts
    SchedulerConfig.objects.update_or_create(pk=1, defaults={"scale_in_cooldown_s": 0.0, "min_gpus": 0})
    # given twelve sessions routed east (one worker: twelve units on K = 8) and west's two workers idle
    for _ in range(12):
        active_in(east)
    # when the scheduler ticks
    scheduler_run(trigger="tick")
    # then east scales out by one for its own load, and west drains one of its idle workers
    (action,) = ScalingAction.objects.filter(direction="out")
    assert (action.to_budget - action.from_budget, action.reason.endswith("region east")) == (1, True)
    assert GpuWorker.objects.filter(region=west, status=GpuWorker.Status.DRAINING).count() == 1
    # and with east at its limit of one GPU, no region buys one for east's load
    ScalingAction.objects.all().delete()
    GpuWorker.objects.filter(region=east).update(gpu_type="cpu")
    Region.objects.filter(pk=east.pk).update(gpu_limits={"cpu": 1})
    scheduler_run(trigger="tick")
    assert not ScalingAction.objects.filter(direction="out").exists()


def scale_out_one(region: Region) -> ScalingAction:
    """A tick's decision (budget 3 → 5) scales ``region`` out by one tiny CPU worker; the outbox's
    after-commit calls (the provisioner's request) run at once."""
    decision = SchedulerDecision.objects.create(
        trigger="tick", decided_at=timezone.now(), policy="turboserve", active_sessions=8, budget=3,
        target_budget=5, duration_ms=0.0, rho_max=1.5, rho_hat=0.7,
    )  # fmt: skip
    outbox = Outbox()
    action = scale_out(
        decision=decision, preset="tiny", gpu_type="cpu", count=1, budget=3, outbox=outbox, region=region
    )
    for call in outbox.after:
        call()
    return action


def test_a_scaled_out_worker_is_in_its_region_at_the_regions_price(coasts, settings):
    east, _west = coasts
    settings.STREAMSERVE = {
        **settings.STREAMSERVE,
        "PROVISIONER": "static",
        "STATIC_WORKERS": "cpu-9@localhost:cpu",
    }
    # given east twice as dear
    Region.objects.filter(pk=east.pk).update(price_multiplier=2.0)
    east.refresh_from_db()
    # when east's decision scales out by one and the provisioner is asked after it
    action = scale_out_one(east)
    # then the worker is requested in east, at the profile's $0.1/h × 2
    assert (action.from_budget, action.to_budget, action.reason.endswith("region east")) == (3, 4, True)
    worker = GpuWorker.objects.get(name="cpu-9")
    assert (worker.region, worker.price_per_hour) == (east, Decimal("0.2"))


def test_a_region_scales_out_through_its_own_provisioner(coasts, settings):
    east, _west = coasts
    # given the local backend by setting, and east naming the static one (a hand-started worker)
    settings.STREAMSERVE = {
        **settings.STREAMSERVE,
        "PROVISIONER": "local",
        "STATIC_WORKERS": "cpu-9@localhost:cpu",
    }
    Region.objects.filter(pk=east.pk).update(provisioner="static")
    east.refresh_from_db()
    # when east's decision scales out by one
    action = scale_out_one(east)
    # then east's static backend granted its configured worker (no local process started)
    action.refresh_from_db()
    assert (action.outcome, action.provisioner_result["provider"]) == ("requested", "static")
    worker = GpuWorker.objects.get(name="cpu-9")
    assert (worker.provider, worker.region) == ("static", east)


def parked_in(region: Region, origin: str, host: GpuWorker, minutes_idle: int) -> GenerationSession:
    return SessionFactory(
        origin=origin,
        region=region,
        status=GenerationSession.Status.SUSPENDED,
        activity="idle",
        state_location=GenerationSession.StateLocation.HOST,
        host_worker=host,
        last_active_at=timezone.now() - timedelta(minutes=minutes_idle),
    )


def test_parked_sessions_move_where_the_plan_shifts_their_origin_and_resume_there(coasts, settings):
    east, west = coasts
    settings.STREAMSERVE = {**settings.STREAMSERVE, "REGION_MOVES_PER_SLOT": 2}
    east_worker = GpuWorker.objects.get(region=east)
    # given east's four slots taken by nyc (west is beyond nyc's budget), three chi sessions parked in
    # east (chi is within budget of both) and one chi session active there
    for _ in range(4):
        active_in(east, origin="nyc")
    parked = [parked_in(east, "chi", east_worker, minutes_idle=m) for m in (1, 9, 5)]
    active_in(east, origin="chi")
    # when a slot runs, then the two longest idle move to west, where the plan sends chi
    moves = parked_sessions_reroute()
    assert [(m.session, m.source, m.target) for m in moves] == [
        (str(parked[1].pk), "east", "west"),
        (str(parked[2].pk), "east", "west"),
    ]
    # and the next slot moves the third (the active one stays until it idles)
    assert [m.session for m in parked_sessions_reroute()] == [str(parked[0].pk)]
    assert parked_sessions_reroute() == []
    # when a moved session becomes active again, then its parked state migrates to a west worker
    session = parked[1]
    GenerationSession.objects.filter(pk=session.pk).update(activity="active", last_active_at=timezone.now())
    scheduler_run(trigger="active", session_id=str(session.pk))
    migration = Migration.objects.get(session=session)
    assert (migration.reason, migration.source, migration.target.region) == (
        "resume-remote",
        east_worker,
        west,
    )


def test_no_parked_session_moves_when_disabled_or_when_the_plan_keeps_it(coasts, settings):
    east, _west = coasts
    east_worker = GpuWorker.objects.get(region=east)
    # given one chi session parked in east, which has room: the plan keeps chi there (20 ms against 25)
    parked_in(east, "chi", east_worker, minutes_idle=3)
    # when a slot runs, then it stays
    assert parked_sessions_reroute() == []
    # and with moves disabled nothing moves even when the plan would
    settings.STREAMSERVE = {**settings.STREAMSERVE, "REGION_MOVES_PER_SLOT": 0}
    for _ in range(4):
        active_in(east, origin="nyc")
    assert parked_sessions_reroute() == []
