"""``manage.py bench_decision_run``: the live decision run on synthetic rows, rolled back after."""

from __future__ import annotations

import io
import json

import pytest
from django.core.management import call_command
from django.core.management.base import CommandError

from gpu.models import GpuWorker
from scheduling.models import SchedulerDecision
from sessions.models import GenerationSession

pytestmark = pytest.mark.django_db(transaction=True)


def test_bench_decision_run_reports_runs_and_queries_and_leaves_no_rows():
    """Given an empty database, when the benchmark runs at 2 and 3 GPUs, then it reports each size's
    rows, p50/p99 and queries per run, and leaves no worker, session or decision behind."""
    out = io.StringIO()
    call_command("bench_decision_run", gpus="2,3", runs=2, json=True, stdout=out)
    report = json.loads(out.getvalue())
    assert [r["gpus"] for r in report["sizes"]] == [2, 3]
    for row in report["sizes"]:
        assert row["runs"] == 2 and row["sessions"] >= 2
        assert 0 < row["p50_ms"] <= row["p99_ms"] <= row["max_ms"]
        assert 0 < row["queries_min"] <= row["queries_max"]
    assert not GpuWorker.objects.exists()
    assert not GenerationSession.objects.exists()
    assert not SchedulerDecision.objects.exists()


def test_bench_decision_run_bad_flags_name_themselves():
    with pytest.raises(CommandError, match="--gpus"):
        call_command("bench_decision_run", gpus="2,x", stdout=io.StringIO())
    with pytest.raises(CommandError, match="--runs"):
        call_command("bench_decision_run", gpus="2", runs=0, stdout=io.StringIO())
