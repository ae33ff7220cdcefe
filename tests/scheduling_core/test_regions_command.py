"""simulate_regions / bench_regions_solve: thin wrappers printing one JSON object; bad flags name themselves."""

from __future__ import annotations

import io
import json

import pytest
from django.core.management import call_command
from django.core.management.base import CommandError

from scheduling.reproduce.torta import render_report, summarise
from scheduling.sim.regions.cli import RESULT_KEYS

SHORT = {"duration_s": 1800.0}


def _json(command, **kwargs):
    out = io.StringIO()
    call_command(command, json=True, stdout=out, **kwargs)
    return json.loads(out.getvalue())


@pytest.mark.parametrize("policy", ["torta", "skylb"])
def test_simulate_regions_json_has_the_documented_keys(policy):
    result = _json(
        "simulate_regions",
        topology="polska",
        policy=policy,
        seed=1,
        option=["forecast=last-value"] * (policy == "torta"),
        **SHORT,
    )
    assert set(RESULT_KEYS) <= set(result)
    assert result["policy"] == policy and result["topology"] == "polska" and result["regions"] == 12
    assert result["mean_response_ms"] > 0 and 0 < result["slo_pass_rate"] <= 1 and result["gpu_cost_usd"] > 0
    assert (result["macro_solve_ms_p99"] is None) == (policy != "torta")


def test_simulate_regions_replays_a_written_trace_and_a_topology_file(tmp_path):
    trace = tmp_path / "demand.jsonl"
    generated = _json(
        "simulate_regions", topology="abilene", policy="nearest", write_trace=str(trace), **SHORT
    )
    replayed = _json("simulate_regions", topology="abilene", policy="nearest", trace=str(trace))
    assert replayed["sessions"] == generated["sessions"] > 0
    assert replayed["mean_response_ms"] == pytest.approx(generated["mean_response_ms"])
    assert '"origin": "abilene-' in trace.read_text().splitlines()[1]

    from scheduling.sim.regions.topology import builtin_topology

    topology = tmp_path / "abilene.json"
    topology.write_text(json.dumps(builtin_topology("abilene").to_json()))
    from_file = _json("simulate_regions", topology=str(topology), policy="nearest", trace=str(trace))
    assert from_file["mean_response_ms"] == pytest.approx(generated["mean_response_ms"], rel=1e-6)


@pytest.mark.parametrize(
    ("kwargs", "flag"),
    [
        ({"topology": "mars"}, "--topology"),
        ({"topology": "polska", "policy": "random"}, "--policy"),
        ({"topology": "polska", "option": ["beta=0"]}, "--option"),
        ({"topology": "polska", "option": ["beta"]}, "--option"),
        ({"topology": "polska", "option": ["warp=9"]}, "--option"),
        ({"topology": "polska", "seed": -1}, "--seed"),
        ({"topology": "polska", "duration_s": 0.0}, "--duration-s"),
        ({"topology": "polska", "mean_utilisation": 1.5}, "--mean-utilisation"),
        ({"topology": "polska", "provisioning_delay_s": -1.0}, "--provisioning-delay-s"),
        ({"topology": "polska", "slot_s": 1.0}, "--slot-s"),
        ({"topology": "polska", "trace": "/nonexistent.jsonl"}, "--trace"),
    ],
)
def test_simulate_regions_bad_flags_name_themselves(kwargs, flag):
    with pytest.raises(CommandError, match=f"^{flag}"):
        call_command("simulate_regions", stdout=io.StringIO(), **kwargs)


def test_a_trace_with_an_unknown_origin_is_refused_naming_the_line(tmp_path):
    trace = tmp_path / "bad.jsonl"
    trace.write_text('{"t": 0, "session": "a", "event": "arrive", "origin": "atlantis"}\n')
    with pytest.raises(CommandError, match=r"--trace: .*line 1: 'origin' 'atlantis'"):
        call_command("simulate_regions", topology="polska", trace=str(trace), stdout=io.StringIO())


def test_bench_regions_solve_prints_solve_times():
    result = _json("bench_regions_solve", regions=8, repeats=5)
    assert result["regions"] == 8 and result["pools"] == 16 and result["method"] == "emd"
    assert 0 < result["solve_ms_p50"] <= result["solve_ms_p99"] <= result["solve_ms_max"]
    with pytest.raises(CommandError, match=r"^--regions"):
        call_command("bench_regions_solve", regions=1, stdout=io.StringIO())
    with pytest.raises(CommandError, match=r"^--method"):
        call_command("bench_regions_solve", method="lp", stdout=io.StringIO())


def test_the_report_compares_torta_with_the_best_baseline_and_never_with_its_variants():
    def run(policy, response, cost, slo, moves, variant=False):
        return {
            "topology": "t",
            "policy": policy,
            "mean_response_ms": response,
            "worst_chunk_latency_ms": 900.0,
            "slo_pass_rate": slo,
            "gpu_cost_usd": cost,
            "gpu_hours": 1.0,
            "cross_region_moves": moves,
            "mean_rtt_ms": 5.0,
            "remote_share": 0.1,
            "routing_churn": 0.2,
            "macro_solve_ms_p99": 0.5 if policy.startswith("torta") else None,
            **({"variant": True} if variant else {}),
        }

    report = {
        "seed": 0,
        "duration_s": 3600.0,
        "config": {"slot_s": 45.0, "provisioning_delay_s": 40.0},
        "machine": "test",
        "runs": [
            run("nearest", 700.0, 50.0, 0.9, 0),  # cheapest, but misses the SLO TORTA meets
            run("least-loaded", 620.0, 110.0, 1.0, 40),
            run("skylb", 605.0, 120.0, 1.0, 0),
            run("torta", 600.0, 99.0, 1.0, 4),
            run("torta, no floor", 500.0, 10.0, 1.0, 0, variant=True),
        ],
    }
    [row] = summarise(report)
    assert row["best_response_baseline"] == "skylb"
    assert row["response_reduction_pct"] == pytest.approx(100 * 5 / 605)
    assert row["best_cost_baseline"] == "least-loaded"
    assert row["cost_reduction_pct"] == pytest.approx(10.0)
    assert row["fewest_moves_baseline"] == "least-loaded" and row["moves_reduction_pct"] == pytest.approx(
        90.0
    )
    text = render_report(report)
    assert "| t | skylb → +0.8 % | least-loaded → +10.0 % | least-loaded → 90.0 % | 0.50 ms |" in text
    assert "(variant: torta, no floor)" in text
