"""Offline profiling of the volatility → (λ, ρ̂) table (TurboServe Appendix A).

For each profiling segment: measure its volatility (std of new activations per ``bin_s`` bin over
the segment), replay it through TurboServe with every (λ, ρ̂) in the grid (non-adaptive, one-level
table), and keep the cheapest configuration whose worst-case per-chunk latency meets the SLO (ties:
larger ρ̂, then smaller λ). Each replay starts warm (GPUs for the peak active count within one
provisioning delay of the segment start, at that ρ̂) and only the segment is measured. Segments are
sorted by volatility; each becomes one level whose upper edge is the midpoint to the next segment's
volatility. ρ̂ is then made non-increasing with the level (a noisier workload never gets less
headroom than a calmer one); a segment where no setting met the SLO inherits the calmer level's ρ̂.

In this implementation λ is carried in the table and reported but does not change decisions
(the paper fixes λ = 0.2 for all levels, Table 6, and adapts through ρ̂ alone); the grid keeps the
axis so a policy that uses λ can be profiled by the same command.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

from scheduling.core.detector import VolatilityLevel, VolatilityTable, fixed_table
from scheduling.core.turboserve import TurboServePolicy

from .simulator import SimConfig, simulate

DEFAULT_RHO_GRID = (0.95, 0.9, 0.85, 0.8, 0.75, 0.7, 0.65, 0.6, 0.55, 0.5, 0.45, 0.4, 0.35, 0.3, 0.25)
DEFAULT_LAMBDA_GRID = (0.2,)


def segment_volatility(
    events: Sequence[Any], bin_s: float, start: float = 0.0, end: float | None = None
) -> float:
    end = end if end is not None else (events[-1].t if events else 0.0)
    nbins = max(1, math.ceil((end - start) / bin_s))
    counts = [0] * nbins
    for e in events:
        if e.event == "active" and start <= e.t < end:
            counts[min(nbins - 1, int((e.t - start) // bin_s))] += 1
    mean = sum(counts) / nbins
    return math.sqrt(sum((c - mean) ** 2 for c in counts) / nbins)


def _peak_active(events: Sequence[Any], start: float, end: float) -> int:
    """Most sessions active at once in [start, end] (the state just before ``start`` included)."""
    active: set[str] = set()
    peak = 0
    for e in events:
        if e.t > end:
            break
        if e.event == "active":
            active.add(e.session)
        elif e.event in ("idle", "depart"):
            active.discard(e.session)
        if e.t >= start:
            peak = max(peak, len(active))
    return max(peak, len(active)) if events and events[0].t <= end else peak


def profile_volatility_table(
    segments: Sequence[tuple[dict, Sequence[Any]]],
    config: SimConfig,
    *,
    slo_ms: float,
    rho_grid: Sequence[float] = DEFAULT_RHO_GRID,
    lambda_grid: Sequence[float] = DEFAULT_LAMBDA_GRID,
    bin_s: float = 5.0,
    window_bins: int = 12,
    policy_kwargs: dict[str, Any] | None = None,
    step: Callable[[int], None] | None = None,
) -> tuple[VolatilityTable, list[dict[str, Any]]]:
    rows: list[dict[str, Any]] = []
    kwargs = dict(policy_kwargs or {})
    for meta, events in segments:
        start = float(meta.get("segment_start_s", 0.0))
        end = meta.get("segment_end_s")
        sigma = segment_volatility(events, bin_s, start, end)
        # Start each replay warm: enough GPUs for the most sessions active within one provisioning
        # delay of the segment start, as a controller that had been running would hold.
        delay = config.profiles[0].provisioning_delay_s
        peak_at_start = _peak_active(events, start, start + delay)
        best = None
        tried = []
        for lam in lambda_grid:
            for rho in rho_grid:
                # Only the segment is measured.
                k = config.profiles[0].capacity
                initial = max(config.min_gpus, min(config.max_gpus, math.ceil(peak_at_start / (k * rho))))
                cfg = SimConfig(
                    **{
                        **config.__dict__,
                        "slo_ms": slo_ms,
                        "duration_s": meta.get("duration_s", config.duration_s),
                        "initial_gpus": initial,
                        "measure_from_s": start,
                    }
                )
                policy = TurboServePolicy(table=fixed_table(rho, lam, bin_s, window_bins), **kwargs)
                result = simulate(events, policy, cfg, trace_name=str(meta.get("name", "segment")))
                valid = result.worst_chunk_latency_ms <= slo_ms + 1e-9
                tried.append((lam, rho, valid, result))
                if step:
                    step(1)
                if valid:
                    key = (result.gpu_cost_usd, -rho, lam)
                    if best is None or key < best[0]:
                        best = (key, lam, rho, result)
        if best is None:
            # Nothing meets the SLO: the most conservative setting (lowest latency) is the safe choice.
            lam, rho, _, result = min(tried, key=lambda x: (x[3].worst_chunk_latency_ms, x[1]))
            valid = False
        else:
            _, lam, rho, result = best
            valid = True
        rows.append(
            {
                "segment": meta.get("name", "segment"),
                "volatility": round(sigma, 4),
                "lambda": lam,
                "rho_hat": rho,
                "valid": valid,
                "pass_rate": result.slo_pass_rate,
                "worst_ms": result.worst_chunk_latency_ms,
                "cost_usd": result.gpu_cost_usd,
            }
        )
    rows.sort(key=lambda r: (r["volatility"], r["segment"]))
    levels = []
    floor = 1.0
    for i, row in enumerate(rows):
        upper = (row["volatility"] + rows[i + 1]["volatility"]) / 2 if i + 1 < len(rows) else math.inf
        if row["valid"]:
            rho = min(floor, row["rho_hat"])
            floor = rho
        else:
            # No setting met the SLO on this segment (e.g. a burst no warm pool absorbs): it says
            # nothing about which ρ̂ is cheapest, so it inherits the calmer level's value.
            rho = floor if floor < 1.0 else row["rho_hat"]
        row["level"] = i + 1
        row["rho_hat_monotone"] = rho
        levels.append(VolatilityLevel(level=i + 1, upper=upper, lam=row["lambda"], rho_hat=rho))
    table = VolatilityTable(
        levels=tuple(levels),
        bin_s=bin_s,
        window_bins=window_bins,
        meta=(
            ("profile", ",".join(p.name for p in config.profiles)),
            ("slo_ms", slo_ms),
            ("source", "profile_volatility grid search (scheduling/sim/profiling.py)"),
        ),
    )
    return table, rows
