"""oracle_gap: JSON output, pluggable heuristic, bad flags name themselves."""

from __future__ import annotations

import io
import json

import pytest
from django.core.management import call_command
from django.core.management.base import CommandError


def _run(**kwargs):
    stdout = io.StringIO()
    call_command("oracle_gap", stdout=stdout, stderr=io.StringIO(), **kwargs)
    return stdout.getvalue()


def test_oracle_gap_json_is_one_object():
    report = json.loads(_run(gpus="3", instances=2, json=True))
    assert report["heuristic"].endswith(":turboserve_heuristic")
    assert report["overall"]["instances"] == 2
    assert report["overall"]["mean_gap_pct"] >= 0.0
    assert "rows" not in report


def test_oracle_gap_with_a_dotted_heuristic():
    report = json.loads(
        _run(
            gpus="3",
            instances=1,
            json=True,
            rows=True,
            heuristic="tests.scheduling_core.test_oracle_gap_command:stay_put",
        )
    )
    assert report["heuristic"].endswith(":stay_put")
    assert len(report["rows"]) == 1


def stay_put(sessions, gpus, kappa):
    """Keep placed sessions where they are; put new ones on the emptiest GPU by count."""
    count = {g.id: 0 for g in gpus}
    for s in sessions:
        if s.gpu:
            count[s.gpu] += 1
    placement = {}
    for s in sessions:
        if s.gpu:
            placement[s.id] = s.gpu
        else:
            g = min(gpus, key=lambda g: (count[g.id] - g.spec.memory_limit_sessions, g.id))
            placement[s.id] = g.id
            count[g.id] += 1
    return placement


def test_oracle_gap_table_output():
    text = _run(gpus="3", instances=1)
    assert "mean gap %" in text and "paper" in text


@pytest.mark.parametrize(
    ("kwargs", "flag"),
    [
        ({"gpus": "4,x"}, "--gpus"),
        ({"gpus": "0"}, "--gpus"),
        ({"instances": 0}, "--instances"),
        ({"eta": -1.0}, "--eta"),
        ({"time_limit": 0.0}, "--time-limit"),
        ({"heuristic": "nope"}, "--heuristic"),
        ({"heuristic": "scheduling.sim.oracles.gap:missing"}, "--heuristic"),
        ({"heuristic": "no_such_module_xyz:f"}, "--heuristic"),
    ],
)
def test_oracle_gap_bad_flags(kwargs, flag):
    with pytest.raises(CommandError, match=flag):
        _run(**kwargs)
