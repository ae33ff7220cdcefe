"""The simulator on the mix ``bench_coserve_live`` ran (``--simulate``; issue 32: the simulator and
the live benchmark agree on job completion within 20 %).

For one live run (N streams on one worker, then the job mix one job after another) the stream
simulator (``scheduling.sim``, its job side ``cosim``) replays the same mix on one GPU, from what
the live run measured:

- the streams: N sessions on the one GPU, paced at the preset's chunk period
  (``SimConfig.stream_period_ms``), one coalesced step per period taking ``u × period`` (u: the
  streams' busy share measured alone), so they use the device as much as they did live;
- each job: its own profile, one point, the step time it had live (``run_s / steps``), no decode
  (the live figure counts the decode and the MP4 outside ``run_s``: see ``overhead_s``);
- the rule: a job step runs in the gap between two stream steps when ``contracts.coserve`` says it
  fits, as the worker decides (``workers.daemon.worker``), with the worker's lead: its streams'
  chunks are made up to 1.25 periods before they play (one chunk of look-ahead, coalesced within a
  quarter) and must be done half a period before (``job_reserve_chunks``), so a step may end up to
  ``0.75 × period − generation`` after its paced start plus its generation
  (``SimConfig.stream_lead_ms``).

A job is submitted at ``phases`` evenly spread points of a chunk period (the live submit lands at a
random phase), each a run of its own; ``sim_device_s`` is the mean submit → last step, and
``unfinished`` counts phases where it never finished within ``horizon_s``.

Not modelled: the starvation guard (a starved job's step may take a quarter period more),
staggered stream phases (several smaller batches per period, so smaller gaps), the unmeasured first
step's probe, and every cost outside the device loop (command delivery, the decode and MP4 encode,
the report): ``overhead_s``, what a job took beyond its compute with no stream (the ``--streams 0``
run), is added to give ``sim_completion_s``.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from scheduling.core.gpu_profiles import load_profiles
from scheduling.core.jobs.job_profiles import JobCatalog, JobProfile, MeasuredPoint
from scheduling.core.jobs.solver import round_solver
from scheduling.core.policy import make_policy
from scheduling.sim.jobs.cosim import JobConfig
from scheduling.sim.simulator import SimConfig, Simulator
from scheduling.sim.traces import JobEvent, TraceEvent, merge_by_time

WARMUP_PERIODS = 4  # stream steps before a job is submitted: the pacing is settled
# The worker's defaults (``WorkerDaemon``): look-ahead 1 chunk plus the quarter chunk within which
# it coalesces, less the reserve job steps never take (0.5 chunk).
LOOKAHEAD_CHUNKS, COALESCE_CHUNKS, RESERVE_CHUNKS = 1.0, 0.25, 0.5


def _pool(streams: int, chunk_s: float, streams_busy: float, horizon_s: float) -> SimConfig:
    """One GPU whose streams' coalesced step takes what they used of each period live."""
    step_ms = max(1e-3, streams_busy * chunk_s * 1000.0)
    spec = replace(
        load_profiles("h100-1.3b")[0],
        name="live-worker",
        latency_points=((0.0, step_ms), (float(max(1, streams)), step_ms)),
        memory_limit_sessions=max(1, streams),
    )
    return SimConfig(
        profiles=[spec],
        initial_gpus=1,
        min_gpus=1,
        max_gpus=1,
        tick_s=0.0,
        duration_s=horizon_s,
        stream_period_ms=chunk_s * 1000.0,
        stream_lead_ms=max(
            0.0, (LOOKAHEAD_CHUNKS + COALESCE_CHUNKS - RESERVE_CHUNKS) * chunk_s * 1000.0 - step_ms
        ),
    )


def _job_config(job: dict[str, Any]) -> JobConfig:
    step_ms = 1000.0 * job["run_s"] / job["steps"]
    kind = job["job_kind"]
    profile = JobProfile(
        model=f"live-{kind}",
        kind=kind,
        gpu_type="live",
        token_patch=1,
        temporal_stride=1,
        default_steps=job["steps"],
        points=(MeasuredPoint(job["width"], job["height"], job["frames"], 1, 1, step_ms),),
    )
    return JobConfig(round_solver("genserve"), JobCatalog({profile.model: profile}, {kind: profile.model}))


def simulate_job(
    job: dict[str, Any],
    *,
    streams: int,
    chunk_s: float,
    streams_busy: float,
    phases: int = 8,
    horizon_s: float = 120.0,
) -> dict[str, Any]:
    """One measured job beside ``streams`` simulated streams: mean submit → done over ``phases``."""
    config = _pool(streams, chunk_s, streams_busy, horizon_s)
    sessions = []
    for i in range(streams):
        sessions += [TraceEvent(0.0, f"s{i}", "arrive"), TraceEvent(0.0, f"s{i}", "active")]
    done, unfinished = [], 0
    for phase in range(phases):
        submit = (WARMUP_PERIODS + phase / phases) * chunk_s
        event = JobEvent(
            submit,
            "job",
            "submit",
            job["job_kind"],
            None,
            job["width"],
            job["height"],
            job["frames"] if job["job_kind"] == "video" else None,
            job["steps"],
            horizon_s,
        )
        sim = Simulator(make_policy("base"), config, "coserve-live", _job_config(job))
        sim.run(merge_by_time(sessions, [event]))
        finished = sim.jobs.jobs["job"].done_at if sim.jobs is not None else None
        if finished is None:
            unfinished += 1
        else:
            done.append(finished - submit)
    return {
        "sim_device_s": round(sum(done) / len(done), 4) if done else None,
        "sim_device_s_max": round(max(done), 4) if done else None,
        "phases": phases,
        "unfinished": unfinished,
    }


def add_simulation(report: dict[str, Any], *, phases: int = 8) -> dict[str, Any]:
    """Each live job of ``report`` gains its simulated figures, ``overhead_s`` (from the run with no
    stream, if there was one: the same job's completion less its compute) and, with it,
    ``sim_completion_s`` and ``sim_ratio`` (simulated / live completion)."""
    alone = next((r for r in report["runs"] if r["streams"] == 0), None)
    for run in report["runs"]:
        for index, job in enumerate(run["jobs"]):
            if job["run_s"] is None:
                job["simulated"] = None
                continue
            simulated = simulate_job(
                job,
                streams=run["streams"],
                chunk_s=run["chunk_s"],
                streams_busy=run["alone"]["streams_busy"] if run["streams"] else 0.0,
                phases=phases,
            )
            overhead = None
            if alone is not None and index < len(alone["jobs"]) and alone["jobs"][index]["run_s"] is not None:
                base = alone["jobs"][index]
                overhead = round(max(0.0, base["completion_s"] - base["run_s"]), 4)
            device = simulated["sim_device_s"]
            completion = None if device is None or overhead is None else round(device + overhead, 4)
            simulated |= {
                "overhead_s": overhead,
                "sim_completion_s": completion,
                "sim_ratio": None if completion is None else round(completion / job["completion_s"], 3),
                "device_ratio": None if device is None else round(device / job["completion_s"], 3),
            }
            job["simulated"] = simulated
    report["args"]["simulate_phases"] = phases
    return report
