"""Simulator tests on short hand-built traces (TraceEvent lists; no generator dependence)."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

from scheduling.core.policy import BUILTIN_POLICIES, Policy, make_policy
from scheduling.core.types import GB, Decision, GpuTypeSpec, Migration
from scheduling.sim.cli import REQUIRED_RESULT_KEYS, CliError, run_simulate
from scheduling.sim.simulator import SimConfig, SimulationError, simulate
from scheduling.sim.traces import TraceEvent, write_trace


def flat_spec(k=4, mem=8, ms=500.0, slope=100.0, delay=10.0, price=3.6, link_gbps=100.0, **kw) -> GpuTypeSpec:
    return GpuTypeSpec(
        name="test",
        gpu_type="test",
        capacity=float(k),
        latency_points=((0.0, ms - slope), (float(2 * k), ms - slope + slope * 2 * k)),
        price_per_hour=price,
        provisioning_delay_s=delay,
        memory_limit_sessions=mem,
        state_bytes=int(1 * GB),
        link_gbps=link_gbps,
        host_link_gbps=50.0,
        migration_alpha_ms=5.0,
        **kw,
    )


def trace(*rows) -> list[TraceEvent]:
    return [TraceEvent(t, s, e) for t, s, e in rows]


def burst_trace(n=12, start=1.0, end=60.0) -> list[TraceEvent]:
    rows = [(0.0, f"s{i:02d}", "arrive") for i in range(n)]
    rows += [(start + 0.1 * i, f"s{i:02d}", "active") for i in range(n)]
    rows += [(end, f"s{i:02d}", "depart") for i in range(n)]
    return trace(*rows)


def test_static_cost_is_price_times_provisioned_time_and_chunks_follow_the_curve():
    spec = flat_spec(k=4, ms=500.0, slope=100.0)  # ℓ(1) = 500 ms
    events = trace((0.0, "a", "arrive"), (0.0, "a", "active"), (10.0, "a", "depart"))
    result = simulate(
        events, make_policy("lag"), SimConfig(profiles=[spec], initial_gpus=2, min_gpus=2, max_gpus=2)
    )
    assert result.gpu_cost_usd == pytest.approx(2 * 3.6 * 10 / 3600, rel=1e-6)
    assert result.gpu_seconds == pytest.approx(20.0)
    assert result.chunks == 20  # one session, 500 ms per chunk, 10 s
    assert result.worst_chunk_latency_ms == pytest.approx(500.0)
    assert result.max_wait_ms == 0


def test_colocated_load_slows_every_session_on_the_gpu():
    spec = flat_spec(k=4, ms=500.0, slope=100.0)
    events = trace(
        *[(0.0, f"s{i}", "arrive") for i in range(3)], *[(0.0, f"s{i}", "active") for i in range(3)]
    )
    events += trace(*[(6.0, f"s{i}", "depart") for i in range(3)])
    one_gpu = simulate(
        events, make_policy("lag"), SimConfig(profiles=[spec], initial_gpus=1, min_gpus=1, max_gpus=1)
    )
    three = simulate(
        events, make_policy("lag"), SimConfig(profiles=[spec], initial_gpus=3, min_gpus=3, max_gpus=3)
    )
    assert one_gpu.worst_chunk_latency_ms == pytest.approx(spec.latency_ms(3))
    assert three.worst_chunk_latency_ms == pytest.approx(spec.latency_ms(1))


def test_memory_limit_queues_and_reports_the_wait():
    spec = flat_spec(k=2, mem=2)
    events = trace(
        *[(0.0, f"s{i}", "arrive") for i in range(3)],
        (1.0, "s0", "active"),
        (1.0, "s1", "active"),
        (2.0, "s2", "active"),
        (5.0, "s0", "idle"),
        (9.0, "s1", "depart"),
        (9.0, "s2", "depart"),
        (9.0, "s0", "depart"),
    )
    result = simulate(
        events, make_policy("base"), SimConfig(profiles=[spec], initial_gpus=1, min_gpus=1, max_gpus=1)
    )
    assert result.queued_sessions == 1
    assert result.max_wait_ms == pytest.approx(3000.0)
    assert result.worst_chunk_latency_ms >= 3000.0  # the wait counts in the first chunk


def test_new_gpus_serve_only_after_the_provisioning_delay_and_cost_from_request():
    spec = flat_spec(k=2, mem=20, delay=10.0)
    result = simulate(
        burst_trace(12, end=60.0),
        make_policy("turboserve", rho_hat=0.8),
        SimConfig(profiles=[spec], initial_gpus=1, min_gpus=1, max_gpus=8),
    )
    assert result.peak_gpus > 1 and result.scale_actions >= 1
    # Twelve sessions land on one GPU until the others boot: latency climbs along the curve.
    assert result.worst_chunk_latency_ms >= spec.latency_ms(6)
    late = [row for row in result.timeline if row["t0"] >= 30.0 and row["worst_ms"] > 0]
    assert late and max(r["worst_ms"] for r in late) < result.worst_chunk_latency_ms


class MoveOncePolicy(Policy):
    """Least-loaded placement that migrates session ``a`` to the other GPU once, at t >= 3 s."""

    name = "move-once"

    def __init__(self):
        self.inner = make_policy("lag")
        self.moved = False

    def decide(self, snapshot, event):
        decision = self.inner.decide(snapshot, event)
        s = snapshot.sessions.get("a")
        if self.moved or snapshot.time < 3.0 or s is None or s.state != "executing":
            return decision
        self.moved = True
        dst = next(g for g in sorted(snapshot.gpus) if g != s.gpu)
        return replace(decision, migrations=(Migration("a", s.gpu, dst, 1000.0),))


def test_migration_adds_the_simulators_kappa_not_the_policys_to_the_moved_sessions_next_chunk():
    spec = flat_spec(k=4, ms=500.0, slope=100.0)
    events = trace((0.0, "a", "arrive"), (0.0, "a", "active"), (8.0, "a", "depart"))
    config = SimConfig(profiles=[spec], initial_gpus=2, min_gpus=2, max_gpus=2, tick_s=1.0)
    # The policy claims κ = 1000 ms; the stall is what the state bytes cost over the link.
    result = simulate(events, MoveOncePolicy(), config)
    assert result.migrations == 1
    kappa = spec.kappa_ms(spec.state_bytes)
    assert 0 < kappa < 100.0
    assert result.worst_chunk_latency_ms == pytest.approx(500.0 + kappa)


def test_rebalancing_migrates_only_when_the_gain_covers_kappa():
    spec = flat_spec(k=4, mem=8, ms=500.0, slope=100.0, link_gbps=10.0)  # κ ≈ 105 ms
    rows = [(0.0, f"s{i:02d}", "arrive") for i in range(8)]
    rows += [(1.0 + 0.1 * i, f"s{i:02d}", "active") for i in range(8)]  # alternate onto g0001/g0002
    rows += [(3.0, f"s{i:02d}", "idle") for i in range(0, 8, 2)]  # empties g0001
    rows += [(12.0, f"s{i:02d}", "depart") for i in range(8)]
    config = SimConfig(profiles=[spec], initial_gpus=2, min_gpus=2, max_gpus=2)
    moved = simulate(trace(*rows), make_policy("turboserve-no-autoscale", eta=0.01), config)
    assert moved.migrations >= 1
    kept = simulate(trace(*rows), make_policy("turboserve-no-autoscale", eta=2.0), config)
    assert kept.migrations == 0
    assert moved.mean_chunk_latency_ms < kept.mean_chunk_latency_ms


def test_resume_from_host_memory_adds_copy_time():
    spec = flat_spec(k=4, ms=500.0, slope=100.0)
    events = trace(
        (0.0, "a", "arrive"),
        (0.0, "a", "active"),
        (2.0, "a", "idle"),
        (4.0, "a", "active"),
        (8.0, "a", "depart"),
    )
    result = simulate(
        events, make_policy("lag"), SimConfig(profiles=[spec], initial_gpus=1, min_gpus=1, max_gpus=1)
    )
    assert result.worst_chunk_latency_ms == pytest.approx(500.0 + spec.resume_ms(spec.state_bytes))


def test_a_resume_cut_short_by_idle_does_not_stack_its_copy_on_the_next_one():
    # "a" resumes while "b" keeps the GPU mid-step, goes idle again before its first chunk, and
    # resumes once more: that first chunk pays one copy, not two.
    spec = flat_spec(k=4, ms=500.0, slope=100.0)  # ℓ(1) = 500 ms, ℓ(2) = 600 ms
    events = trace(
        (0.0, "a", "arrive"),
        (0.0, "b", "arrive"),
        (0.0, "a", "active"),
        (0.0, "b", "active"),
        (2.2, "a", "idle"),
        (4.2, "a", "active"),
        (4.25, "a", "idle"),
        (6.2, "a", "active"),
        (9.0, "a", "depart"),
        (9.0, "b", "depart"),
    )
    result = simulate(
        events, make_policy("lag"), SimConfig(profiles=[spec], initial_gpus=1, min_gpus=1, max_gpus=1)
    )
    assert result.worst_chunk_latency_ms == pytest.approx(600.0 + spec.resume_ms(spec.state_bytes))


@pytest.mark.parametrize("name", BUILTIN_POLICIES)
def test_every_builtin_policy_runs_and_is_deterministic(name):
    spec = flat_spec(k=3, mem=6, delay=5.0)
    rows = []
    for i in range(20):
        sid = f"s{i:02d}"
        t0 = i * 1.5
        rows += [
            (t0, sid, "arrive"),
            (t0 + 0.5, sid, "active"),
            (t0 + 8, sid, "idle"),
            (t0 + 12, sid, "active"),
            (t0 + 20, sid, "depart"),
        ]
    events = sorted(trace(*rows), key=lambda e: e.t)
    config = SimConfig(profiles=[spec], initial_gpus=2, min_gpus=1, max_gpus=6)
    a = simulate(events, make_policy(name), config).to_json()
    b = simulate(events, make_policy(name), config).to_json()
    for key in ("scheduler_ms_mean", "scheduler_ms_p99", "scheduler_ms_max"):
        a.pop(key), b.pop(key)
    assert a == b
    assert a["chunks"] > 0 and a["gpu_cost_usd"] > 0


class BadPolicy(Policy):
    name = "bad"

    def decide(self, snapshot, event):
        gpus = sorted(g for g, v in snapshot.gpus.items() if v.status == "ready")
        # releases a GPU that still hosts a session: the simulator must refuse
        busy = [g for g in gpus if snapshot.residents.get(g)]
        assign = tuple((s, gpus[0]) for s in snapshot.pending)
        return Decision(time=snapshot.time, assign=assign, release=tuple(busy))


def test_simulator_rejects_a_policy_that_breaks_the_contract():
    events = trace((0.0, "a", "arrive"), (1.0, "a", "active"), (2.0, "a", "idle"), (3.0, "a", "depart"))
    with pytest.raises(SimulationError, match="resident"):
        simulate(events, BadPolicy(), SimConfig(profiles=[flat_spec()], initial_gpus=1))


def test_cli_simulate_json_has_the_documented_keys(tmp_path):
    path = tmp_path / "t.jsonl"
    write_trace(path, burst_trace(8, end=30.0), meta={"name": "tiny", "duration_s": 30.0})
    out = run_simulate(trace=str(path), policy="turboserve", profile="h100-1.3b", max_gpus=4)
    assert set(REQUIRED_RESULT_KEYS) <= set(out)
    json.dumps(out)
    assert out["trace"] == "tiny" and out["policy"] == "turboserve"
    static = run_simulate(trace=str(path), policy="lag", profile="h100-1.3b", max_gpus=4, budget=3)
    assert static["peak_gpus"] == 3


def test_cli_errors_name_the_flag(tmp_path):
    path = tmp_path / "t.jsonl"
    write_trace(path, burst_trace(2, end=5.0))
    with pytest.raises(CliError) as exc:
        run_simulate(trace=str(path), policy="nope")
    assert exc.value.flag == "policy"
    with pytest.raises(CliError) as exc:
        run_simulate(trace=str(path), policy="lag", profile="no-such")
    assert exc.value.flag == "profile"
    with pytest.raises(CliError) as exc:
        run_simulate(trace=str(tmp_path / "missing.jsonl"), policy="lag")
    assert exc.value.flag == "trace"
    with pytest.raises(CliError) as exc:
        run_simulate(trace=str(path), policy="lag", slo_ms=-1)
    assert exc.value.flag == "slo-ms"


def test_heterogeneous_pool_scales_out_with_the_cheapest_type_per_capacity_within_availability():
    cheap = GpuTypeSpec(
        name="cheap",
        gpu_type="a",
        capacity=2.0,
        latency_points=((0.0, 300.0), (4.0, 700.0)),
        price_per_hour=1.0,
        provisioning_delay_s=5.0,
        memory_limit_sessions=4,
        availability=2,
    )
    pricey = GpuTypeSpec(
        name="pricey",
        gpu_type="b",
        capacity=4.0,
        latency_points=((0.0, 300.0), (8.0, 700.0)),
        price_per_hour=4.0,
        provisioning_delay_s=5.0,
        memory_limit_sessions=8,
    )
    sim_events = burst_trace(12, end=60.0)
    from scheduling.sim.simulator import Simulator

    sim = Simulator(
        make_policy("turboserve", rho_hat=0.8),
        SimConfig(profiles=[cheap, pricey], initial_gpus=1, max_gpus=8),
    )
    result = sim.run(sim_events)
    types = [g.type_key for g in sim.all_gpus]
    assert types.count("cheap") == 2  # availability cap reached before the dearer type is used
    assert "pricey" in types
    # Twelve sessions, memory for four on the warm GPU: the rest wait at most one provisioning delay.
    assert 0 < result.max_wait_ms <= 5000.0 + 1e-6


def test_cli_policy_options_reach_the_policy_and_bad_ones_name_the_flag(tmp_path):
    path = tmp_path / "t.jsonl"
    write_trace(path, burst_trace(4, end=10.0))
    out = run_simulate(
        trace=str(path),
        policy="turboserve",
        profile="h100-1.3b",
        max_gpus=4,
        options=["headroom=false", "cooldown_s=0"],
    )
    assert out["policy_config"]["headroom"] is False and out["policy_config"]["cooldown_s"] == 0
    with pytest.raises(CliError) as exc:
        run_simulate(trace=str(path), policy="turboserve", options=["bogus=1"])
    assert exc.value.flag == "option"
    with pytest.raises(CliError) as exc:
        run_simulate(trace=str(path), policy="turboserve", options=["novalue"])
    assert exc.value.flag == "option"


def test_capacity_for_slo_inverts_the_curve_with_one_stall_included():
    spec = GpuTypeSpec(
        name="t",
        gpu_type="t",
        capacity=4.0,
        latency_points=((0.0, 100.0), (2.0, 200.0), (4.0, 400.0)),
        price_per_hour=1.0,
        provisioning_delay_s=0.0,
        memory_limit_sessions=16,
        state_bytes=1 * GB,
        link_gbps=100.0,
        host_link_gbps=50.0,
        migration_alpha_ms=5.0,
    )
    stall = spec.stall_allowance_ms
    assert stall == pytest.approx(max(20.0, 5.0 + 10.0))  # the resume copy dominates κ here
    # The default SLO is met exactly at K.
    assert spec.default_slo_ms == pytest.approx(400.0 + stall)
    assert spec.capacity_for_slo(spec.default_slo_ms) == pytest.approx(4.0)
    # Inside a segment, on the first segment, and past the last point (extrapolated slope 100 ms/load).
    assert spec.capacity_for_slo(300.0 + stall) == pytest.approx(3.0)
    assert spec.capacity_for_slo(150.0 + stall) == pytest.approx(1.0)
    assert spec.capacity_for_slo(600.0 + stall) == pytest.approx(6.0)
    assert spec.with_slo(600.0 + stall).capacity == pytest.approx(6.0)
    with pytest.raises(ValueError, match="empty GPU"):
        spec.capacity_for_slo(100.0 + stall - 1.0)


def test_autoscaler_search_refines_the_warm_pool_between_the_coarse_ones():
    from scheduling.core.gpu_profiles import BUILTIN_PROFILES
    from scheduling.sim.compare import autoscaler_for_slo, config_for_slo
    from scheduling.sim.simulator import SimConfig
    from scheduling.sim.traces import TraceEvent

    # Twenty sessions active one second in, for a minute: the ramp beats any 30 s boot, so the
    # warm pool at t = 0 decides the worst chunk. Coarse pools are 1, 4 (max/4) and 8 (max/2).
    events = [TraceEvent(0.0, f"s{i:02d}", "arrive") for i in range(20)]
    events += [TraceEvent(1.0, f"s{i:02d}", "active") for i in range(20)]
    events += [TraceEvent(60.0, f"s{i:02d}", "depart") for i in range(20)]
    spec = BUILTIN_PROFILES["h100-1.3b"]
    config = config_for_slo(
        SimConfig(profiles=[spec], initial_gpus=1, min_gpus=1, max_gpus=16, duration_s=60.0),
        spec.default_slo_ms,
    )
    label, best, tried = autoscaler_for_slo(
        events, "turboserve", config, "burst", spec.default_slo_ms, (0.9, 0.7)
    )
    pools = {row["config"].split("init=")[1] for row in tried}
    assert {"1", "4", "8"} <= pools
    assert "3" in pools  # 1 misses, 4 meets: the search tried the pool between them
    meeting = [row for row in tried if row["worst_chunk_latency_ms"] <= spec.default_slo_ms + 1e-9]
    assert meeting and best.gpu_cost_usd == min(row["gpu_cost_usd"] for row in meeting)
    assert best.worst_chunk_latency_ms <= spec.default_slo_ms + 1e-9
    assert label in {row["config"] for row in meeting}
