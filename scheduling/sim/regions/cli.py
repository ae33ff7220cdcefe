"""Pure functions behind ``simulate_regions`` (the macro-solve benchmark is in
``scheduling.benchmarks.regions``, the results section in ``scheduling.reproduce.torta``).

Errors about a flag raise :class:`RegionsCliError` naming it; commands turn that into ``CommandError``.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import replace
from typing import Any

from scheduling.sim.traces import TraceError

from .demand import DemandShape, generate_demand, read_region_trace, write_region_trace
from .policies import POLICIES, RegionPolicyError, make_region_policy
from .simulator import RegionSimConfig, RegionSimulationError, simulate_regions
from .topology import TopologyError, load_topology

RESULT_KEYS = (
    "policy",
    "mean_response_ms",
    "worst_chunk_latency_ms",
    "slo_pass_rate",
    "gpu_cost_usd",
    "cross_region_moves",
    "macro_solve_ms_p99",
)


class RegionsCliError(ValueError):
    def __init__(self, flag: str, message: str):
        super().__init__(f"--{flag}: {message}")
        self.flag = flag


def parse_options(items: Sequence[str]) -> dict[str, Any]:
    """``["sigma=0", "forecast=none"]`` → keyword options for the policy (JSON values, else strings)."""
    options: dict[str, Any] = {}
    for item in items:
        key, sep, raw = item.partition("=")
        if not sep or not key.isidentifier():
            raise RegionsCliError("option", f"expected key=value, got {item!r}")
        try:
            options[key] = json.loads(raw)
        except json.JSONDecodeError:
            options[key] = raw
    return options


def _finite(value: float | None, flag: str, *, minimum: float = 0.0, strict: bool = False) -> None:
    if value is None:
        return
    bad = not math.isfinite(value) or (value <= minimum if strict else value < minimum)
    if bad:
        raise RegionsCliError(flag, f"must be a number {'>' if strict else '>='} {minimum}, got {value}")


def run_simulate_regions(
    *,
    topology: str,
    policy: str,
    trace: str | None = None,
    seed: int = 0,
    options: Sequence[str] = (),
    duration_s: float | None = None,
    mean_utilisation: float | None = None,
    provisioning_delay_s: float | None = None,
    slot_s: float | None = None,
    write_trace: str | None = None,
) -> dict[str, Any]:
    """One policy on one topology: the given trace, or a seeded diurnal demand generated for it."""
    _finite(duration_s, "duration-s", strict=True)
    _finite(provisioning_delay_s, "provisioning-delay-s")
    _finite(slot_s, "slot-s", strict=True)
    if mean_utilisation is not None and not (0 < mean_utilisation <= 1):
        raise RegionsCliError("mean-utilisation", f"must be in (0, 1], got {mean_utilisation}")
    if seed < 0:
        raise RegionsCliError("seed", f"must be >= 0, got {seed}")
    try:
        topo = load_topology(topology, seed=0)
    except TopologyError as exc:
        raise RegionsCliError("topology", str(exc)) from exc
    if trace is not None:
        if duration_s is not None or mean_utilisation is not None:
            raise RegionsCliError(
                "trace", "--duration-s and --mean-utilisation apply to generated demand only"
            )
        try:
            demand = read_region_trace(trace, topo)
        except FileNotFoundError as exc:
            raise RegionsCliError("trace", f"no such file {trace}") from exc
        except TraceError as exc:
            raise RegionsCliError("trace", f"{trace}: {exc}") from exc
    else:
        shape = DemandShape()
        if duration_s is not None:
            shape = replace(shape, duration_s=duration_s, day_s=duration_s / 2)
        if mean_utilisation is not None:
            shape = replace(shape, mean_utilisation=mean_utilisation)
        demand = generate_demand(topo, shape, seed)
        demand.meta["day_s"] = shape.day_s
        if write_trace:
            write_region_trace(write_trace, demand)
    config = RegionSimConfig()
    if provisioning_delay_s is not None:
        config = replace(config, provisioning_delay_s=provisioning_delay_s)
    if slot_s is not None:
        config = replace(config, slot_s=slot_s)
    try:
        config.validate()
    except RegionSimulationError as exc:
        raise RegionsCliError("slot-s", str(exc)) from exc
    try:
        chosen = make_region_policy(policy, **parse_options(options))
    except RegionPolicyError as exc:
        flag = "policy" if policy not in POLICIES else "option"
        raise RegionsCliError(flag, str(exc)) from exc
    result = simulate_regions(topo, demand, chosen, config)
    result["seed"] = seed
    return result


def format_result(result: dict[str, Any]) -> str:
    solve = result["macro_solve_ms_p99"]
    return (
        f"{result['policy']} on {result['topology']} ({result['regions']} regions, {result['sessions']} sessions): "
        f"mean response {result['mean_response_ms']:.1f} ms, worst chunk {result['worst_chunk_latency_ms']:.0f} ms, "
        f"SLO pass {100 * result['slo_pass_rate']:.2f} %, GPU cost ${result['gpu_cost_usd']:.2f}, "
        f"{result['cross_region_moves']} cross-region moves"
        + (f", macro solve p99 {solve:.2f} ms" if solve is not None else "")
    )
