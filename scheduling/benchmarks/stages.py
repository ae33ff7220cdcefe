"""Stage-level serving's decision times (``bench_stages_dispatch``, ``bench_stages_replan``; TridentServe
§8.5): the dispatcher's integer program per tick, and one live re-placement's planning."""

from __future__ import annotations

import time
from typing import Any

import numpy as np

from scheduling.core.stages.placement import plan_placement, role_changes
from scheduling.core.stages.stage_profiles import L20, Shape, StageProfileError, get_gpu, get_pipeline
from scheduling.sim.stages.cli import MACHINE, StagesCliError, positive
from scheduling.sim.stages.simulator import Request, StageSimConfig, TridentServe
from scheduling.sim.stages.workloads import MIXES


def run_bench_dispatch(
    *,
    gpus: int,
    repeats: int = 50,
    seed: int = 0,
    pending_per_gpu: float = 1.0,
    idle_fraction: float = 0.25,
    model: str = "wan-t2v",
) -> dict[str, Any]:
    """Time one dispatcher tick (program build + HiGHS solve + GPU selection) on random snapshots.

    Like the paper's §8.5, the pending requests scale with the GPUs (``pending_per_gpu``); a
    snapshot has ``idle_fraction`` of the primaries idle and the rest busy for up to a minute."""
    if isinstance(gpus, bool) or not isinstance(gpus, int) or gpus < 8:
        raise StagesCliError("gpus", f"must be an integer >= 8, got {gpus!r}")
    if repeats < 1:
        raise StagesCliError("repeats", f"must be >= 1, got {repeats!r}")
    positive("pending-per-gpu", pending_per_gpu)
    if not 0 < idle_fraction <= 1:
        raise StagesCliError("idle-fraction", f"must be in (0, 1], got {idle_fraction!r}")
    if model not in MIXES:
        raise StagesCliError("model", f"no workload mixes for {model!r} (expected one of {sorted(MIXES)})")
    pipeline = get_pipeline(model)
    rng = np.random.default_rng(seed)
    mix = MIXES[model]["medium"]
    sizes = list(mix)
    weights = np.array([mix[s] for s in sizes]) / sum(mix.values())
    config = StageSimConfig(gpus=gpus, gpu=L20)
    shapes = [Shape(*sizes[i], pipeline.default_steps) for i in rng.choice(len(sizes), size=64, p=weights)]
    placement = plan_placement(pipeline, shapes, gpus, L20)
    total_ms, solve_ms, dispatched = [], [], []
    for repeat in range(repeats + 1):  # the first tick warms the option cache and is not counted
        engine = TridentServe(pipeline, config, shapes)
        engine.placement = placement
        engine.cluster.set_roles(placement.roles)
        now = 1000.0
        for g in engine.cluster.gpus:
            g.free_at = now if rng.random() < idle_fraction else now + float(rng.uniform(1, 60))
        pending = []
        for n in range(max(1, round(pending_per_gpu * gpus))):
            shape = Shape(*sizes[int(rng.choice(len(sizes), p=weights))], pipeline.default_steps)
            best = pipeline.best_latency_s(shape, L20)
            arrival = now - float(rng.uniform(0, 2 * best))
            pending.append(Request(f"r{n}", arrival, shape, arrival + 2.5 * best, best))
        started = time.perf_counter()
        engine.dispatch(now, pending)
        if repeat:
            total_ms.append((time.perf_counter() - started) * 1000)
            solve_ms.append(engine.solve_ms[-1])
            dispatched.append(sum(1 for r in pending if r.dispatched))
    return {
        "gpus": gpus,
        "pending": len(pending),
        "repeats": repeats,
        "dispatch_ms_p50": float(np.percentile(total_ms, 50)),
        "dispatch_ms_p99": float(np.percentile(total_ms, 99)),
        "solve_ms_p50": float(np.percentile(solve_ms, 50)),
        "solve_ms_p99": float(np.percentile(solve_ms, 99)),
        "dispatched_mean": float(np.mean(dispatched)),
        "target_ms": 50.0,
        "machine": MACHINE,
    }


def run_bench_replan(
    *,
    workers: int,
    chunks: int = 2048,
    jobs: int = 100,
    encodes: int = 300,
    repeats: int = 7,
    gpu: str = "h100",
) -> dict[str, Any]:
    """Time one live re-placement's planning (``plan_placement`` + ``role_changes``) on a pool of
    ``workers`` whole-pipeline workers, half of them busy: the streams' chunks (832×480, 12 frames)
    as the live planner feeds them (at most 2048), ``jobs`` videos of 81 frames and ``encodes``
    prompt encodes, on the ``wan-1.3b`` profile."""
    if isinstance(workers, bool) or not isinstance(workers, int) or workers < 1:
        raise StagesCliError("workers", f"must be an integer >= 1, got {workers!r}")
    for name, value in (("chunks", chunks), ("jobs", jobs), ("encodes", encodes)):
        if value < 0:
            raise StagesCliError(name, f"must be >= 0, got {value!r}")
    if repeats < 1:
        raise StagesCliError("repeats", f"must be >= 1, got {repeats!r}")
    try:
        spec = get_gpu(gpu)
    except StageProfileError as exc:
        raise StagesCliError("gpu", str(exc)) from exc
    pipeline = get_pipeline("wan-1.3b")
    streams = [Shape(832, 480, 12, pipeline.default_steps)] * chunks
    shapes = [Shape(832, 480, 81, pipeline.default_steps)] * jobs
    encode_s = encodes * pipeline.encode_s(Shape(64, 64, 1, 1), spec)
    current = {f"w{i:03d}": "EDC" for i in range(workers)}
    busy = set(list(current)[: workers // 2])
    times, changes, live = [], [], []
    for _ in range(repeats):
        started = time.perf_counter()
        plan = plan_placement(pipeline, shapes, workers, spec, encode_only_s=encode_s, stream_shapes=streams)
        live = list(plan.roles)
        changes = role_changes(current, live, busy)
        times.append((time.perf_counter() - started) * 1000)
    return {
        "workers": workers,
        "shapes": len(shapes) + len(streams),
        "repeats": repeats,
        "plan_ms_p50": float(np.percentile(times, 50)),
        "plan_ms_max": float(max(times)),
        "plan_roles": {role: plan.roles.count(role) for role in sorted(set(plan.roles))},
        "live_roles": {role: live.count(role) for role in sorted(set(live))},
        "changes": len(changes),
        "machine": MACHINE,
    }
