"""workers.benchmarks.jobs and its commands give well-formed figures and name bad flags (no timing asserted)."""

from __future__ import annotations

import json

import pytest
from django.core.management import CommandError, call_command

from workers.benchmarks import jobs


def test_jobs_bench_reports_pause_resume_and_every_batch_size():
    shapes = [("image", 32, 32, 1), ("video", 32, 16, 4)]
    report = jobs.run_jobs_bench("tiny", shapes=shapes, batches=(1, 2), repeats=1)
    assert [row["shape"] for row in report["pause_resume"]] == [list(s) for s in shapes]
    for row in report["pause_resume"]:
        assert row["state_bytes"] > 0 and row["pause_ms"]["count"] == 1 and row["resume_pct_of_step"] > 0
    assert [(r["shape"][0], r["batch"]) for r in report["step_s"]] == [
        ("image", 1), ("image", 2), ("video", 1), ("video", 2)
    ]  # fmt: skip
    assert "pause p50" in jobs.format_jobs_bench(report)


def test_one_shot_profile_has_the_simulator_shape(tmp_path):
    out = tmp_path / "profile.json"
    call_command(
        "profile_model", "--one-shot", "video", "--resolutions", "32x32", "--frames", "4",
        "--batches", "1,2", "--steps", "1", "--out", str(out),
    )  # fmt: skip
    profile = json.loads(out.read_text())
    assert profile["model"] == "tiny" and profile["kind"] == "video" and isinstance(profile["machine"], str)
    assert [(p["width"], p["height"], p["frames"], p["batch"]) for p in profile["points"]] == [
        (32, 32, 4, 1), (32, 32, 4, 2)
    ]  # fmt: skip
    assert all(p["step_s"] > 0 for p in profile["points"])


@pytest.mark.parametrize(
    ("argv", "flag"),
    [
        (["bench_jobs_runtime", "--image", "64by64"], "--image"),
        (["bench_jobs_runtime", "--batches", "0"], "--batches"),
        (["profile_model", "--one-shot", "image", "--resolutions", "33x32", "--out", "/dev/null"], "width"),
    ],
)
def test_bad_flags_are_refused_naming_them(argv, flag):
    with pytest.raises(CommandError, match=flag):
        call_command(*argv)
