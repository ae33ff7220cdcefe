"""Weighted fair share in the decision (``scheduling.core.tenants``, pipeline step ``fair_share``): the
tenant furthest under its share is offered the GPUs first, FCFS within a tenant, and a tenant over a
GPU-second quota waits on spare capacity and never makes the pool scale out."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

from scheduling.benchmarks.scheduler import format_bench, run_bench
from scheduling.core.pipeline import DecisionInputs, decision_run
from scheduling.core.tenants import TenantShares, fair_order
from scheduling.core.turboserve import TurboServePolicy
from scheduling.core.types import Event, GpuTypeSpec, GpuView, SessionView, Snapshot
from scheduling.sim.cli import CliError, parse_tenant_weights
from scheduling.sim.simulator import SimConfig, simulate
from scheduling.sim.traces import TraceError, TraceEvent, parse_trace

SPEC = GpuTypeSpec(
    name="t",
    gpu_type="t",
    capacity=4.0,
    latency_points=((0.0, 100.0), (8.0, 300.0)),
    price_per_hour=1.0,
    provisioning_delay_s=30.0,
    memory_limit_sessions=2,
)


def waiting(sid: str, since: float) -> SessionView:
    return SessionView(id=sid, alpha=1, state="queued", since=since)


def running(sid: str, gpu: str) -> SessionView:
    return SessionView(id=sid, alpha=1, state="executing", gpu=gpu, since=0.0)


def full_pool(*pending: SessionView, max_gpus: int = 10) -> Snapshot:
    """One ready GPU at half its K with no memory left (two residents), and ``pending`` waiting."""
    return Snapshot.build(
        time=100.0,
        sessions=[running("r1", "g1"), running("r2", "g1"), *pending],
        gpus=[GpuView(id="g1", gpu_type="t", status="ready", ready_at=0.0)],
        gpu_types={"t": SPEC},
        max_gpus=max_gpus,
    )


def test_the_tenant_under_its_share_goes_first_fcfs_within_each_tenant():
    shares = TenantShares(
        session_tenant={"a1": "a", "a2": "a", "b1": "b", "b2": "b"},
        weights={"a": 3.0, "b": 1.0},
        # a used 60 s for a weight of 3 (20 per unit), b 30 s for 1 (30 per unit): a is under its share
        usage={"a": 60.0, "b": 30.0},
    )
    assert fair_order(("b1", "a1", "b2", "a2"), shares) == ("a1", "a2", "b1", "b2")
    # b's 30 s is now under its quarter of 200: b goes first, its sessions still in arrival order
    assert fair_order(
        ("b1", "a1", "b2", "a2"), TenantShares(**{**shares.__dict__, "usage": {"a": 170.0, "b": 30.0}})
    ) == (
        "b1",
        "b2",
        "a1",
        "a2",
    )


def test_one_tenant_keeps_arrival_order_and_a_tenant_over_quota_goes_last():
    assert fair_order(("x", "y"), TenantShares(session_tenant={"x": "a", "y": "a"})) == ("x", "y")
    shares = TenantShares(
        session_tenant={"a1": "a", "b1": "b"}, usage={"b": 0.0, "a": 99.0}, spare_only=frozenset({"b"})
    )
    assert fair_order(("b1", "a1"), shares) == ("a1", "b1")


def test_the_decision_queues_in_fair_share_order():
    snap = full_pool(waiting("b1", 1.0), waiting("a1", 2.0))
    shares = TenantShares(
        session_tenant={"a1": "a", "b1": "b"}, weights={"a": 3.0}, usage={"a": 30.0, "b": 30.0}
    )
    event = Event(time=100.0, kind="tick")
    policy = TurboServePolicy(rho_hat=0.7, autoscale=False)
    run = decision_run(
        DecisionInputs(snapshot=snap, event=event, tenants=shares), lambda rs: dict.fromkeys(rs, policy)
    )
    (part,) = run.regions.values()
    assert part.snapshot.pending == ("a1", "b1")
    assert part.decision.queue == ("a1", "b1")
    # without tenants: arrival order
    plain = decision_run(DecisionInputs(snapshot=snap, event=event), lambda rs: dict.fromkeys(rs, policy))
    assert plain.regions["local"].decision.queue == ("b1", "a1")


def test_a_tenant_over_its_gpu_quota_never_triggers_scale_out():
    snap = full_pool(waiting("b1", 1.0), waiting("b2", 2.0))
    event = Event(time=100.0, kind="active", session="b2")
    over = TenantShares(session_tenant={"b1": "b", "b2": "b"}, spare_only=frozenset({"b"}))
    within = TenantShares(session_tenant={"b1": "b", "b2": "b"})

    def decide(shares):
        policy = TurboServePolicy(rho_hat=0.7)
        run = decision_run(
            DecisionInputs(snapshot=snap, event=event, tenants=shares), lambda rs: dict.fromkeys(rs, policy)
        )
        return run.regions["local"]

    # within its quota, the waiting sessions make the pool grow; over it, they wait for spare room
    assert decide(within).decision.add_gpus != ()
    spared = decide(over)
    assert spared.snapshot.spare_only == {"b1", "b2"}
    assert spared.decision.add_gpus == () and spared.decision.queue == ("b1", "b2")


def test_running_sessions_of_a_tenant_over_quota_do_not_count_as_demand():
    # Given: a GPU loaded above the target (ρ = 0.5 > 0.3) by a tenant over its quota's sessions alone
    snap = full_pool()
    event = Event(time=100.0, kind="tick")
    over = TenantShares(session_tenant={"r1": "b", "r2": "b"}, spare_only=frozenset({"b"}))
    policy = TurboServePolicy(rho_hat=0.3)
    run = decision_run(
        DecisionInputs(snapshot=snap, event=event, tenants=over), lambda rs: dict.fromkeys(rs, policy)
    )
    decision = run.regions["local"].decision
    # Then: they keep running where they are, and the pool does not grow for them
    assert decision.add_gpus == () and decision.signals.n_req == 0.0
    assert decision.drain == decision.release == ()
    baseline = decision_run(
        DecisionInputs(snapshot=snap, event=event),
        lambda rs: dict.fromkeys(rs, TurboServePolicy(rho_hat=0.3)),
    )
    assert baseline.regions["local"].decision.add_gpus != ()


# --- the simulator: tenants in traces, GPU-seconds by weight ----------------------------------------


def two_tenants_saturating(duration_s: float = 1800.0, every_s: float = 3.0, hold_s: float = 60.0):
    """Tenants a and b each start a one-minute stream every ``every_s``: each alone would fill the
    pool's memory twice over, so free slots go to whoever the queue puts first."""
    events = []
    t, n = 0.0, 0
    while t < duration_s - hold_s:
        for tenant in ("a", "b"):
            sid = f"{tenant}{n}"
            events += [
                (t, 0, TraceEvent(t, sid, "arrive", tenant=tenant)),
                (t, 1, TraceEvent(t, sid, "active")),
                (t + hold_s, 2, TraceEvent(t + hold_s, sid, "depart")),
            ]
            n += 1
        t += every_s
    return [event for *_, event in sorted(events, key=lambda e: (e[0], e[1], e[2].session))]


@pytest.mark.parametrize(("weights", "share_a"), [({"a": 3.0, "b": 1.0}, 0.75), ({"a": 1.0, "b": 3.0}, 0.25)])
def test_a_simulated_run_gives_tenants_gpu_seconds_by_their_weights(weights, share_a):
    # Given: a fixed pool of two GPUs with memory for four streams each, both tenants saturating it
    memory_bound = replace(SPEC, memory_limit_sessions=4)
    config = SimConfig(
        profiles=[memory_bound], initial_gpus=2, min_gpus=2, max_gpus=2, tenant_weights=weights,
        duration_s=1800.0, measure_from_s=300.0,
    )  # fmt: skip
    # When: the trace is replayed through the live loop's pipeline
    result = simulate(two_tenants_saturating(), TurboServePolicy(), config, "two-tenants")
    # Then: GPU-seconds follow the weights, within 5 points
    assert result.tenants is not None
    assert result.tenants["a"]["share"] == pytest.approx(share_a, abs=0.05)
    assert result.tenants["a"]["gpu_seconds"] + result.tenants["b"]["gpu_seconds"] > 0.9 * 1500 * 2
    assert result.to_json(timeline=False)["tenants"]["a"]["weight_share"] == share_a


def test_a_trace_carries_the_tenant_of_each_arrival():
    lines = [
        json.dumps({"t": 0, "session": "s1", "event": "arrive", "tenant": "vision"}),
        json.dumps({"t": 1, "session": "s1", "event": "active"}),
    ]
    _, events = parse_trace(lines)
    assert events[0].tenant == "vision" and events[0].to_json()["tenant"] == "vision"
    with pytest.raises(TraceError, match="'tenant' must be a non-empty string"):
        parse_trace([json.dumps({"t": 0, "session": "s1", "event": "arrive", "tenant": 3})])
    with pytest.raises(TraceError, match="unknown field"):
        parse_trace([json.dumps({"t": 0, "session": "s1", "event": "active", "tenant": "vision"})])


def test_bench_scheduler_runs_the_fair_share_with_tenants_and_refuses_a_negative_count():
    report = run_bench(gpus="4", events=20, tenants=3)
    assert report["tenants"] == 3 and report["sizes"][0]["decisions"] > 0
    assert "3 tenants" in format_bench(report)
    with pytest.raises(CliError, match="tenants"):
        run_bench(gpus="4", events=20, tenants=-1)


@pytest.mark.parametrize("bad", ["a", "a=0", "=2", "a=-1", "a=nan", "a=inf", "a=three"])
def test_a_bad_tenant_weight_names_the_flag(bad):
    with pytest.raises(CliError, match="tenant-weight"):
        parse_tenant_weights([bad])
    assert parse_tenant_weights(["a=3", "b=0.5"]) == {"a": 3.0, "b": 0.5}
