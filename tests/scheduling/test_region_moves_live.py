"""Running sessions move across regions when the saving beats the switching cost, and an idle region
scales to zero (real PostgreSQL and Redis; the workers' side of a move is in
``test_region_moves_workers.py``)."""

from __future__ import annotations

import json
from datetime import timedelta

import pytest
from django.utils import timezone

from gpu.models import GpuWorker, Region
from scheduling.console import cluster_snapshot
from scheduling.core.regions.moves import switch_cost_ms
from scheduling.live.answers import migration_completed, migration_failed
from scheduling.live.liveness import commands_expire, sessions_recover
from scheduling.live.outbox import redis_client
from scheduling.live.region_moves import running_sessions_move, slot_moves
from scheduling.live.regions import (
    FORECAST_KEY,
    HISTORY_KEY,
    PLAN_KEY,
    region_floor_load,
    region_forecast_step,
    region_layout,
    region_plan,
    session_region_route,
)
from scheduling.live.run import scheduler_run
from scheduling.live.scaling import release
from scheduling.live.worker_profiles import default_gpu_type, profile_for
from scheduling.models import Migration, ScalingAction, SchedulerConfig, SchedulerDecision, WorkerCommand
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
    # and they stay in east, where they still run, until their migrations succeed
    assert {(s.status, s.region_id) for s in moved} == {(GenerationSession.Status.MIGRATING, east.pk)}
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
    # and the release says why: an idle region to zero, not TurboServe's consolidation
    assert action.reason == "idle region to zero: region west has no session and a forecast of none"
    timeline = [e["detail"] for e in cluster_snapshot()["timeline"] if "idle region to zero" in e["detail"]]
    assert timeline
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


def _layout_region(session_id: str) -> str:
    """The region the scheduler's per-region planning puts a session in."""
    sessions, workers = list(GenerationSession.objects.all()), list(GpuWorker.objects.all())
    return region_layout(sessions=sessions, workers=workers).session_region[session_id]


def test_a_moved_session_is_in_its_new_region_only_once_its_migration_succeeds(coasts, staff_api):
    east, west, east_worker, west_worker = coasts
    for _ in range(6):
        running_on(east_worker)
    done, _other = running_sessions_move()
    # given a move under way: the session still runs in east, and the scheduler and console say so
    assert GenerationSession.objects.get(pk=done.move.session).region == east
    assert _layout_region(done.move.session) == "east"
    # when the target reports the state verified (ownership flips)
    out = WorkerCommand.objects.get(worker=east_worker, session_id=done.move.session, kind="migrate_out")
    migration_completed(command=out.payload, report={})
    # then the session runs on west's worker and is in west, for the scheduler, console and audit alike
    session = GenerationSession.objects.get(pk=done.move.session)
    assert (session.status, session.worker, session.region) == ("executing", west_worker, west)
    assert _layout_region(done.move.session) == "west"
    regions = {r["name"]: r for r in cluster_snapshot()["regions"]}
    assert (regions["east"]["sessions"], regions["west"]["sessions"]) == (5, 1)
    by_region = staff_api.get("/api/audit/region-moves/").json()["totals"]["by_region"]
    assert by_region["east"]["succeeded_out"] == 1


@pytest.mark.parametrize("failure", ["refused", "timed out", "source lost"])
def test_a_failed_move_leaves_the_session_in_the_region_it_runs_in(coasts, failure, settings, tmp_path):
    east, _west, east_worker, _west_worker = coasts
    settings.STREAMSERVE = {**settings.STREAMSERVE, "CHECKPOINT_DIR": str(tmp_path)}
    for _ in range(6):
        running_on(east_worker)
    started, _other = running_sessions_move()
    # when the migration fails: the source refuses, nobody answers before the deadline, or the
    # source worker is lost (the session restarts from its checkpoint, in its own region)
    if failure == "refused":
        migration_failed(
            command={"migration": started.migration, "session": started.move.session}, error="busy"
        )
    elif failure == "timed out":
        commands_expire(now=timezone.now() + timedelta(hours=1))
    else:
        sessions_recover(worker=east_worker)
    # then the migration failed and the session is in east, where it runs (or waits) — never west
    assert Migration.objects.get(pk=started.migration).outcome == "failed"
    session = GenerationSession.objects.get(pk=started.move.session)
    assert session.region == east
    assert _layout_region(started.move.session) == "east"
    assert session.status == ("queued" if failure == "source lost" else "executing")


def test_a_session_moved_recently_stays_and_a_move_back_pays_both_switches(coasts, settings):
    east, west, east_worker, west_worker = coasts
    # given six chi sessions overloading east (6 on K = 4), each moved there from west a minute ago
    now = timezone.now()
    came = 40.0  # ms: the switch that brought each of them
    for session in [running_on(east_worker) for _ in range(6)]:
        Migration.objects.create(
            session=session, source=west_worker, target=east_worker, reason="cross-region",
            cross_region=True, source_region=west, target_region=east, outcome="succeeded",
            started_at=now - timedelta(seconds=61), finished_at=now - timedelta(seconds=60),
            switch_cost_ms=came,
        )  # fmt: skip
    # when the slot's moves run within the cooldown (default 300 s), then none moves back
    assert settings.STREAMSERVE["REGION_MOVE_COOLDOWN_S"] == 300.0
    assert running_sessions_move() == []
    # and once the cooldown is shorter than a minute, two move back, each charged both switches
    # (the Migration records its own switching cost, which the audit sums)
    settings.STREAMSERVE = {**settings.STREAMSERVE, "REGION_MOVE_COOLDOWN_S": 30.0}
    started = running_sessions_move()
    own = switch_cost_ms(state_bytes=profile_for(default_gpu_type()).state_bytes, wan_gbps=1.0, rtt_ms=25.0)
    assert len(started) == 2
    assert [s.move.charged_ms for s in started] == pytest.approx([own + came] * 2)
    assert [m.switch_cost_ms for m in Migration.objects.filter(outcome="pending")] == pytest.approx([own] * 2)


def test_parked_and_running_moves_share_one_budget_a_slot(coasts, settings):
    east, west, east_worker, _west_worker = coasts
    settings.STREAMSERVE = {
        **settings.STREAMSERVE,
        "REGION_FORECAST": "last-value",
        "REGION_MOVES_PER_SLOT": 3,
    }
    # given east overloaded by six running chi sessions and two parked chi sessions in east, while
    # the plan splits chi's eight units between east and west
    for _ in range(6):
        running_on(east_worker)
    parked = [
        SessionFactory(origin="chi", region=east, status="suspended", activity="idle", load=1.0)
        for _ in range(2)
    ]
    # when the slot runs (beat task "region forecast": the forecast, then the moves)
    region_forecast_step()
    parked_moves, running_moves = slot_moves()
    # then both parked sessions move west and only one running session does: three moves in all
    assert (len(parked_moves), len(running_moves)) == (2, 1)
    assert {s.region for s in GenerationSession.objects.filter(pk__in=[p.pk for p in parked])} == {west}
    assert Migration.objects.filter(cross_region=True).count() == 1


def test_a_region_at_zero_comes_back_ahead_of_forecast_demand(settings, django_capture_on_commit_callbacks):
    settings.STREAMSERVE = {
        **settings.STREAMSERVE,
        "REGION_FORECAST": "last-value",
        "REGION_FORECAST_FLOOR": True,
        "STATIC_WORKERS": "cpu-9@localhost:cpu",
    }
    SchedulerConfig.objects.update_or_create(pk=1, defaults={"scale_in_cooldown_s": 0.0, "min_gpus": 0})
    # given west at zero (no GPU; half east's price, 10 ms from chi against east's 20) and east
    # serving three active chi sessions on its one worker
    east = Region.objects.create(name="east", rtt_ms={"chi": 20, "nyc": 3})
    west = Region.objects.create(name="west", rtt_ms={"chi": 10}, price_multiplier=0.5, provisioner="static")
    east_worker = GpuWorkerFactory(region=east, capacity=4)
    for _ in range(3):
        running_on(east_worker)
    # when a slot forecasts chi's load one provisioning delay ahead and solves the plan
    region_forecast_step()
    region_plan()
    # then routing gives west nothing yet (no capacity), but its predictive floor asks for chi's load
    plan = json.loads(redis_client().get(PLAN_KEY))
    assert plan["plan"][0] == [1.0, 0.0]
    assert region_floor_load()["west"] == pytest.approx(3.0)
    # and the scheduler's tick scales west out ahead of demand through its own backend
    with django_capture_on_commit_callbacks(execute=True):
        scheduler_run(trigger="tick")
    (action,) = ScalingAction.objects.filter(direction="out")
    assert action.reason.endswith("region west")
    assert SchedulerDecision.objects.get(inputs__region="west").inputs["floor_load"] == pytest.approx(3.0)
    booting = GpuWorker.objects.get(name="cpu-9")
    assert (booting.region, booting.status) == (west, GpuWorker.Status.PROVISIONING)
    # and with its capacity coming, the next plan routes a share of chi there
    settings.STREAMSERVE = {**settings.STREAMSERVE, "REGION_PLAN_BETA": 1.0}
    region_plan()
    assert json.loads(redis_client().get(PLAN_KEY))["plan"][0][1] > 0
    # and the idle-region rule does not release it on the next tick
    scheduler_run(trigger="tick")
    assert not ScalingAction.objects.filter(direction="in").exists()
