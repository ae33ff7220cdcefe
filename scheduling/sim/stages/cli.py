"""Pure functions behind ``simulate_stages`` (the benchmarks are in ``scheduling.benchmarks.stages``,
the reproduction in ``scheduling.reproduce.tridentserve``).

Errors about a flag raise :class:`StagesCliError` naming it; commands turn that into ``CommandError``.
"""

from __future__ import annotations

import math
import os
import platform
from typing import Any

from scheduling.core.stages.placement import PlacementError
from scheduling.core.stages.stage_profiles import StageProfileError, get_gpu, get_pipeline
from scheduling.sim.traces import TraceError, read_mixed_trace, write_mixed_trace

from .simulator import (
    ABLATIONS,
    POLICIES,
    StageSimConfig,
    StageSimulationError,
    simulate_stages,
)
from .workloads import KINDS, LEVELS, MIXES, WorkloadError, WorkloadSpec, generate_jobs

RESULT_KEYS = (
    "policy",
    "slo_attainment",
    "mean_latency_s",
    "p95_latency_s",
    "oom_events",
    "replacements",
    "gpu_cost_usd",
)
WORKLOADS = (*(f"steady-{level}" for level in LEVELS), "dynamic")
MACHINE = f"{platform.machine()}, {os.cpu_count()} CPUs, Python {platform.python_version()} (no GPU)"


class StagesCliError(ValueError):
    def __init__(self, flag: str, message: str):
        super().__init__(f"--{flag}: {message}")
        self.flag = flag


def positive(flag: str, value: float | int | None) -> None:
    if value is not None and not (isinstance(value, int | float) and math.isfinite(value) and value > 0):
        raise StagesCliError(flag, f"must be a positive number, got {value!r}")


def workload_spec(workload: str, *, duration_s: float, load: float, gpus: int, seed: int) -> WorkloadSpec:
    if workload not in WORKLOADS:
        raise StagesCliError("workload", f"unknown workload {workload!r} (expected one of {list(WORKLOADS)})")
    kind, _, level = workload.partition("-")
    return WorkloadSpec(
        kind=kind if kind in KINDS else "dynamic",
        level=level or "medium",
        duration_s=duration_s,
        load=load,
        gpus=gpus,
        seed=seed,
    )


def run_simulate_stages(
    *,
    policy: str,
    trace: str | None = None,
    workload: str | None = None,
    model: str = "wan-t2v",
    gpus: int = 128,
    gpu: str = "l20",
    ablation: str | None = None,
    duration_s: float = 1800.0,
    load: float = 0.8,
    seed: int = 0,
    tick_s: float = 0.5,
    window_s: float = 60.0,
    threshold: float = 1.5,
    write_trace: str | None = None,
) -> dict[str, Any]:
    """One policy over a trace file or a generated workload; the result has :data:`RESULT_KEYS`."""
    if policy not in POLICIES:
        raise StagesCliError("policy", f"unknown policy {policy!r} (expected one of {list(POLICIES)})")
    if (trace is None) == (workload is None):
        raise StagesCliError("trace", "give exactly one of --trace and --workload")
    if ablation is not None and ablation not in ABLATIONS:
        raise StagesCliError("ablation", f"unknown ablation {ablation!r} (expected one of {list(ABLATIONS)})")
    if ablation is not None and policy != "tridentserve":
        raise StagesCliError("ablation", "ablations apply to --policy tridentserve only")
    if isinstance(gpus, bool) or not isinstance(gpus, int) or gpus < 1:
        raise StagesCliError("gpus", f"must be an integer >= 1, got {gpus!r}")
    for flag, value in (
        ("duration-s", duration_s),
        ("load", load),
        ("tick-s", tick_s),
        ("window-s", window_s),
    ):
        positive(flag, value)
    if not threshold > 1:
        raise StagesCliError("threshold", f"must be > 1, got {threshold!r}")
    try:
        spec = get_gpu(gpu)
    except StageProfileError as exc:
        raise StagesCliError("gpu", str(exc)) from None
    if trace is not None:
        try:
            _, sessions, jobs = read_mixed_trace(trace)
        except FileNotFoundError:
            raise StagesCliError("trace", f"no such file: {trace}") from None
        except TraceError as exc:
            raise StagesCliError("trace", str(exc)) from None
    else:
        if model not in MIXES:
            raise StagesCliError(
                "model", f"no workload mixes for {model!r} (expected one of {sorted(MIXES)})"
            )
        try:
            jobs = generate_jobs(
                get_pipeline(model),
                workload_spec(workload, duration_s=duration_s, load=load, gpus=gpus, seed=seed),
                spec,
            )
        except WorkloadError as exc:
            raise StagesCliError("workload", str(exc)) from None
        sessions = []
        if write_trace:
            write_mixed_trace(
                write_trace, [], jobs, meta={"workload": workload, "model": model, "seed": seed}
            )
    config = StageSimConfig(gpus=gpus, gpu=spec, tick_s=tick_s, window_s=window_s, threshold=threshold)
    try:
        result = simulate_stages(jobs, sessions, policy, config, options=dict(ABLATIONS.get(ablation, {})))
    except (StageSimulationError, PlacementError, StageProfileError) as exc:
        raise StagesCliError("trace", str(exc)) from None
    if ablation is not None:
        result["policy"] = f"{policy}/{ablation}"
    return result


def format_result(result: dict[str, Any]) -> str:
    return (
        f"{result['policy']}: SLO attainment {result['slo_attainment']:.1%} of {result['jobs']} jobs, "
        f"mean latency {result['mean_latency_s']:.1f} s, p95 {result['p95_latency_s']:.1f} s, "
        f"{result['oom_events']} OOM, {result['replacements']} re-placements, ${result['gpu_cost_usd']:.2f}"
    )
