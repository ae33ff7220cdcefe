"""simulate / simulate_compare / bench_scheduler / profile_volatility: thin wrappers; bad flags name themselves."""

from __future__ import annotations

import io
import json

import pytest
from django.core.management import call_command
from django.core.management.base import CommandError

from scheduling.sim.cli import REQUIRED_RESULT_KEYS
from scheduling.sim.traces import TraceEvent, write_trace


@pytest.fixture
def tiny_trace(tmp_path):
    events = [TraceEvent(0.0, f"s{i}", "arrive") for i in range(6)]
    events += [TraceEvent(1.0 + i, f"s{i}", "active") for i in range(6)]
    events += [TraceEvent(12.0, f"s{i}", "idle") for i in range(0, 6, 2)]
    events += [TraceEvent(20.0, f"s{i}", "depart") for i in range(6)]
    path = tmp_path / "tiny.jsonl"
    write_trace(path, events, meta={"name": "tiny", "duration_s": 20.0})
    return path


def test_simulate_json_prints_exactly_one_object_with_the_documented_keys(tiny_trace, tmp_path):
    out = io.StringIO()
    plot = tmp_path / "t.png"
    call_command(
        "simulate",
        trace=str(tiny_trace),
        policy="turboserve",
        profile="h100-1.3b",
        max_gpus=4,
        json=True,
        plot=str(plot),
        stdout=out,
    )
    result = json.loads(out.getvalue())
    assert set(REQUIRED_RESULT_KEYS) <= set(result)
    assert result["trace"] == "tiny" and result["chunks"] > 0
    assert plot.stat().st_size > 0


def test_simulate_bad_flags_name_themselves(tiny_trace):
    with pytest.raises(CommandError, match="--policy"):
        call_command("simulate", trace=str(tiny_trace), policy="no-such-policy", stdout=io.StringIO())
    with pytest.raises(CommandError, match="--profile"):
        call_command("simulate", trace=str(tiny_trace), profile="nope", stdout=io.StringIO())
    with pytest.raises(CommandError, match="--trace"):
        call_command("simulate", trace="/no/such/file.jsonl", stdout=io.StringIO())
    with pytest.raises(CommandError, match="--max-gpus"):
        call_command("simulate", trace=str(tiny_trace), max_gpus=0, stdout=io.StringIO())


def test_provisioning_delay_flag_replaces_the_boot_time(tmp_path):
    # Twelve sessions become active on one warm GPU (K = 8 on h100-1.3b): the scale-out's GPU must boot.
    events = [TraceEvent(0.0, f"s{i}", "arrive") for i in range(12)]
    events += [TraceEvent(1.0, f"s{i}", "active") for i in range(12)]
    events += [TraceEvent(60.0, f"s{i}", "depart") for i in range(12)]
    trace = tmp_path / "burst.jsonl"
    write_trace(trace, events, meta={"name": "burst", "duration_s": 60.0})

    def run(**kwargs) -> dict:
        out = io.StringIO()
        call_command(
            "simulate",
            trace=str(trace),
            policy="turboserve",
            profile="h100-1.3b",
            max_gpus=4,
            initial_gpus=1,
            json=True,
            stdout=out,
            **kwargs,
        )
        return json.loads(out.getvalue())

    booted, instant = run(), run(provisioning_delay_s=0.0)
    assert booted["provisioning_delay_s"] == {"h100-1.3b": 30.0}
    assert instant["provisioning_delay_s"] == {"h100-1.3b": 0.0}
    # With a 30 s boot all twelve share the warm GPU until the new one is ready; with instant attach
    # they are spread at once, so the worst chunk is lower.
    assert instant["worst_chunk_latency_ms"] < booted["worst_chunk_latency_ms"]
    for bad in (-1.0, float("nan")):
        with pytest.raises(CommandError, match="--provisioning-delay-s"):
            call_command("simulate", trace=str(trace), provisioning_delay_s=bad, stdout=io.StringIO())
        with pytest.raises(CommandError, match="--provisioning-delay-s"):
            call_command("simulate_compare", trace=str(trace), provisioning_delay_s=bad, stdout=io.StringIO())


def compare_json(trace, **kwargs) -> dict:
    """``simulate_compare --json`` of turboserve vs lag on ``trace`` (h100-1.3b, 4 GPUs)."""
    out = io.StringIO()
    call_command(
        "simulate_compare",
        trace=str(trace),
        profile="h100-1.3b",
        max_gpus=4,
        policies="turboserve,lag",
        json=True,
        stdout=out,
        **kwargs,
    )
    return json.loads(out.getvalue())


def test_simulate_compare_json_shape(tiny_trace):
    data = compare_json(tiny_trace)
    assert set(data) >= {"trace", "slo_ms", "policies", "reduction_vs"}
    assert set(data["policies"]) == {"turboserve", "lag"}
    for entry in data["policies"].values():
        assert "cost_at_slo_usd" in entry and "worst_latency_at_matched_cost_ms" in entry
    assert set(data["reduction_vs"]["lag"]) == {"latency_pct", "cost_pct"}
    # lag meets the loose default SLO with its cheapest budget: that budget is in [1, max].
    assert 1 <= data["policies"]["lag"]["budget_at_slo"] <= 4


def test_simulate_compare_derives_k_from_the_slo_unless_told_otherwise(tiny_trace):
    from scheduling.core.gpu_profiles import load_profile

    spec = load_profile("h100-1.3b")

    def compare(**kwargs):
        return compare_json(tiny_trace, **kwargs)

    # The default SLO is the one the profile's own K meets: K is unchanged.
    default = compare()
    assert default["capacity_mode"] == "slo"
    assert default["capacity"]["h100-1.3b"] == pytest.approx(spec.capacity, abs=1e-3)
    # A looser SLO raises K to the load that still meets it; "profile" keeps the profile's K.
    loose = compare(slo_ms=spec.default_slo_ms + 2 * 55.0)
    assert loose["capacity"]["h100-1.3b"] == pytest.approx(spec.capacity + 2, abs=1e-3)
    kept = compare(slo_ms=spec.default_slo_ms + 2 * 55.0, capacity="profile")
    assert kept["capacity"]["h100-1.3b"] == pytest.approx(spec.capacity)
    # An SLO no GPU can meet names the flag.
    with pytest.raises(CommandError, match=r"--slo-ms.*empty GPU"):
        compare(slo_ms=100.0)


def test_bench_scheduler_json_and_bad_sizes():
    out = io.StringIO()
    call_command("bench_scheduler", gpus="2,4", events=50, json=True, stdout=out)
    report = json.loads(out.getvalue())
    assert [r["gpus"] for r in report["sizes"]] == [2, 4]
    assert all(r["decisions"] >= 50 for r in report["sizes"])
    with pytest.raises(CommandError, match="--gpus"):
        call_command("bench_scheduler", gpus="4,x", stdout=io.StringIO())


def test_profile_volatility_writes_a_loadable_table(tmp_path, tiny_trace):
    from scheduling.core.detector import load_volatility_table

    out = tmp_path / "table.json"
    call_command(
        "profile_volatility",
        trace=[str(tiny_trace)],
        segment_s=10.0,
        profile="h100-1.3b",
        out=str(out),
        json=True,
        stdout=io.StringIO(),
    )
    table = load_volatility_table(out)
    assert len(table.levels) == 2  # two 10 s segments of a 20 s trace
    rhos = [lv.rho_hat for lv in table.levels]
    assert rhos == sorted(rhos, reverse=True)


def test_simulate_compare_accepts_a_dotted_path_policy(tiny_trace):
    out = io.StringIO()
    call_command(
        "simulate_compare",
        trace=str(tiny_trace),
        profile="h100-1.3b",
        max_gpus=3,
        policies="turboserve,tests.scheduling_core.test_scheduling_commands:FixedLeastLoaded",
        json=True,
        stdout=out,
    )
    data = json.loads(out.getvalue())
    custom = data["policies"]["tests.scheduling_core.test_scheduling_commands:FixedLeastLoaded"]
    assert custom["static"] is True and 1 <= custom["budget_at_slo"] <= 3


from scheduling.core.baselines import LeastLoadedPolicy  # noqa: E402


class FixedLeastLoaded(LeastLoadedPolicy):
    """A 'custom' policy loaded by dotted path; inherits static = True."""

    name = "fixed-least-loaded"


def test_bench_scaleplan_json_and_bad_flags():
    out = io.StringIO()
    call_command("bench_scaleplan", gpus="8,64", repeats=3, warmup=0, json=True, stdout=out)
    report = json.loads(out.getvalue())
    assert [r["gpus"] for r in report["sizes"]] == [8, 64]
    row = report["sizes"][1]
    # Every GPU that does not serve is a target, and the plan covers them.
    assert row["sources"] - 1 + row["targets"] == 64 and row["chains"] >= 1
    assert row["decision_ms"]["count"] == 3 and "machine" in report
    with pytest.raises(CommandError, match="--gpus"):
        call_command("bench_scaleplan", gpus="1", stdout=io.StringIO())
    with pytest.raises(CommandError, match="--weights-gb"):
        call_command("bench_scaleplan", weights_gb=0.0, stdout=io.StringIO())


def test_bench_scheduler_warm_state_is_built_without_decisions():
    """Given the benchmark's warm-up trace, when the warm state is built directly, then no decision
    ran, every warm-up arrival is a session, every activation is executing, and the pool is balanced
    (loads differ by at most one session's load) within every GPU's memory limit."""
    from scheduling.benchmarks.scheduler import synthetic_events, warm_state
    from scheduling.core.gpu_profiles import BUILTIN_PROFILES
    from scheduling.core.policy import make_policy
    from scheduling.sim.simulator import SimConfig, Simulator

    spec = BUILTIN_PROFILES["b300-1.3b"]
    warmup, _ = synthetic_events(37, spec.capacity, 10, seed=3)
    sim = Simulator(
        make_policy("turboserve"),
        SimConfig(profiles=[spec], initial_gpus=37, min_gpus=37, max_gpus=37, tick_s=0.0),
    )
    warm_state(sim, spec, 37, warmup)
    assert sim.sched_ms == []
    arrivals = {e.session for e in warmup if e.event == "arrive"}
    actives = {e.session for e in warmup if e.event == "active"}
    assert set(sim.sessions) == arrivals
    assert {s.id for s in sim.sessions.values() if s.state == "executing"} == actives
    assert sim.n_active == len(actives)
    loads = [g.load for g in sim.gpus.values()]
    assert len(loads) == 37 and max(loads) - min(loads) <= 1.0
    assert all(len(g.members) <= spec.memory_limit_sessions for g in sim.gpus.values())
    snapshot = sim.snapshot()
    assert snapshot.pending == () and snapshot.idle_resident == ()
