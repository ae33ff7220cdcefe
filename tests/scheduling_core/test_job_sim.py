"""One-shot jobs in the simulator (issue 14): streams first, policies, the simulate/gen_trace commands."""

from __future__ import annotations

import io
import json
from dataclasses import replace

import pytest
from django.core.management import call_command

from scheduling.core.gpu_profiles import BUILTIN_PROFILES, load_profiles
from scheduling.core.jobs.job_profiles import BUILTIN_JOB_PROFILES
from scheduling.core.policy import make_policy
from scheduling.core.types import GB, Event, GpuView, SessionView, Snapshot
from scheduling.sim.jobs.cosim import job_config
from scheduling.sim.jobs.workload import genserve_jobs
from scheduling.sim.simulator import SimConfig, simulate
from scheduling.sim.traces import (
    JobEvent,
    TraceError,
    TraceEvent,
    read_mixed_trace,
    read_trace,
    write_mixed_trace,
)

JOB_KEYS = {
    "submitted",
    "completed",
    "slo_attainment",
    "image_slo_attainment",
    "video_slo_attainment",
    "image_wait_p50_s",
    "latency_p99_s",
}


def _fixed_pool(gpus: int, duration_s: float) -> SimConfig:
    return SimConfig(
        profiles=load_profiles("h100-1.3b"),
        initial_gpus=gpus,
        min_gpus=gpus,
        max_gpus=gpus,
        duration_s=duration_s,
    )


def _video(t: float, job: str, slo_s: float, side: int = 768) -> JobEvent:
    return JobEvent(t, job, "submit", "video", None, side, side, 81, 50, slo_s)


def _image(t: float, job: str, slo_s: float, side: int = 768) -> JobEvent:
    return JobEvent(t, job, "submit", "image", None, side, side, None, 28, slo_s)


@pytest.mark.parametrize("abandon", [True, False])
def test_a_session_placed_on_a_jobs_gpu_waits_for_the_next_block_boundary_or_the_step_end(abandon):
    # One GPU: a 768² video starts at t=0 (SP 1 steps of 781.57 ms, 30 blocks); a session becomes
    # active at t=0.5 and takes the GPU (streams first).
    sessions = [TraceEvent(0.5, "s1", "arrive"), TraceEvent(0.5, "s1", "active")]
    config = _fixed_pool(1, 30.0)
    result = simulate(
        sessions,
        make_policy("base"),
        config,
        job_events=[_video(0.0, "v", 100.0)],
        jobs=job_config("genserve", abandon_steps=abandon),
    )
    step_ms = config.profiles[0].latency_ms(1.0)
    if abandon:
        # The step is abandoned at its next block boundary: its first chunk waits one block, and
        # the step's work up to that boundary is lost.
        block_ms = 781.57 / BUILTIN_JOB_PROFILES["wan2.2-5b"].blocks
        assert result.worst_chunk_latency_ms == pytest.approx(step_ms + block_ms, abs=0.01)
        assert result.jobs["abandoned_steps"] == 1
        assert result.jobs["abandoned_gpu_s"] == pytest.approx(0.5 + block_ms / 1000.0, abs=1e-3)
    else:
        # Its first chunk waits for the step's end; the job keeps the step.
        assert result.worst_chunk_latency_ms == pytest.approx(step_ms + 781.57 - 500.0, abs=0.01)
        assert result.jobs["abandoned_steps"] == 0
    # Either way the video lost its GPU to the stream and never got it back.
    assert result.jobs["completed"] == 0 and result.jobs["unfinished"] == 1
    alone = simulate(sessions, make_policy("base"), config)
    assert alone.worst_chunk_latency_ms == pytest.approx(step_ms)


def test_an_idle_pool_meets_every_slo_and_sp_speeds_a_lone_video():
    jobs = [_video(0.0, "v", 60.0)]
    results = {
        name: simulate(
            [], make_policy("base"), _fixed_pool(8, 60.0), job_events=jobs, jobs=job_config(name)
        ).jobs
        for name in ("genserve", "genserve-no-sp")
    }
    for figures in results.values():
        assert figures["completed"] == 1 and figures["slo_attainment"] == 1.0
    wan = BUILTIN_JOB_PROFILES["wan2.2-5b"]
    alone_sp1 = 50 * 0.78157 + wan.decode_ms(768, 768, 81, 50) / 1000.0
    # GenServe runs the lone video at SP 8 (×7.0 on its steps; the decode stays on one GPU).
    sp8 = 50 * 0.111653 + wan.decode_ms(768, 768, 81, 50) / 1000.0
    assert results["genserve"]["latency_p99_s"] == pytest.approx(sp8, rel=1e-3)
    assert results["genserve-no-sp"]["latency_p99_s"] == pytest.approx(alone_sp1, rel=1e-3)


def test_policies_produce_different_outcomes_under_contention():
    meta, jobs = genserve_jobs(rate_per_min=60, duration_s=120, sigma=1.0, seed=3)
    figures = {
        name: simulate(
            [],
            make_policy("base"),
            _fixed_pool(4, meta["duration_s"]),
            job_events=jobs,
            jobs=job_config(name),
        ).jobs
        for name in ("fcfs", "genserve")
    }
    assert figures["fcfs"]["submitted"] == figures["genserve"]["submitted"] == len(jobs)
    assert figures["genserve"]["image_slo_attainment"] > figures["fcfs"]["image_slo_attainment"]
    assert figures["genserve"]["image_wait_p50_s"] < figures["fcfs"]["image_wait_p50_s"]


def test_simulate_json_gains_jobs_only_when_the_trace_has_jobs(tmp_path):
    sessions = [
        TraceEvent(0.0, "s1", "arrive"),
        TraceEvent(1.0, "s1", "active"),
        TraceEvent(9.0, "s1", "depart"),
    ]
    mixed, plain = tmp_path / "mixed.jsonl", tmp_path / "plain.jsonl"
    write_mixed_trace(mixed, sessions, [_image(2.0, "i1", 5.0)], meta={"name": "m", "duration_s": 10.0})
    write_mixed_trace(plain, sessions, [], meta={"name": "p", "duration_s": 10.0})
    outputs = {}
    for path in (mixed, plain):
        out = io.StringIO()
        call_command(
            "simulate", trace=str(path), policy="turboserve", job_policy="edf", json=True, stdout=out
        )
        outputs[path.stem] = json.loads(out.getvalue())
    assert set(outputs["mixed"]["jobs"]) >= JOB_KEYS
    assert outputs["mixed"]["jobs"]["submitted"] == 1 and outputs["mixed"]["jobs"]["policy"] == "edf"
    assert "jobs" not in outputs["plain"]
    with pytest.raises(Exception, match="--job-policy"):
        call_command("simulate", trace=str(mixed), job_policy="sjf", stdout=io.StringIO())


def test_gen_trace_writes_a_genserve_mix_that_only_the_mixed_reader_takes(tmp_path):
    path = tmp_path / "g.jsonl"
    call_command(
        "gen_trace",
        shape="genserve",
        job_duration_s=60.0,
        job_sigma=1.5,
        seed=1,
        out=str(path),
        stderr=io.StringIO(),
    )
    meta, sessions, jobs = read_mixed_trace(path)
    assert sessions == [] and jobs and meta["sigma"] == 1.5
    assert {j.kind for j in jobs} == {"image", "video"}
    with pytest.raises(TraceError, match="mixed"):
        read_trace(path)


def _three_empty_gpus(job_gpus: tuple[str, ...], demand: float) -> Snapshot:
    spec = BUILTIN_PROFILES["h100-1.3b"]
    snapshot = Snapshot.build(
        time=10.0,
        sessions=[SessionView("s1", 1, "suspended", 1.0, None, GB)],
        gpus=[GpuView(g, spec.name, "ready") for g in ("g1", "g2", "g3")],
        gpu_types={spec.name: spec},
        min_gpus=3,
        max_gpus=3,
    )
    return replace(snapshot, job_gpus=job_gpus, job_demand_gpus=demand)


def test_turboserve_keeps_jobs_gpus_out_of_stream_placement_unless_nothing_else_fits():
    policy = make_policy("turboserve")
    # g1 runs a job and the backlog wants one more GPU (g2): the session goes to g3.
    decision = policy.decide(_three_empty_gpus(("g1",), 1.5), Event(10.0, "active", session="s1"))
    assert decision.assign == (("s1", "g3"),)
    # Every GPU runs a job: streams first, the session still gets one.
    decision = make_policy("turboserve").decide(
        _three_empty_gpus(("g1", "g2", "g3"), 3.0), Event(10.0, "active", session="s1")
    )
    assert len(decision.assign) == 1 and decision.queue == ()


def test_reproduce_genserve_writes_the_report_json_and_figure(tmp_path):
    call_command(
        "reproduce_genserve",
        rates="30",
        sigmas="1",
        seeds="0",
        window_s=40.0,
        session_rate_per_min=4.0,
        out_dir=str(tmp_path),
        stdout=io.StringIO(),
        stderr=io.StringIO(),
    )
    data = json.loads((tmp_path / "genserve.json").read_text())
    assert {r["policy"] for r in data["ladder"]} >= {"fcfs", "fcfs-preempt", "genserve-no-sp", "genserve"}
    assert data["streams"][0]["dedicated_gpus"] >= 1
    report = (tmp_path / "genserve.md").read_text()
    assert "Ablation ladder" in report and "target ≥ 3×" in report
    assert (tmp_path / "genserve.png").stat().st_size > 0
    with pytest.raises(Exception, match="--sigmas"):
        call_command("reproduce_genserve", sigmas="-1", out_dir=str(tmp_path), stdout=io.StringIO())


def test_turboserve_gives_a_jobs_gpu_back_when_a_stream_gpu_is_above_k():
    spec = BUILTIN_PROFILES["h100-1.3b"]  # K = 8
    sessions = [SessionView(f"s{i}", 1, "executing", 1.0, "g1", GB, since=0.0) for i in range(10)]
    snapshot = Snapshot.build(
        time=10.0,
        sessions=sessions,
        gpus=[GpuView(g, spec.name, "ready") for g in ("g1", "g2")],
        gpu_types={spec.name: spec},
        min_gpus=2,
        max_gpus=2,
    )
    kept = make_policy("turboserve").decide(
        replace(snapshot, job_gpus=("g2",), job_demand_gpus=1.0), Event(10.0, "tick")
    )
    assert {m.dst for m in kept.migrations} == {"g2"}
