"""Steady and Dynamic job workloads shaped like TridentServe §8 / App. D.1.

Steady: Poisson arrivals at a fixed rate for the whole trace, with one of three resolution/duration
mixes (Light, Medium, Heavy). Dynamic: the three mixes interleaved in segments, with the arrival
rate following a tidal pattern (the shape of the paper's Fig. 9; its exact traces are proprietary).
The paper's Table 5 mix weights were lost in extraction, so the mixes below are ours: heavier mixes
shift weight to higher resolutions and longer videos. The 121-frame 720p class (longer than Wan2.1's
81-frame default) is the one whose diffuse activations no longer fit next to the text encoder on a
48 GB L20 (V0 infeasible, V1 = ED + C) — the paper's "requests that exceed V0 memory" (§8.3). Rates are sized from the profiles so that the
offered work (GPU-seconds at every stage's best degree) is ``load`` times the cluster's capacity —
the same trace then stresses every policy equally. Each job carries ``slo_s`` = 2.5x its latency at
the best degrees (§8.1).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from scheduling.core.stages.stage_profiles import GpuSpec, PipelineProfile, Shape
from scheduling.sim.traces import JobEvent

LEVELS = ("light", "medium", "heavy")
KINDS = ("steady", "dynamic")

# (width, height, frames) -> weight, per pipeline and level.
MIXES: dict[str, dict[str, dict[tuple[int, int, int], float]]] = {
    "wan-t2v": {
        "light": {(832, 480, 33): 0.6, (832, 480, 81): 0.3, (1280, 720, 33): 0.1},
        "medium": {
            (832, 480, 33): 0.3,
            (832, 480, 81): 0.3,
            (1280, 720, 33): 0.2,
            (1280, 720, 81): 0.15,
            (1280, 720, 121): 0.05,
        },
        "heavy": {
            (832, 480, 33): 0.1,
            (832, 480, 81): 0.2,
            (1280, 720, 33): 0.25,
            (1280, 720, 81): 0.3,
            (1280, 720, 121): 0.15,
        },
    },
    "sd3-image": {
        "light": {(512, 512, 1): 0.6, (1024, 1024, 1): 0.35, (2048, 2048, 1): 0.05},
        "medium": {(512, 512, 1): 0.3, (1024, 1024, 1): 0.5, (2048, 2048, 1): 0.2},
        "heavy": {(512, 512, 1): 0.1, (1024, 1024, 1): 0.4, (2048, 2048, 1): 0.5},
    },
}


class WorkloadError(ValueError):
    pass


@dataclass(frozen=True)
class WorkloadSpec:
    kind: str  # steady | dynamic
    level: str  # steady: light | medium | heavy (dynamic interleaves all three)
    duration_s: float
    load: float  # offered GPU-seconds per second / GPUs
    gpus: int
    seed: int = 0
    segment_s: float = 120.0  # dynamic: length of one mix segment
    period_s: float = 900.0  # dynamic: period of the tidal rate swing


def _mean_work(pipeline: PipelineProfile, level: str, gpu: GpuSpec) -> float:
    mix = MIXES[pipeline.name][level]
    total = sum(mix.values())
    return sum(
        w / total * pipeline.best_gpu_seconds(Shape(*size, pipeline.default_steps), gpu)
        for size, w in mix.items()
    )


def generate_jobs(pipeline: PipelineProfile, spec: WorkloadSpec, gpu: GpuSpec) -> list[JobEvent]:
    if pipeline.name not in MIXES:
        raise WorkloadError(f"no workload mixes for pipeline {pipeline.name!r} (have {sorted(MIXES)})")
    if spec.kind not in KINDS:
        raise WorkloadError(f"unknown workload {spec.kind!r} (expected one of {list(KINDS)})")
    if spec.kind == "steady" and spec.level not in LEVELS:
        raise WorkloadError(f"unknown level {spec.level!r} (expected one of {list(LEVELS)})")
    if spec.duration_s <= 0 or spec.load <= 0 or spec.gpus < 1:
        raise WorkloadError("duration, load and GPUs must be positive")
    rng = np.random.default_rng(spec.seed)
    jobs: list[JobEvent] = []
    t = 0.0
    segment_level = spec.level
    segment_end = -1.0
    while True:
        if spec.kind == "dynamic" and t >= segment_end:
            segment_level = LEVELS[int(rng.integers(len(LEVELS)))]
            segment_end = (math.floor(t / spec.segment_s) + 1) * spec.segment_s
        load = spec.load
        if spec.kind == "dynamic":
            load *= 1 + 0.4 * math.sin(2 * math.pi * t / spec.period_s)
        rate = load * spec.gpus / _mean_work(pipeline, segment_level, gpu)
        t += float(rng.exponential(1 / rate))
        if t >= spec.duration_s:
            return jobs
        mix = MIXES[pipeline.name][segment_level]
        sizes = list(mix)
        weights = np.array([mix[s] for s in sizes])
        width, height, frames = sizes[int(rng.choice(len(sizes), p=weights / weights.sum()))]
        shape = Shape(width, height, frames, pipeline.default_steps)
        slo = round(2.5 * pipeline.best_latency_s(shape, gpu), 3)
        jobs.append(
            JobEvent(
                round(t, 3),
                f"j{len(jobs)}",
                "submit",
                pipeline.kind,
                pipeline.name,
                width,
                height,
                frames if pipeline.kind == "video" else None,
                pipeline.default_steps,
                slo,
            )
        )
