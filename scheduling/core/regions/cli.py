"""Pure functions behind ``simulate_regions``, ``bench_regions_solve`` and ``reproduce_regions``.

Errors about a flag raise :class:`RegionsCliError` naming it; commands turn that into ``CommandError``.
"""

from __future__ import annotations

import json
import math
import platform
import time
import warnings
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np

from scheduling.core.traces import TraceError

from .demand import DemandShape, generate_demand, read_region_trace, write_region_trace
from .policies import POLICIES, RegionPolicyError, make_region_policy
from .simulator import RegionSimConfig, RegionSimulationError, simulate_regions
from .topology import BUILTIN_SHAPES, TopologyError, load_topology
from .transport import CostWeights, TransportPlan, cost_matrix, routing_probabilities, smooth_plan, solve_plan

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
        "machine": f"{platform.machine()}, {__import__('os').cpu_count()} CPUs, Python {platform.python_version()}",
    }


# --------------------------------------------------------------------------------------------------
# The results section (docs/results/regions.md).

REPORT_POLICIES = ("nearest", "round-robin", "least-loaded", "skylb", "torta")
PAPER_CLAIMS = {"response": "up to 15 % lower", "cost": "10–20 % lower"}


def run_regions_report(
    *,
    topologies: Sequence[str] = tuple(BUILTIN_SHAPES),
    policies: Sequence[str] = REPORT_POLICIES,
    seed: int = 0,
    duration_s: float = 6 * 3600.0,
    ablations: Sequence[tuple[str, Sequence[str]]] = (),
    ablation_topology: str = "abilene",
    variants: Sequence[tuple[str, Sequence[str]]] = (),
    progress: bool = False,
) -> dict[str, Any]:
    """Every topology × policy, plus TORTA ``variants`` (label, options) on every topology (shown, never
    counted as baselines) and ``ablations`` (label, TORTA options) on one topology."""
    runs: list[dict[str, Any]] = []
    for topology in topologies:
        for policy in policies:
            result = run_simulate_regions(topology=topology, policy=policy, seed=seed, duration_s=duration_s)
            result.pop("config", None)
            runs.append(result)
            if progress:
                print(format_result(result), flush=True)
        for label, options in variants:
            result = run_simulate_regions(
                topology=topology, policy="torta", seed=seed, duration_s=duration_s, options=options
            )
            result.pop("config", None)
            result["policy"] = label
            result["variant"] = True
            runs.append(result)
            if progress:
                print(format_result(result), flush=True)
    ablation_runs = []
    for label, options in ablations:
        result = run_simulate_regions(
            topology=ablation_topology, policy="torta", seed=seed, duration_s=duration_s, options=options
        )
        result.pop("config", None)
        result["label"] = label
        result["options"] = list(options)
        ablation_runs.append(result)
        if progress:
            print(label, format_result(result), flush=True)
    return {
        "seed": seed,
        "duration_s": duration_s,
        "config": RegionSimConfig().__dict__,
        "runs": runs,
        "ablation_topology": ablation_topology,
        "ablations": ablation_runs,
        "machine": f"{platform.machine()}, {__import__('os').cpu_count()} CPUs, Python {platform.python_version()}",
    }


def _pct(ours: float, best: float) -> float:
    return 100.0 * (best - ours) / best if best else 0.0


def summarise(report: dict[str, Any], candidate: str = "torta") -> list[dict[str, Any]]:
    """Per topology: ``candidate`` (TORTA or one of its variants) against the best baseline on each
    metric (positive = the candidate lower). Variants are never baselines."""
    rows = []
    for topology in dict.fromkeys(r["topology"] for r in report["runs"]):
        here = [r for r in report["runs"] if r["topology"] == topology]
        chosen = [r for r in here if r["policy"] == candidate]
        baselines = [r for r in here if not r.get("variant") and r["policy"] != "torta"]
        if not chosen or not baselines:
            continue
        torta = chosen[0]
        meeting = [r for r in baselines if r["slo_pass_rate"] >= torta["slo_pass_rate"] - 1e-9] or baselines
        best_response = min(baselines, key=lambda r: r["mean_response_ms"])
        best_cost = min(meeting, key=lambda r: r["gpu_cost_usd"])
        movers = [r for r in baselines if r["cross_region_moves"] > 0]
        best_moves = min(movers, key=lambda r: r["cross_region_moves"]) if movers else None
        rows.append(
            {
                "topology": topology,
                "best_response_baseline": best_response["policy"],
                "response_reduction_pct": _pct(torta["mean_response_ms"], best_response["mean_response_ms"]),
                "best_cost_baseline": best_cost["policy"],
                "cost_reduction_pct": _pct(torta["gpu_cost_usd"], best_cost["gpu_cost_usd"]),
                "fewest_moves_baseline": best_moves["policy"] if best_moves else None,
                "moves_reduction_pct": (
                    _pct(torta["cross_region_moves"], best_moves["cross_region_moves"])
                    if best_moves
                    else None
                ),
                "macro_solve_ms_p99": torta["macro_solve_ms_p99"],
            }
        )
    return rows


def _fmt(value: Any, digits: int = 1, suffix: str = "") -> str:
    if value is None:
        return "–"
    if isinstance(value, float):
        return f"{value:,.{digits}f}{suffix}"
    return f"{value}{suffix}"


def _verdict(value: float | None, target: float) -> str:
    if value is None:
        return "n/a"
    return "met" if value >= target else "missed"


def render_report(report: dict[str, Any], bench: dict[str, Any] | None = None) -> str:
    """The Markdown results section (``docs/results/regions.md``) from a report's JSON."""
    summary = summarise(report)
    lines = [
        "# Regions (TORTA): the four topologies against the baselines",
        "",
        f"Generated by `python manage.py reproduce_regions --out docs/results --seed {report['seed']}` "
        f"({report['duration_s'] / 3600:.0f} h of seeded diurnal demand per topology, slots of "
        f"{report['config']['slot_s']:.0f} s, {report['config']['provisioning_delay_s']:.0f} s provisioning delay) "
        f"on {report['machine']}; {report.get('generated_at', '')}. Raw figures: `regions.json`. Everything here is "
        "simulated (`scheduling.core.regions`), as the paper's are; the model and its assumptions are in "
        "`docs/regions.md`. Response = mean chunk latency (compute stretched by overload, plus RTT); cost = GPU "
        "dollars from request to release; moves = live sessions moved to another region.",
        "",
        "## Headline: TORTA against the best baseline on each topology",
        "",
        "| topology | mean response: best baseline → reduction | GPU cost: cheapest baseline at TORTA's SLO pass rate → reduction "
        "| cross-region moves: fewest-moving baseline that moves → reduction | macro solve p99 |",
        "|---|---|---|---|---|",
    ]
    for row in summary:
        lines.append(
            f"| {row['topology']} | {row['best_response_baseline']} → {row['response_reduction_pct']:+.1f} % "
            f"| {row['best_cost_baseline']} → {row['cost_reduction_pct']:+.1f} % "
            f"| {row['fewest_moves_baseline'] or '(no baseline moves)'} → {_fmt(row['moves_reduction_pct'], 1, ' %')} "
            f"| {_fmt(row['macro_solve_ms_p99'], 2, ' ms')} |"
        )
    lines += [
        "",
        "| target (issue 16) | paper's claim | ours | verdict |",
        "|---|---|---|---|",
    ]
    if summary:
        worst_response = min(r["response_reduction_pct"] for r in summary)
        worst_cost = min(r["cost_reduction_pct"] for r in summary)
        moves = [r["moves_reduction_pct"] for r in summary if r["moves_reduction_pct"] is not None]
        lines.append(
            f"| ≥ 10 % lower mean response than the best baseline, every topology | {PAPER_CLAIMS['response']} "
            f"| {', '.join(_fmt(r['response_reduction_pct'], 1, ' %') for r in summary)} | {_verdict(worst_response, 10)} |"
        )
        lines.append(
            f"| ≥ 10 % lower GPU cost than the best baseline, every topology | {PAPER_CLAIMS['cost']} "
            f"| {', '.join(_fmt(r['cost_reduction_pct'], 1, ' %') for r in summary)} | {_verdict(worst_cost, 10)} |"
        )
        lines.append(
            "| ≥ 30 % fewer cross-region moves than the best baseline (measured against the baselines that move "
            "sessions at all: skylb, nearest and round-robin never do) | – "
            f"| {', '.join(_fmt(m, 1, ' %') for m in moves) or 'no baseline moves'} "
            f"| {_verdict(min(moves) if moves else None, 30)} |"
        )
    variants = list(dict.fromkeys(r["policy"] for r in report["runs"] if r.get("variant")))
    for variant in variants:
        rows = summarise(report, variant)
        lines.append(
            f"| (variant: {variant}) reductions against the same baselines | – | response "
            f"{', '.join(_fmt(r['response_reduction_pct'], 1, ' %') for r in rows)}; cost "
            f"{', '.join(_fmt(r['cost_reduction_pct'], 1, ' %') for r in rows)}; moves "
            f"{', '.join(_fmt(r['moves_reduction_pct'], 1, ' %') for r in rows)} | – |"
        )
    if bench:
        lines.append(
            f"| macro solve < 20 ms at 32 regions | ≈0.15 ms (emd, NOTES) | p99 {bench['solve_ms_p99']:.2f} ms "
            f"({bench['method']}, {bench['pools']} pools, `bench_regions_solve`) | {'met' if bench['solve_ms_p99'] < 20 else 'missed'} |"
        )
    lines += [
        "",
        "## Every topology × policy",
        "",
        "| topology | policy | mean response ms | worst chunk ms | SLO pass | GPU cost $ | GPU-hours | moves "
        "| mean RTT ms | served outside the nearest region | routing churn | macro solve p99 ms |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in report["runs"]:
        lines.append(
            f"| {r['topology']} | {r['policy']} | {r['mean_response_ms']:.1f} | {r['worst_chunk_latency_ms']:,.0f} "
            f"| {100 * r['slo_pass_rate']:.2f} % | {r['gpu_cost_usd']:,.1f} | {r['gpu_hours']:,.1f} | {r['cross_region_moves']} "
            f"| {r['mean_rtt_ms']:.1f} | {100 * r['remote_share']:.1f} % | {r['routing_churn']:.3f} "
            f"| {_fmt(r['macro_solve_ms_p99'], 2)} |"
        )
    if report.get("ablations"):
        lines += [
            "",
            f"## Ablations of TORTA on {report['ablation_topology']} (same demand)",
            "",
            "| variant | options | mean response ms | worst chunk ms | SLO pass | GPU cost $ | moves | routing churn "
            "| forecast accuracy (Eq. 12) | forecast fit s (fits) | macro solve p99 ms |",
            "|---|---|---|---|---|---|---|---|---|---|---|",
        ]
        for r in report["ablations"]:
            lines.append(
                f"| {r['label']} | `{' '.join(r.get('options', []))}` | {r['mean_response_ms']:.1f} "
                f"| {r['worst_chunk_latency_ms']:,.0f} | {100 * r['slo_pass_rate']:.2f} % | {r['gpu_cost_usd']:,.1f} "
                f"| {r['cross_region_moves']} | {r['routing_churn']:.3f} | {_fmt(r.get('forecast_accuracy'), 3)} "
                f"| {_fmt(r.get('forecast_fit_s'), 2)} ({r.get('forecast_fits', 0)}) | {_fmt(r['macro_solve_ms_p99'], 2)} |"
            )
    return "\n".join(lines) + "\n"


def write_report(
    report: dict[str, Any], out: str | Path, *, bench: dict[str, Any] | None = None, notes: str = ""
) -> tuple[Path, Path]:
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    report = dict(report, summary=summarise(report), bench=bench)
    json_path = out / "regions.json"
    json_path.write_text(json.dumps(report, indent=1, sort_keys=True, default=float) + "\n", encoding="utf-8")
    md_path = out / "regions.md"
    md_path.write_text(render_report(report, bench) + notes, encoding="utf-8")
    return json_path, md_path
