"""simulate_regions / bench_regions_solve: thin wrappers printing one JSON object; bad flags name themselves."""

from __future__ import annotations

import io
import json

import pytest
from django.core.management import call_command
from django.core.management.base import CommandError

from scheduling.core.regions.cli import RESULT_KEYS

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

    from scheduling.core.regions.topology import builtin_topology

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
