"""Round-decision timing (``manage.py bench_jobs_round``): GenServe's solver on random rounds.

Each round has ``gpus`` GPUs, G video groups (random shape 256²/480²/768² × 81 frames, 1–50 steps
left, a deadline 0.5–3× its remaining SP-1 time away, some running at SP 1/2/4 within the GPUs) and
0–16 waiting images (random shape, deadline 0.5–3× their one-GPU latency away), all costed by the
built-in profiles through the same request builders the simulator uses. Only ``policy.plan`` is
timed, after a warm-up, in wall time (``perf_counter``) and in CPU time (``process_time``: on a shared
machine wall time includes preemption by other processes); the slides' Table 6 reports ≤ 1.9 ms
at 9–12 groups on 8 GPUs.
"""

from __future__ import annotations

import platform
import time
from typing import Any

import numpy as np

from scheduling.core.jobs.job_profiles import load_job_catalog
from scheduling.core.jobs.solver import RoundInput, round_solver
from scheduling.sim.jobs.cosim import _Job, image_request, video_request
from scheduling.sim.traces import JobEvent

_SIDES = (256, 480, 768)


def _round(rng: np.random.Generator, groups: int, gpus: int, max_batch: int) -> RoundInput:
    catalog = load_job_catalog()
    now = 100.0
    videos = []
    used = 0
    for g in range(groups):
        side = int(rng.choice(_SIDES))
        event = JobEvent(now, f"v{g}", "submit", "video", None, side, side, 81, 50, 1.0)
        job = _Job(event, catalog.profile("video", None), max_batch)
        job.remaining = int(rng.integers(1, 51))
        job.deadline = now + float(rng.uniform(0.5, 3.0)) * job.remaining_s(1)
        degree = int(rng.choice((0, 0, 1, 2, 4)))
        if used + degree > gpus:
            degree = 0
        used += degree
        videos.append(video_request(job, degree, gpus))
    images = []
    for i in range(int(rng.integers(0, 17))):
        side = int(rng.choice(_SIDES))
        event = JobEvent(now, f"i{i}", "submit", "image", None, side, side, None, 28, 1.0)
        job = _Job(event, catalog.profile("image", None), max_batch)
        job.deadline = now + float(rng.uniform(0.5, 3.0)) * job.remaining_s(1)
        images.append(image_request(job, max_batch))
    return RoundInput(now=now, gpus=gpus, round_s=2.0, images=tuple(images), videos=tuple(videos))


def bench_round(
    *,
    groups: tuple[int, ...] = tuple(range(1, 13)),
    gpus: int = 8,
    repeats: int = 300,
    policy: str = "genserve",
    seed: int = 0,
) -> dict[str, Any]:
    if not groups or min(groups) < 1 or gpus < 1 or repeats < 1:
        raise ValueError("groups, gpus and repeats must be >= 1")
    solver = round_solver(policy)
    rng = np.random.default_rng(seed)
    rows = []
    for g in groups:
        rounds = [_round(rng, g, gpus, solver.max_batch) for _ in range(repeats)]
        for inp in rounds[: min(20, repeats)]:
            solver.plan(inp)  # warm-up
        wall, cpu = [], []
        for inp in rounds:
            c0, t0 = time.process_time(), time.perf_counter()
            solver.plan(inp)
            wall.append((time.perf_counter() - t0) * 1000.0)
            cpu.append((time.process_time() - c0) * 1000.0)
        ms, cpu_ms = np.asarray(wall), np.asarray(cpu)
        rows.append(
            {
                "groups": g,
                "rounds": repeats,
                "ms_mean": round(float(ms.mean()), 4),
                "ms_p50": round(float(np.percentile(ms, 50)), 4),
                "ms_p99": round(float(np.percentile(ms, 99)), 4),
                "ms_max": round(float(ms.max()), 4),
                "cpu_ms_p50": round(float(np.percentile(cpu_ms, 50)), 4),
                "cpu_ms_p99": round(float(np.percentile(cpu_ms, 99)), 4),
            }
        )
    return {
        "policy": policy,
        "gpus": gpus,
        "seed": seed,
        "target_ms": 2.0,
        "rows": rows,
        "p99_ms_worst": max(r["ms_p99"] for r in rows),
        "cpu_p99_ms_worst": max(r["cpu_ms_p99"] for r in rows),
        "machine": f"{platform.machine()} {platform.processor() or platform.system()}, python {platform.python_version()}",
    }
