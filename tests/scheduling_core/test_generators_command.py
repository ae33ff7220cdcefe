"""gen_trace: thin wrapper over the generators; bad flags name themselves."""

from __future__ import annotations

import io

import pytest
from django.core.management import call_command
from django.core.management.base import CommandError

from scheduling.sim.generators import paper_trace, segment_family
from scheduling.sim.traces import read_trace


def test_gen_trace_writes_the_generator_output(tmp_path):
    out = tmp_path / "t.jsonl"
    call_command("gen_trace", shape="table11", seed=4, out=str(out), stderr=io.StringIO())
    assert read_trace(out) == paper_trace("table11", seed=4)


def test_gen_trace_segment_and_stats(tmp_path):
    out = tmp_path / "s.jsonl"
    stdout = io.StringIO()
    call_command(
        "gen_trace",
        shape="segment",
        level=3,
        seed=1,
        out=str(out),
        stats=True,
        stdout=stdout,
        stderr=io.StringIO(),
    )
    assert read_trace(out) == segment_family(3, 1)
    assert '"volatility"' in stdout.getvalue()


def test_gen_trace_poisson_with_load_mix(tmp_path):
    out = tmp_path / "p.jsonl"
    call_command(
        "gen_trace",
        shape="poisson",
        rate_per_min=20.0,
        duration_s=120.0,
        load_mix="1:1,2:1",
        out=str(out),
        stderr=io.StringIO(),
    )
    _, events = read_trace(out)
    assert {e.load for e in events if e.event == "arrive"} <= {1.0, 2.0}


@pytest.mark.parametrize(
    ("kwargs", "flag"),
    [
        ({"shape": "T7"}, "--shape"),
        ({"shape": "poisson"}, "--rate-per-min"),
        ({"shape": "T1", "rate_per_min": 3.0}, "--rate-per-min"),
        ({"shape": "poisson", "rate_per_min": -1.0}, "--rate-per-min"),
        ({"shape": "segment"}, "--level"),
        ({"shape": "segment", "level": 11}, "--level"),
        ({"shape": "T1", "level": 2}, "--level"),
        ({"shape": "T1", "load_mix": "1.0"}, "--load-mix"),
        ({"shape": "T1", "load_mix": "0:1"}, "--load-mix"),
        ({"shape": "T1", "seed": -1}, "--seed"),
    ],
)
def test_gen_trace_bad_flags(tmp_path, kwargs, flag):
    with pytest.raises(CommandError, match=flag):
        call_command("gen_trace", out=str(tmp_path / "x.jsonl"), **kwargs)
