"""``bench_coserve_live --simulate``: the simulator replays a live run's mix from its measurements
(workers/benchmarks/coserve_sim.py). No worker process: a report as the live benchmark writes it."""

from __future__ import annotations

import pytest

from workers.benchmarks.coserve import format_coserve_bench
from workers.benchmarks.coserve_sim import add_simulation, simulate_job

VIDEO = {"job_kind": "video", "width": 128, "height": 128, "frames": 16, "steps": 4}


def _run(streams: int, busy: float, **job: float) -> dict:
    return {
        "streams": streams,
        "chunk_s": 0.5,
        "alone": {
            "streams_busy": busy,
            "late_ms": {"p50": 0.0, "p99": 0.0},
            "lead_ms": {"p50": 1.0, "min": 1.0},
        },
        "beside": {"late_ms": {"p50": 0.0, "p99": 0.0}, "lead_ms": {"p50": 1.0, "min": 1.0}, "busy": 0.5},
        "jobs": [VIDEO | job],
    }


def test_with_no_stream_the_simulated_job_takes_its_compute_and_the_overhead_comes_from_that_run():
    # Given a live report: the video alone (0.2 s of compute, done in 0.3 s), then beside four
    # streams using 0.2 of the device (0.2 s of compute, done in 0.5 s)
    report = {
        "args": {"preset": "demo"},
        "runs": [_run(0, 0.0, run_s=0.2, completion_s=0.3), _run(4, 0.2, run_s=0.2, completion_s=0.5)],
    }
    # When the simulator replays it
    add_simulation(report, phases=4)
    alone, beside = (run["jobs"][0]["simulated"] for run in report["runs"])
    # Then alone the device time is the compute, and 0.1 s is what the live job took beyond it
    assert alone["sim_device_s"] == pytest.approx(0.2)
    assert beside["overhead_s"] == pytest.approx(0.1)
    # And beside the streams each 50 ms step waits for gaps of 0.4 s: slower than alone, within a period
    assert 0.2 < beside["sim_device_s"] <= 0.2 + 0.5
    assert beside["sim_completion_s"] == pytest.approx(beside["sim_device_s"] + 0.1)
    assert beside["sim_ratio"] == pytest.approx(beside["sim_completion_s"] / 0.5, abs=1e-3)
    assert "simulated" in format_coserve_bench(report | {"machine": {"cpu": "test"}})


def test_a_step_longer_than_every_gap_never_finishes_in_the_simulator_either():
    # Given one stream using 0.7 of a 0.5 s period (gaps of 0.15 s, a lead of 0.75 × 0.5 − 0.35 =
    # 0.025 s) and a video whose steps take 0.25 s
    simulated = simulate_job(
        VIDEO | {"run_s": 1.0}, streams=1, chunk_s=0.5, streams_busy=0.7, phases=3, horizon_s=10.0
    )
    # Then no phase finishes: the rule never lets such a step start
    assert simulated["sim_device_s"] is None and simulated["unfinished"] == 3
