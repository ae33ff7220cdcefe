"""The decision pipeline (``scheduling.core.pipeline``): each step's input reaches the policy as a field
of its snapshot, never as an attribute of the policy, and a pool in one region is decided exactly as
its policy alone would decide it (what the simulator relies on for unchanged figures)."""

from __future__ import annotations

from dataclasses import replace

import pytest

from scheduling.core.jobs.backlog import backlog_gpus
from scheduling.core.pipeline import (
    DecisionInputs,
    JobDemand,
    RegionLayout,
    decision_run,
    route_event,
)
from scheduling.core.regions.forecast import predictive_floor
from scheduling.core.stages.encoders import encoder_lost
from scheduling.core.turboserve import TurboServePolicy
from scheduling.core.types import Event, EventKind, GpuTypeSpec, GpuView, SessionView, Snapshot

SPEC = GpuTypeSpec(
    name="t",
    gpu_type="t",
    capacity=4.0,
    latency_points=((0.0, 100.0), (8.0, 300.0)),
    price_per_hour=1.0,
    provisioning_delay_s=30.0,
    memory_limit_sessions=6,
)
EAST = RegionLayout(
    default="local",
    gpu_region={"e1": "east", "e2": "east", "l1": "local"},
    session_region={"a": "east", "b": "east", "gone": "east"},
)


def ready(gid: str) -> GpuView:
    return GpuView(id=gid, gpu_type="t", status="ready", ready_at=0.0)


def session(sid: str, gpu: str | None = None, alpha: int = 1) -> SessionView:
    return SessionView(id=sid, alpha=alpha, state="executing" if gpu else "suspended", gpu=gpu, since=1.0)


def snapshot(sessions, gpus) -> Snapshot:
    return Snapshot.build(time=100.0, sessions=sessions, gpus=gpus, gpu_types={"t": SPEC}, max_gpus=10)


def one_policy(policy):
    return lambda regions: dict.fromkeys(regions, policy)


def test_a_pool_in_one_region_is_decided_by_its_policy_on_the_snapshot_as_it_is():
    snap = snapshot([session("a", "g1"), session("b")], [ready("g1"), ready("g2")])
    event = Event(time=100.0, kind="active", session="b")
    # when the pipeline runs on a pool without regions
    run = decision_run(DecisionInputs(snapshot=snap, event=event), one_policy(TurboServePolicy(rho_hat=0.7)))
    # then its one region saw the very snapshot and the event, and decided as the policy alone does
    (part,) = run.regions.values()
    assert part.snapshot is snap and part.event is event and run.event_region == "local"
    assert part.decision == TurboServePolicy(rho_hat=0.7).decide(snap, event)
    assert run.rerouted == {} and part.rerouted_in == part.released_to_zero == ()


def test_the_floor_is_an_input_of_the_decision_not_an_attribute_of_the_policy():
    snap = snapshot([session("a", "g1")], [ready("g1")])
    tick = Event(time=100.0, kind="tick")
    policy = TurboServePolicy(rho_hat=0.5, headroom=False)
    # when the region's forecast load is 12 sessions
    run = decision_run(
        DecisionInputs(snapshot=snap, event=tick, floor_load={"local": 12.0}), one_policy(policy)
    )
    part = run.regions["local"]
    # then the policy saw it on its snapshot, asked for Eq. 6's GPUs, and holds no floor of its own
    expected = predictive_floor(0.0, 12.0, SPEC.capacity * 0.5, sigma=0.5, max_gpus=10)
    assert part.snapshot.floor_load == 12.0 and part.decision.signals.floor_gpus == expected
    assert part.decision.target_budget == expected and part.decision.add_gpus == (("t", expected - 1),)
    assert not hasattr(policy, "floor_load")
    # and without a floor the same policy state keeps one GPU
    quiet = decision_run(DecisionInputs(snapshot=snap, event=tick), one_policy(TurboServePolicy(rho_hat=0.5)))
    assert quiet.regions["local"].decision.signals.floor_gpus is None
    assert quiet.regions["local"].decision.add_gpus == ()


def test_the_jobs_count_in_the_region_of_the_gpu_holding_them_queued_ones_in_the_default():
    snap = snapshot([], [ready("e1"), ready("e2"), ready("l1")])
    held = [(400.0, "j1", 60.0), (500.0, "j2", 120.0)]
    queued = [(300.0, "j3", 30.0)]
    jobs = JobDemand(open_jobs={"e1": held, None: queued}, holders={"e1", "gone-gpu"}, slots_per_gpu=4.0)
    # when the pipeline runs with the pool's jobs
    run = decision_run(
        DecisionInputs(snapshot=snap, event=Event(time=100.0, kind="tick"), layout=EAST, jobs=jobs),
        lambda regions: {r: TurboServePolicy(rho_hat=0.7) for r in regions},
    )
    # then each region's snapshot carries its own backlog, in GPUs of four job slots, and its holders
    east, local = run.regions["east"].snapshot, run.regions["local"].snapshot
    assert east.job_demand_gpus == pytest.approx(backlog_gpus(held, 100.0) / 4.0)
    assert local.job_demand_gpus == pytest.approx(backlog_gpus(queued, 100.0) / 4.0)
    assert (east.job_gpus, local.job_gpus) == (("e1",), ())


def test_the_event_goes_to_its_sessions_region_and_a_tick_everywhere_else():
    snap = snapshot([session("a", "e1"), session("b"), session("c", "l1")], [ready("e1"), ready("l1")])
    # a running session's event goes where it runs, a waiting or departed one's to its routed region
    assert route_event(snap, EAST, Event(time=100.0, kind="idle", session="c")) == "local"
    assert route_event(snap, EAST, Event(time=100.0, kind="active", session="b")) == "east"
    assert route_event(snap, EAST, Event(time=100.0, kind="depart", session="gone")) == "east"
    # a GPU's event goes to the GPU's region; a periodic tick to none
    assert route_event(snap, EAST, Event(time=100.0, kind="gpu_ready", gpu="e1")) == "east"
    assert route_event(snap, EAST, Event(time=100.0, kind="tick")) is None
    # when the pipeline runs on b's activation, east observes it and local a tick
    run = decision_run(
        DecisionInputs(snapshot=snap, event=Event(time=100.0, kind="active", session="b"), layout=EAST),
        lambda regions: {r: TurboServePolicy(rho_hat=0.7) for r in regions},
    )
    assert run.regions["east"].event.session == "b"
    assert run.regions["local"].event == Event(time=100.0, kind=EventKind.TICK)
    assert ("b", "e1") in run.regions["east"].decision.assign


def test_an_idle_region_gives_back_its_gpus_and_the_run_says_which():
    snap = snapshot([session("c", "l1")], [ready("e1"), ready("e2"), ready("l1")])
    layout = replace(EAST, session_region={})
    run = decision_run(
        DecisionInputs(
            snapshot=snap, event=Event(time=100.0, kind="tick"), layout=layout, idle_forecast=lambda: {"east"}
        ),
        lambda regions: {r: TurboServePolicy(rho_hat=0.7, release_grace_s=0.0) for r in regions},
    )
    east = run.regions["east"]
    assert set(east.decision.release) == {"e1", "e2"}
    assert set(east.released_to_zero) <= {"e1", "e2"} and east.released_to_zero
    assert run.regions["local"].released_to_zero == ()


def test_a_worker_without_e_needs_another_encoder_when_its_own_is_gone_or_its_wait_will_not_end():
    assert encoder_lost("enc-1", {"enc-2"}, None) == "encoder enc-1 is no longer ready"
    assert encoder_lost("enc-1", {"enc-1"}, None) is None
    lost = {"sessions": ["s1"], "reason": "encoder enc-1 lost"}
    assert encoder_lost("enc-1", {"enc-1"}, lost) == "heartbeat: encoder enc-1 lost"
    # an encode in flight ends by itself
    assert encoder_lost(None, set(), {"sessions": ["s1"], "reason": "waiting for encoder enc-1"}) is None
