"""The live global router against real PostgreSQL and Redis: sessions go where the OT plan sends
them, never beyond their RTT budget, and a single region changes nothing."""

from __future__ import annotations

import json
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
    region_forecast_step,
    scale_out_regions,
    session_region_route,
)
from scheduling.live.scaling import scale_out
from scheduling.models import SchedulerDecision
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
            HISTORY_KEY, json.dumps({"origins": ["chi", "lon", "nyc", "sfo"], "load": [0, 0, load, 0]})
        )
    SessionFactory(origin="nyc", load=20.0)
    # when a slot runs, then ETS (fitted on this run of samples only) expects the rise to go on
    forecast = region_forecast_step()
    assert forecast["nyc"] > 20.0
    assert forecast["chi"] == 0.0
    assert json.loads(client.get(FORECAST_KEY))["demand"][2] == forecast["nyc"]


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


def test_scale_out_goes_where_routed_load_exceeds_capacity_within_the_limits(coasts):
    east, west = coasts
    # given six nyc sessions in east (4 slots), two sfo sessions in west (8 slots), every region's
    # H100 limit reached but east's (2; it holds 1) and the local region capped at none
    for origin in ["nyc"] * 6 + ["sfo"] * 2:
        arrive(origin)
    Region.objects.filter(pk__in=[east.pk, west.pk]).update(gpu_limits={"h100": 2})
    Region.objects.create(name=Region.DEFAULT_NAME, gpu_limits={"h100": 0})
    # when three H100s are wanted, then east gets one and the rest is beyond every limit
    shares = scale_out_regions(gpu_type="h100", count=3, capacity_per_gpu=4)
    assert [(s.region, s.count) for s in shares] == [(east, 1)]
    # and with room in west too, the second goes there (east is then at its limit)
    Region.objects.filter(pk=west.pk).update(gpu_limits={"h100": 3})
    shares = scale_out_regions(gpu_type="h100", count=3, capacity_per_gpu=4)
    assert [(s.region, s.count) for s in shares] == [(east, 1), (west, 1)]
    # and a GPU type without a limit entry is not limited
    assert sum(s.count for s in scale_out_regions(gpu_type="l4", count=3, capacity_per_gpu=4)) == 3


def test_a_scaled_out_worker_is_in_its_region_at_the_regions_price(coasts, settings):
    east, west = coasts
    settings.STREAMSERVE = {
        **settings.STREAMSERVE,
        "PROVISIONER": "static",
        "STATIC_WORKERS": "cpu-9@localhost:cpu",
    }
    # given east short of capacity and twice as dear, with room for one CPU worker, and no room for
    # CPU workers elsewhere
    Region.objects.filter(pk=east.pk).update(gpu_limits={"cpu": 1}, price_multiplier=2.0)
    Region.objects.filter(pk=west.pk).update(gpu_limits={"cpu": 0})
    Region.objects.create(name=Region.DEFAULT_NAME, gpu_limits={"cpu": 0})
    for _ in range(6):
        arrive("nyc")
    decision = SchedulerDecision.objects.create(
        trigger="tick", decided_at=timezone.now(), policy="turboserve", active_sessions=8, budget=3,
        target_budget=5, duration_ms=0.0, rho_max=1.5, rho_hat=0.7,
    )  # fmt: skip
    # when the decision scales out by two and the provisioner is asked after it
    outbox = Outbox()
    (action,) = scale_out(decision=decision, preset="tiny", gpu_type="cpu", count=2, budget=3, outbox=outbox)
    for call in outbox.after:
        call()
    # then one worker is requested, in east, at the profile's $0.1/h × 2
    assert (action.from_budget, action.to_budget, action.reason.endswith("region east")) == (3, 4, True)
    worker = GpuWorker.objects.get(name="cpu-9")
    assert (worker.region, worker.price_per_hour) == (east, Decimal("0.2"))
