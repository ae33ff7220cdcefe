"""The multi-region router's decision time (``bench_regions_solve``; TORTA): one macro routing step."""

from __future__ import annotations

import os
import platform
import time
import warnings
from typing import Any

import numpy as np

from scheduling.core.regions.transport import (
    CostWeights,
    TransportPlan,
    cost_matrix,
    routing_probabilities,
    smooth_plan,
    solve_plan,
)
from scheduling.sim.regions.cli import RegionsCliError


def run_bench_solve(
    *, regions: int = 32, method: str = "emd", repeats: int = 200, seed: int = 0, beta: float = 0.5
) -> dict[str, Any]:
    """Time one macro step (OT solve + row-normalise + smoothing) on a random ``regions``-region
    instance with two GPU pools per region, as the router solves it each slot."""
    if regions < 2:
        raise RegionsCliError("regions", f"must be >= 2, got {regions}")
    if repeats < 1:
        raise RegionsCliError("repeats", f"must be >= 1, got {repeats}")
    if method not in ("emd", "sinkhorn"):
        raise RegionsCliError("method", f"must be emd or sinkhorn, got {method!r}")
    rng = np.random.default_rng(seed)
    positions = rng.uniform(0, 1, size=(regions, 2))
    rtt = 2 + 150 * np.linalg.norm(positions[:, None] - positions[None], axis=2)
    allowed = rtt <= np.percentile(rtt, 75)
    np.fill_diagonal(allowed, True)
    pool_region = np.repeat(np.arange(regions), 2)
    pool_capacity = rng.uniform(5, 25, size=2 * regions)
    pool_price = rng.uniform(0.2, 1.5, size=2 * regions)
    cost = cost_matrix(rtt[:, pool_region], np.zeros((regions, 2 * regions)), pool_price, CostWeights())
    pool_allowed = allowed[:, pool_region]
    previous = None
    times = []
    for _ in range(repeats):
        demand = rng.uniform(0, 20, size=regions)
        started = time.perf_counter()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            plan = solve_plan(demand, pool_capacity, cost, pool_allowed, method=method)
        flow = np.zeros((regions, regions))
        np.add.at(flow.T, pool_region, plan.flow.T)
        probabilities = routing_probabilities(TransportPlan(flow, plan.overflow), allowed, np.ones(regions))
        previous = smooth_plan(previous, probabilities, beta)
        times.append((time.perf_counter() - started) * 1000.0)
    values = np.array(times)
    return {
        "regions": regions,
        "pools": 2 * regions,
        "method": method,
        "repeats": repeats,
        "solve_ms_p50": float(np.percentile(values, 50)),
        "solve_ms_p99": float(np.percentile(values, 99)),
        "solve_ms_max": float(values.max()),
        "target_ms": 20.0,
        "machine": f"{platform.machine()}, {os.cpu_count()} CPUs, Python {platform.python_version()}",
    }
