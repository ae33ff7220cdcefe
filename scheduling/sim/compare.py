"""TurboServe §7.1 comparison protocol over one trace.

* **Cost at a matched latency constraint**: for each policy, the cheapest configuration whose
  worst-case per-chunk latency meets the SLO. Static policies (fixed budget) search the budget
  (smallest B in [1, max_gpus] that meets the SLO; worst latency is non-increasing in B for them,
  so a binary search is used and then verified). Autoscaling policies search their target
  utilisation: the adaptive volatility table and fixed ρ̂ in ``rho_grid``.
* **Worst latency at matched cost**: TurboServe runs its cheapest SLO-meeting configuration; each
  static policy gets the fixed budget whose cost is closest to TurboServe's cost; every other
  autoscaling policy gets, among its own configurations (target utilisation × warm pool: those
  the cost search ran, and TurboServe's), the one whose cost is closest to TurboServe's (ties: the
  lower worst latency) — a search at equal cost, as for static budgets, not TurboServe's own
  configuration, which may cost another policy much more or less.

K follows the SLO under test (``capacity="slo"``, the default): every profile's capacity becomes
``capacity_for_slo(slo)``, the largest load whose chunk plus one stall still meets it. With a
profile's default SLO that is the profile's own K; with a looser SLO, a static pool could otherwise
run its GPUs above a K the autoscaler is held below. ``capacity="profile"`` keeps the profiles' K.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import Any

from scheduling.core.policy import accepts_rho_hat, is_static, make_policy

from .simulator import SimConfig, SimResult, simulate

DEFAULT_POLICIES = ("turboserve", "base", "lag", "mag", "turboserve-no-migration", "turboserve-no-autoscale")
DEFAULT_RHO_GRID = (0.9, 0.8, 0.7, 0.6, 0.5, 0.4)

Progress = Callable[[str], None]


def config_for_slo(config: SimConfig, slo_ms: float) -> SimConfig:
    """``config`` held to ``slo_ms``, with every GPU type's K the load that still meets it.

    K is the load at which a GPU still meets the SLO (one stall included), so the scheduler's
    capacity target follows the SLO under test: no policy may run GPUs hotter than K while the
    autoscaler is held below it.
    """
    return replace(config, slo_ms=slo_ms, profiles=tuple(p.with_slo(slo_ms) for p in config.profiles))


def _run(events: Sequence[Any], name: str, config: SimConfig, trace: str, **kwargs: Any) -> SimResult:
    return simulate(events, make_policy(name, **kwargs), config, trace_name=trace)


def _meets(result: SimResult, slo_ms: float) -> bool:
    return result.worst_chunk_latency_ms <= slo_ms + 1e-9


def static_budget_for_slo(
    events: Sequence[Any],
    name: str,
    config: SimConfig,
    trace: str,
    slo_ms: float,
    step: Progress | None = None,
) -> tuple[int | None, SimResult | None, dict[int, SimResult]]:
    cache: dict[int, SimResult] = {}

    def run(b: int) -> SimResult:
        if b not in cache:
            cache[b] = _run(events, name, replace(config, initial_gpus=b, min_gpus=b), trace)
            if step:
                step(f"{name} B={b}")
        return cache[b]

    lo, hi = 1, config.max_gpus
    if not _meets(run(hi), slo_ms):
        return None, cache[hi], cache
    while lo < hi:
        mid = (lo + hi) // 2
        if _meets(run(mid), slo_ms):
            hi = mid
        else:
            lo = mid + 1
    return lo, run(lo), cache


def autoscaler_for_slo(
    events: Sequence[Any],
    name: str,
    config: SimConfig,
    trace: str,
    slo_ms: float,
    rho_grid: Sequence[float],
    step: Progress | None = None,
    refine: int = 3,
    options: dict[str, Any] | None = None,
) -> tuple[str, SimResult, list[dict[str, Any]]]:
    """The cheapest (target utilisation, warm initial pool) whose worst chunk meets the SLO.

    The warm pool at t = 0 decides whether a ramp that starts with the trace can be absorbed while
    new GPUs boot. Stage 1 runs every target (the adaptive table, then each fixed ρ̂) with the
    configured pool, max/4 and max/2. Stage 2 searches the pool as finely as a static policy's
    budget for the ``refine`` targets whose stage-1 cost at the SLO was lowest: a binary search for
    the smallest pool that meets the SLO between the largest stage-1 pool that missed it and the
    smallest that met it (a much larger warm pool is not always safer: the controller releases what
    it does not need before the ramp arrives). The cheapest SLO-meeting run of everything tried wins.
    """
    tried: list[tuple[str, SimResult]] = []
    targets: list[tuple[str, dict[str, Any]]] = [("adaptive", {})]
    if accepts_rho_hat(name):
        targets += [(f"rho={r:g}", {"rho_hat": r}) for r in rho_grid]
    caches: dict[str, dict[int, SimResult]] = {label: {} for label, _ in targets}

    def run(label: str, kwargs: dict[str, Any], initial: int) -> SimResult:
        cache = caches[label]
        if initial not in cache:
            cache[initial] = _run(
                events, name, replace(config, initial_gpus=initial), trace, **{**(options or {}), **kwargs}
            )
            tried.append((f"{label},init={initial}", cache[initial]))
            if step:
                step(f"{name} {label} init={initial}")
        return cache[initial]

    initials = sorted({config.initial_gpus, max(1, config.max_gpus // 4), max(1, config.max_gpus // 2)})
    for initial in initials:
        for label, kwargs in targets:
            run(label, kwargs, initial)

    def best_cost(label: str) -> float:
        costs = [r.gpu_cost_usd for r in caches[label].values() if _meets(r, slo_ms)]
        return min(costs) if costs else math.inf

    ranked = sorted(targets, key=lambda t: (best_cost(t[0]), t[0]))
    for label, kwargs in ranked[: max(0, refine)]:
        meeting = [i for i, r in caches[label].items() if _meets(r, slo_ms)]
        if not meeting:
            continue
        hi = min(meeting)
        lo = max([i for i in caches[label] if i < hi], default=0) + 1
        while lo < hi:
            mid = (lo + hi) // 2
            if _meets(run(label, kwargs, mid), slo_ms):
                hi = mid
            else:
                lo = mid + 1
    valid = [(r.gpu_cost_usd, label, r) for label, r in tried if _meets(r, slo_ms)]
    if valid:
        _, label, best = min(valid, key=lambda x: (x[0], x[1]))
    else:
        label, best = min(tried, key=lambda x: (x[1].worst_chunk_latency_ms, x[1].gpu_cost_usd))
    summary = [
        {"config": lab, "gpu_cost_usd": r.gpu_cost_usd, "worst_chunk_latency_ms": r.worst_chunk_latency_ms}
        for lab, r in tried
    ]
    return label, best, summary


def compare_policies(
    events: Sequence[Any],
    config: SimConfig,
    *,
    trace: str = "trace",
    slo_ms: float | None = None,
    policies: Sequence[str] = DEFAULT_POLICIES,
    reference: str = "turboserve",
    rho_grid: Sequence[float] = DEFAULT_RHO_GRID,
    step: Progress | None = None,
    capacity: str = "slo",
    policy_options: dict[str, dict[str, Any]] | None = None,
) -> dict[str, Any]:
    """``policy_options``: fixed keyword options per autoscaling policy name (e.g. the forecast of
    ``turboserve-forecast``), merged under the ρ̂ each search run sets."""
    slo = slo_ms if slo_ms is not None else config.profiles[0].default_slo_ms
    if capacity == "slo":
        config = config_for_slo(config, slo)
    elif capacity == "profile":
        config = replace(config, slo_ms=slo)
    else:
        raise ValueError(f"capacity: {capacity!r} is not 'slo' or 'profile'")
    profiles = tuple(config.profiles)
    duration = config.duration_s if config.duration_s is not None else (events[-1].t if events else 0.0)
    gpu_cost = config.profiles[0].price_per_hour * duration / 3600.0  # one static GPU over the trace
    names = [reference, *[p for p in policies if p != reference]]
    out: dict[str, Any] = {}
    ref_cost = None
    ref_label = f"adaptive,init={config.initial_gpus}"
    for name in names:
        entry: dict[str, Any] = {"static": is_static(name)}
        opts = (policy_options or {}).get(name, {})
        if is_static(name):
            budget, result, _ = static_budget_for_slo(events, name, config, trace, slo, step)
            entry["budget_at_slo"] = budget
            entry["cost_at_slo_usd"] = result.gpu_cost_usd if budget is not None and result else None
            entry["meets_slo"] = budget is not None
        else:
            label, result, tried = autoscaler_for_slo(
                events, name, config, trace, slo, rho_grid, step, options=opts
            )
            entry["config_at_slo"] = label
            entry["cost_at_slo_usd"] = result.gpu_cost_usd if _meets(result, slo) else None
            entry["meets_slo"] = _meets(result, slo)
            entry["configs_tried"] = tried
            entry["worst_latency_at_slo_config_ms"] = result.worst_chunk_latency_ms
            entry["scale_out"] = result.scale_out
            if name == reference:
                ref_cost = result.gpu_cost_usd
                ref_label = label
                entry["result"] = result.to_json(timeline=False)
            if "forecast" in result.policy_config:
                entry["forecast"] = result.policy_config["forecast"]
        out[name] = entry

    # Worst latency at matched cost.
    assert ref_cost is not None
    for name in names:
        entry = out[name]
        if is_static(name):
            budget = max(1, min(config.max_gpus, round(ref_cost / gpu_cost))) if gpu_cost > 0 else 1
            result = _run(events, name, replace(config, initial_gpus=budget, min_gpus=budget), trace)
            if step:
                step(f"{name} matched B={budget}")
            entry["budget_at_matched_cost"] = budget
        elif name == reference:
            kwargs, cfg = _parse_label(ref_label, config)
            result = _run(events, name, cfg, trace, **{**(policy_options or {}).get(name, {}), **kwargs})
            if step:
                step(f"{name} matched")
        else:
            label, result = _autoscaler_at_cost(
                events, name, config, trace, ref_label, ref_cost, entry, (policy_options or {}).get(name, {})
            )
            if step:
                step(f"{name} matched {label}")
            entry["config_at_matched_cost"] = label
        entry["worst_latency_at_matched_cost_ms"] = result.worst_chunk_latency_ms
        entry["cost_at_matched_cost_usd"] = result.gpu_cost_usd
        entry["p99_at_matched_cost_ms"] = result.p99_chunk_latency_ms

    ref = out[reference]
    reduction: dict[str, dict[str, float | None]] = {}
    for name in names:
        if name == reference:
            continue
        other = out[name]
        lat = other["worst_latency_at_matched_cost_ms"]
        cost = other["cost_at_slo_usd"]
        reduction[name] = {
            "latency_pct": _pct(lat, ref["worst_latency_at_matched_cost_ms"]),
            "cost_pct": _pct(cost, ref["cost_at_slo_usd"]),
        }
    return {
        "trace": trace,
        "slo_ms": slo,
        "capacity_mode": capacity,
        "capacity": {p.name: round(p.capacity, 3) for p in profiles},
        "policies": out,
        "reduction_vs": reduction,
    }


def _autoscaler_at_cost(
    events: Sequence[Any],
    name: str,
    config: SimConfig,
    trace: str,
    ref_label: str,
    ref_cost: float,
    entry: dict[str, Any],
    options: dict[str, Any] | None = None,
) -> tuple[str, SimResult]:
    """The configuration of autoscaler ``name`` whose cost is closest to ``ref_cost``.

    Candidates: every configuration the cost search ran (``entry['configs_tried']``) and the
    reference's own configuration; ties go to the lower worst latency, then the label. The chosen
    one is re-run for its full result (p99).
    """
    kwargs, cfg = _parse_label(ref_label, config)
    if not accepts_rho_hat(name):
        kwargs = {}
        ref_label = f"adaptive,init={cfg.initial_gpus}"
    own = _run(events, name, cfg, trace, **{**(options or {}), **kwargs})
    candidates = {
        row["config"]: (row["gpu_cost_usd"], row["worst_chunk_latency_ms"])
        for row in entry.get("configs_tried", [])
    }
    candidates[ref_label] = (own.gpu_cost_usd, own.worst_chunk_latency_ms)
    label = min(candidates, key=lambda k: (abs(candidates[k][0] - ref_cost), candidates[k][1], k))
    if label == ref_label:
        return label, own
    kwargs, cfg = _parse_label(label, config)
    return label, _run(events, name, cfg, trace, **{**(options or {}), **kwargs})


def _parse_label(label: str, config: SimConfig) -> tuple[dict[str, Any], SimConfig]:
    """Inverse of the ``"<adaptive|rho=x>,init=n"`` configuration labels."""
    target, _, init = label.partition(",init=")
    kwargs: dict[str, Any] = {} if target == "adaptive" else {"rho_hat": float(target.split("=")[1])}
    return kwargs, replace(config, initial_gpus=int(init)) if init else config


def _pct(baseline: float | None, ours: float | None) -> float | None:
    """Reduction of ``ours`` relative to ``baseline`` in percent (positive: ours is lower)."""
    if baseline is None or ours is None or baseline <= 0 or math.isnan(baseline):
        return None
    return round((baseline - ours) / baseline * 100.0, 2)
