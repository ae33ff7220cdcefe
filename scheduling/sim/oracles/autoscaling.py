"""Offline autoscaling oracles.

* :func:`autoscaling_oracle` — TurboServe Table 2 (§7.4): with the whole trace known, the minimum
  number of GPUs each 1-minute slot needs to keep the load at or below ``K · ρ̂``, then a dynamic
  program over GPU budgets for the cheapest schedule that always has them. The provisioning delay
  is honoured: a GPU that serves from slot ``s`` on must have been requested ``delay_s`` before the
  slot starts, and it is paid from the request (boot and model load cost money, serve nothing).
  Releasing is immediate. So the DP weighs keeping GPUs through a dip against releasing them and
  paying the boot again.
* :func:`per_window_rho_oracle` — TurboServe Tables 8–10 (Appendix A): for every 30 s window pick
  ``ρ̂ ∈ {0.50, 0.55, …, 0.95}`` minimising cost subject to the latency constraint, knowing the
  future. The replay is the caller's ``evaluate(rho_per_window) -> (cost, worst_latency_ms)`` (the
  simulator), so this module stays independent of it.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from ..traces import TraceEvent, active_load_steps

RHO_GRID = tuple(round(0.50 + 0.05 * k, 2) for k in range(10))


@dataclass
class AutoscaleSchedule:
    budgets: list[int]  # GPUs serving in each slot
    need: list[int]  # the minimum each slot requires
    cost_usd: float
    gpu_seconds: float  # paid GPU time, boot time included
    boot_gpu_seconds: float  # part of gpu_seconds spent booting
    scale_ups: int  # GPUs requested over the trace
    slot_s: float
    delay_s: float
    details: dict[str, Any] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return {
            "budgets": self.budgets,
            "need": self.need,
            "cost_usd": self.cost_usd,
            "gpu_seconds": self.gpu_seconds,
            "boot_gpu_seconds": self.boot_gpu_seconds,
            "scale_ups": self.scale_ups,
            "slot_s": self.slot_s,
            "delay_s": self.delay_s,
            **self.details,
        }


def _slot_lengths(n_slots: int, slot_s: float, duration_s: float | None) -> list[float]:
    lengths = [slot_s] * n_slots
    if duration_s is not None and n_slots:
        lengths[-1] = max(0.0, duration_s - slot_s * (n_slots - 1))
    return lengths


def schedule_cost(
    budgets: Sequence[int],
    *,
    slot_s: float,
    delay_s: float,
    price_per_hour: float,
    initial_gpus: int,
    duration_s: float | None = None,
) -> tuple[float, float, float, int]:
    """Cost of a per-slot budget schedule under the oracle's cost model:
    ``(cost_usd, gpu_seconds, boot_gpu_seconds, gpus_requested)``. ``initial_gpus`` are ready at 0."""
    lengths = _slot_lengths(len(budgets), slot_s, duration_s)
    serving = sum(m * length for m, length in zip(budgets, lengths, strict=True))
    ups = 0
    previous = initial_gpus
    for m in budgets:
        ups += max(0, m - previous)
        previous = m
    boot = ups * delay_s
    gpu_seconds = serving + boot
    return gpu_seconds * price_per_hour / 3600.0, gpu_seconds, boot, ups


def autoscaling_oracle(
    need: Sequence[int],
    *,
    slot_s: float = 60.0,
    delay_s: float,
    price_per_hour: float,
    initial_gpus: int | None = None,
    min_gpus: int = 0,
    max_gpus: int | None = None,
    duration_s: float | None = None,
) -> AutoscaleSchedule:
    """Minimum-cost budgets ``m_s >= need_s`` (DP over budgets, O(slots · budgets²)).

    ``initial_gpus`` are ready at time 0 at no boot cost (default: ``need[0]``, a warm start). A need
    above ``max_gpus`` cannot be met; it is capped and listed in ``details["capped_slots"]``.
    """
    if delay_s < 0 or slot_s <= 0 or price_per_hour < 0:
        raise ValueError("need delay_s >= 0, slot_s > 0 and price_per_hour >= 0")
    need = [max(int(n), min_gpus) for n in need]
    capped = []
    if max_gpus is not None:
        capped = [s for s, n in enumerate(need) if n > max_gpus]
        need = [min(n, max_gpus) for n in need]
    start = need[0] if (initial_gpus is None and need) else (initial_gpus or 0)
    if not need:
        return AutoscaleSchedule([], [], 0.0, 0.0, 0.0, 0, slot_s, delay_s)
    top = max(max(need), start)
    if max_gpus is not None:
        top = min(top, max(max_gpus, start))
    lengths = _slot_lengths(len(need), slot_s, duration_s)
    rate = price_per_hour / 3600.0
    # best[m]: cheapest cost of slots so far ending with budget m; parent pointers to rebuild.
    best = {start: 0.0}
    parents: list[dict[int, int]] = []
    for s, n in enumerate(need):
        nxt: dict[int, float] = {}
        parent: dict[int, int] = {}
        for m in range(n, top + 1):
            serve = m * lengths[s]
            choice = None
            for prev, cost in best.items():
                value = cost + rate * (serve + delay_s * max(0, m - prev))
                if (
                    choice is None
                    or value < choice[0] - 1e-12
                    or (abs(value - choice[0]) <= 1e-12 and prev < choice[1])
                ):
                    choice = (value, prev)
            assert choice is not None
            nxt[m], parent[m] = choice
        best = nxt
        parents.append(parent)
    final = min(best, key=lambda m: (best[m], m))
    budgets = [final]
    for s in range(len(need) - 1, 0, -1):
        budgets.append(parents[s][budgets[-1]])
    budgets.reverse()
    cost, gpu_seconds, boot, ups = schedule_cost(
        budgets,
        slot_s=slot_s,
        delay_s=delay_s,
        price_per_hour=price_per_hour,
        initial_gpus=start,
        duration_s=duration_s,
    )
    assert math.isclose(cost, best[final], rel_tol=1e-9, abs_tol=1e-9)
    return AutoscaleSchedule(
        budgets=budgets,
        need=need,
        cost_usd=cost,
        gpu_seconds=gpu_seconds,
        boot_gpu_seconds=boot,
        scale_ups=ups,
        slot_s=slot_s,
        delay_s=delay_s,
        details={"initial_gpus": start, "capped_slots": capped, "price_per_hour": price_per_hour},
    )


def slot_demand(
    events: Sequence[TraceEvent],
    *,
    slot_s: float = 60.0,
    duration_s: float | None = None,
    statistic: str = "peak",
) -> list[float]:
    """Active load (Σ session ``load`` of active sessions) per slot: its peak (default) or time-average."""
    if statistic not in ("peak", "mean"):
        raise ValueError("statistic must be 'peak' or 'mean'")
    if duration_s is None:
        duration_s = events[-1].t if events else 0.0
    n_slots = max(1, math.ceil(duration_s / slot_s - 1e-9))
    steps = active_load_steps(events)
    out = []
    for s in range(n_slots):
        lo, hi = s * slot_s, min((s + 1) * slot_s, duration_s) if s == n_slots - 1 else (s + 1) * slot_s
        peak = 0.0
        area = 0.0
        for k, (t, value) in enumerate(steps):
            t_next = steps[k + 1][0] if k + 1 < len(steps) else math.inf
            a, b = max(t, lo), min(t_next, hi)
            if b > a or (a == lo and t <= lo < t_next):
                peak = max(peak, value)
            if b > a:
                area += value * (b - a)
        out.append(peak if statistic == "peak" else (area / (hi - lo) if hi > lo else 0.0))
    return out


def gpus_needed(demand: Sequence[float], capacity: float, rho_hat: float) -> list[int]:
    """``ceil(load / (K · ρ̂))`` per slot (a tiny tolerance keeps exact multiples from rounding up)."""
    if capacity <= 0 or not 0 < rho_hat <= 1:
        raise ValueError("need capacity > 0 and 0 < rho_hat <= 1")
    return [max(0, math.ceil(d / (capacity * rho_hat) - 1e-9)) for d in demand]


def trace_autoscaling_oracle(
    events: Sequence[TraceEvent],
    *,
    capacity: float,
    rho_hat: float,
    delay_s: float,
    price_per_hour: float,
    slot_s: float = 60.0,
    duration_s: float | None = None,
    statistic: str = "peak",
    initial_gpus: int | None = None,
    min_gpus: int = 0,
    max_gpus: int | None = None,
) -> AutoscaleSchedule:
    """Table 2's oracle on a trace: per-slot demand → GPUs needed at ``K · ρ̂`` → DP over budgets."""
    if duration_s is None:
        duration_s = events[-1].t if events else 0.0
    demand = slot_demand(events, slot_s=slot_s, duration_s=duration_s, statistic=statistic)
    need = gpus_needed(demand, capacity, rho_hat)
    schedule = autoscaling_oracle(
        need,
        slot_s=slot_s,
        delay_s=delay_s,
        price_per_hour=price_per_hour,
        initial_gpus=initial_gpus,
        min_gpus=min_gpus,
        max_gpus=max_gpus,
        duration_s=duration_s,
    )
    schedule.details.update(
        {
            "demand": demand,
            "capacity": capacity,
            "rho_hat": rho_hat,
            "statistic": statistic,
            "duration_s": duration_s,
        }
    )
    return schedule


# --------------------------------------------------------------------------------------------------
# Per-window ρ̂ oracle (Tables 8–10).

Evaluate = Callable[[list[float]], tuple[float, float]]


@dataclass
class RhoOracleResult:
    rhos: list[float]
    cost: float
    worst_latency_ms: float
    feasible: bool
    evaluations: int
    method: str

    def to_json(self) -> dict[str, Any]:
        return {
            "rhos": self.rhos,
            "cost": self.cost,
            "worst_latency_ms": self.worst_latency_ms,
            "feasible": self.feasible,
            "evaluations": self.evaluations,
            "method": self.method,
        }


def per_window_rho_oracle(
    evaluate: Evaluate,
    n_windows: int,
    slo_ms: float,
    *,
    candidates: Sequence[float] = RHO_GRID,
    method: str = "greedy",
    max_passes: int = 3,
    fill: float | None = None,
) -> RhoOracleResult:
    """Choose ρ̂ per window minimising cost subject to ``worst_latency <= slo_ms``.

    ``evaluate(rhos)`` replays the whole trace with ``rhos[w]`` in window ``w`` and returns
    ``(cost, worst_latency_ms)``. ``method="exhaustive"`` tries all ``len(candidates) ** n_windows``
    combinations (small cases, and the tests' cross-check). ``method="greedy"`` follows the paper's
    per-window search with full knowledge of the future: windows are fixed in time order, each to
    the cheapest feasible candidate given the windows before it and the not-yet-decided ones held at
    ``fill`` (default: the most conservative candidate); then coordinate passes re-optimise one window
    at a time until nothing improves (at most ``max_passes``). Every evaluation is cached.
    """
    if n_windows <= 0:
        raise ValueError("n_windows must be > 0")
    grid = sorted(set(float(c) for c in candidates))
    if not grid:
        raise ValueError("need at least one candidate")
    cache: dict[tuple[float, ...], tuple[float, float]] = {}

    def run(rhos: Sequence[float]) -> tuple[float, float]:
        key = tuple(rhos)
        if key not in cache:
            cost, latency = evaluate(list(key))
            cache[key] = (float(cost), float(latency))
        return cache[key]

    def better(a: tuple[float, float], b: tuple[float, float] | None) -> bool:
        """Feasible beats infeasible; among feasible, cheaper; among infeasible, lower latency."""
        if b is None:
            return True
        fa, fb = a[1] <= slo_ms, b[1] <= slo_ms
        if fa != fb:
            return fa
        if fa:
            return a[0] < b[0] - 1e-12
        return a[1] < b[1] - 1e-12

    if method == "exhaustive":
        best_rhos: tuple[float, ...] | None = None
        best_val: tuple[float, float] | None = None
        for combo in itertools.product(grid, repeat=n_windows):
            value = run(combo)
            if better(value, best_val):
                best_rhos, best_val = combo, value
        assert best_rhos is not None and best_val is not None
        return RhoOracleResult(
            list(best_rhos), best_val[0], best_val[1], best_val[1] <= slo_ms, len(cache), "exhaustive"
        )
    if method != "greedy":
        raise ValueError("method must be 'greedy' or 'exhaustive'")

    current = [grid[0] if fill is None else float(fill)] * n_windows
    for _ in range(max(1, max_passes)):
        changed = False
        for w in range(n_windows):
            best_c, best_val = current[w], run(current)
            # Higher ρ̂ first: on equal cost prefer the denser packing.
            for c in reversed(grid):
                trial = [*current[:w], c, *current[w + 1 :]]
                value = run(trial)
                if better(value, best_val):
                    best_c, best_val = c, value
            if best_c != current[w]:
                current[w] = best_c
                changed = True
        if not changed:
            break
    cost, latency = run(current)
    return RhoOracleResult(list(current), cost, latency, latency <= slo_ms, len(cache), "greedy")
