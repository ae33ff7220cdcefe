"""Figures and charts of the reproduction report (everything from ``results.json``; no simulation here).

The words live in ``templates/reproduce/report.md`` and its partials (Jinja2, Markdown out): headings,
prose, sentence templates and table layouts. This module only turns ``results.json`` into the figures
the template shows (summaries, derived numbers, whether a target is met), draws the PNG charts, and
renders the template into ``<out>/README.md``.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from statistics import mean
from typing import Any

import jinja2

from scheduling.core.gpu_profiles import BUILTIN_PROFILES

from . import paper
from .experiments import EXPERIMENTS, plan

BASELINES = ("base", "lag", "mag")
# The reference of the fig7forecast units: TurboServe with the predictive floor (issue 16).
FORECAST_REFERENCE = "turboserve-forecast"
# The repository's templates/ (also Django's TEMPLATES DIRS); the report is rendered without Django
# settings (the runner, tests, a re-render of docs/results), so it is found from this file.
TEMPLATES = Path(__file__).resolve().parents[2] / "templates"
# Our own targets for the scheduler's decision time (issue 3), p99 per cluster size in GPUs.
SCHEDULER_TARGET_MS = {64: 1.0, 1024: 10.0}


# --------------------------------------------------------------------------------------------------
# formatting filters (the template's `num`, `pct` and `fmt`)


def _f(x: Any, digits: int = 1, suffix: str = "") -> str:
    if x is None or (isinstance(x, float) and not math.isfinite(x)):
        return "–"
    if isinstance(x, int | float):
        return f"{x:,.{digits}f}{suffix}"
    return str(x)


def _pct(x: Any, digits: int = 1) -> str:
    if x is None:
        return "–"
    return f"{x:+.{digits}f} %"


def _environment() -> jinja2.Environment:
    env = jinja2.Environment(
        loader=jinja2.FileSystemLoader(TEMPLATES),
        # Markdown out, not HTML: nothing to escape.
        autoescape=False,
        # Block tags on lines of their own leave no blank line behind; the file's last newline is kept.
        trim_blocks=True,
        lstrip_blocks=True,
        keep_trailing_newline=True,
        # A figure missing from the context is a bug in this module, not an empty cell.
        undefined=jinja2.StrictUndefined,
    )
    env.filters.update(num=_f, pct=_pct, fmt=format)
    return env


# --------------------------------------------------------------------------------------------------
# helpers


def _mean(xs: list[float]) -> float | None:
    xs = [x for x in xs if x is not None]
    return round(mean(xs), 2) if xs else None


def _met(ours: float | None, target: float) -> bool | None:
    """Whether our figure reaches the paper's (None: we have no figure)."""
    return None if ours is None else ours >= target


def _pyplot():
    import logging

    import matplotlib

    logging.getLogger("matplotlib").setLevel(logging.WARNING)

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _save(fig, path: Path) -> str:
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    _pyplot().close(fig)
    return path.name


def _units(data: dict[str, Any], prefix: str) -> dict[str, Any]:
    return {k: v for k, v in sorted(data["units"].items()) if k.startswith(prefix) and not v.get("error")}


def _errors(data: dict[str, Any], prefix: str) -> list[dict[str, str]]:
    return [
        {"key": k, "error": v["error"]}
        for k, v in sorted(data["units"].items())
        if k.startswith(prefix) and v.get("error")
    ]


def _short(name: str) -> str:
    return {
        "scheduling.reproduce.policies:NoHeadroom": "turboserve-no-headroom",
        "scheduling.reproduce.policies:NoCooldown": "turboserve-no-cooldown",
        "scheduling.reproduce.policies:WithScaleInWindow": "turboserve-scale-in-window",
    }.get(name, name)


def _policy(entry: dict[str, Any]) -> dict[str, Any]:
    """The figures of one policy's §7.1 comparison entry the tables show (absent = None)."""
    return {
        k: entry.get(k)
        for k in (
            "meets_slo",
            "cost_at_slo_usd",
            "config_at_slo",
            "budget_at_slo",
            "worst_latency_at_slo_config_ms",
            "worst_latency_at_matched_cost_ms",
        )
    }


def _reductions(u: dict[str, Any]) -> list[dict[str, Any]]:
    """TurboServe's cost and latency reductions against each baseline, in BASELINES order."""
    return [
        {
            "baseline": b,
            "cost_pct": u["reduction_vs"].get(b, {}).get("cost_pct"),
            "latency_pct": u["reduction_vs"].get(b, {}).get("latency_pct"),
        }
        for b in BASELINES
    ]


# --------------------------------------------------------------------------------------------------
# summaries (also stored in results.json under "summary")


def _fig7_summary(units: dict[str, Any], reference: str = "turboserve") -> dict[str, Any]:
    """Mean reductions, baseline wins and SLO misses over a set of §7.1 comparison units.

    ``reference`` is the policy the units' reductions are of (``turboserve-forecast`` in fig7forecast).
    A baseline wins a cell on a metric where the reference's reduction against it is negative, or, on
    cost, where the baseline meets the SLO and the reference does not. ``baseline_win_cells`` names
    each win as ``(trace, profile, metric, baseline)``, to compare the same cells across experiments.
    """
    lat, cost, losses, no_slo, ts_no_slo = [], [], [], [], []
    lat_ok: list[float] = []
    at_bound: list[dict[str, Any]] = []
    cells: list[list[str]] = []
    for key, u in units.items():
        ours = u["policies"][reference]
        if not ours.get("meets_slo"):
            ts_no_slo.append(key)
        for b in BASELINES:
            red = u["reduction_vs"].get(b, {})
            if red.get("latency_pct") is not None:
                lat.append(red["latency_pct"])
                if ours.get("meets_slo"):
                    lat_ok.append(red["latency_pct"])
                if red["latency_pct"] < 0:
                    losses.append(f"{key} latency vs {b} ({-red['latency_pct']:.1f} % higher)")
                    cells.append([u["trace"], u["profile"], "latency", b])
            if red.get("cost_pct") is not None:
                cost.append(red["cost_pct"])
                if red["cost_pct"] < 0:
                    losses.append(f"{key} cost vs {b} ({-red['cost_pct']:.1f} % higher)")
                    cells.append([u["trace"], u["profile"], "cost", b])
            elif u["policies"][b].get("meets_slo") is False and ours.get("meets_slo"):
                no_slo.append(f"{key} {b}")
                # The baseline misses the SLO even with the whole cluster all trace long, so meeting
                # it would cost at least that much: counted at that lower bound, shown apart.
                bound = _cluster_cost_usd(u)
                pct = _reduction_pct(bound, ours.get("cost_at_slo_usd"))
                if pct is not None:
                    at_bound.append({"cell": f"{key} {b}", "bound_usd": round(bound, 4), "cost_pct": pct})
            elif u["policies"][b].get("meets_slo") and not ours.get("meets_slo"):
                losses.append(f"{key} cost vs {b} ({b} meets the SLO, {reference} does not)")
                cells.append([u["trace"], u["profile"], "cost", b])
    return {
        "units": len(units),
        "latency_reduction_mean_pct": _mean(lat),
        "latency_reduction_max_pct": max(lat) if lat else None,
        "cost_reduction_mean_pct": _mean(cost),
        "cost_reduction_max_pct": max(cost) if cost else None,
        "comparisons_latency": len(lat),
        "latency_reduction_mean_pct_where_turboserve_meets_slo": _mean(lat_ok),
        "comparisons_latency_where_turboserve_meets_slo": len(lat_ok),
        "comparisons_cost": len(cost),
        "baseline_never_meets_slo": no_slo,
        # Cells the cost mean leaves out, counted at the whole cluster's cost (a lower bound on the
        # baseline's), and the mean with them in.
        "baseline_never_meets_slo_at_bound": at_bound,
        "cost_reduction_mean_pct_with_bound": _mean(cost + [c["cost_pct"] for c in at_bound]),
        "turboserve_misses_slo": ts_no_slo,
        "baseline_wins": losses,
        "baseline_win_cells": cells,
    }


def _cluster_cost_usd(unit: dict[str, Any]) -> float | None:
    """The whole cluster (``max_gpus`` of the unit's profile) for the trace's duration."""
    spec = BUILTIN_PROFILES.get(unit.get("profile", ""))
    if spec is None or not unit.get("max_gpus") or not unit.get("duration_s"):
        return None
    return unit["max_gpus"] * spec.price_per_hour * unit["duration_s"] / 3600.0


def _reduction_pct(baseline: float | None, ours: float | None) -> float | None:
    if baseline is None or ours is None or baseline <= 0:
        return None
    return round((baseline - ours) / baseline * 100.0, 2)


def _fig8_summary(units: dict[str, Any]) -> dict[str, Any]:
    """Each variant's cost at the SLO relative to full TurboServe's, over comparison units."""
    abl: dict[str, list[float]] = {}
    for u in units.values():
        ts = u["policies"]["turboserve"].get("cost_at_slo_usd")
        for name, entry in u["policies"].items():
            if name in ("turboserve", *BASELINES):
                continue
            c = entry.get("cost_at_slo_usd")
            if ts and c:
                abl.setdefault(_short(name), []).append(round((c - ts) / ts * 100.0, 2))
    return {
        name: {"mean_pct": _mean(v), "max_pct": max(v), "min_pct": min(v), "n": len(v)}
        for name, v in abl.items()
    }


def _scale_out_delays(units: dict[str, Any]) -> dict[str, Any]:
    """The delays TurboServe's scale-outs got (its cheapest SLO-meeting run) over computed-delay units."""
    rows = [u["policies"]["turboserve"].get("scale_out") or {} for u in units.values()]
    rows = [r for r in rows if r.get("gpus")]
    gpus = sum(r["gpus"] for r in rows)
    return {
        "gpus": gpus,
        "mean_s": round(sum(r["delay_s_mean"] * r["gpus"] for r in rows) / gpus, 3) if gpus else None,
        "min_s": min((r["delay_s_min"] for r in rows), default=None),
        "max_s": max((r["delay_s_max"] for r in rows), default=None),
    }


def _fig7_by_delay(data: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """The Fig. 7 summary per provisioning delay: the fig7delay units grouped by their delay, the
    fig7 units (each profile's own delay) under ``"profile"`` and the fig7peer units (delay computed
    per scale-out by the scale planner) under ``"peer"``."""
    groups: dict[str, dict[str, Any]] = {}
    for key, u in _units(data, "fig7delay/").items():
        groups.setdefault(f"{u['provisioning_delay_s']:g}", {})[key] = u
    out = {
        d: {**_fig7_summary(groups[d]), "fig8": _fig8_summary(groups[d])} for d in sorted(groups, key=float)
    }
    fig7 = _units(data, "fig7/")
    if out and fig7:
        out["profile"] = {**_fig7_summary(fig7), "fig8": _fig8_summary(fig7)}
    peer = _units(data, "fig7peer/")
    if peer:
        out["peer"] = {**_fig7_summary(peer), "fig8": _fig8_summary(peer), "delays": _scale_out_delays(peer)}
    return out


def _forecast_accuracy(units: dict[str, Any]) -> dict[str, Any]:
    """The forecast block of the floor's cheapest SLO-meeting run (``forecast_floor.forecast_report``)
    averaged over units: Eq. 12 accuracy and MAPE of the one-slot-ahead forecast of the slot load."""
    rows = [u["policies"][FORECAST_REFERENCE].get("forecast") or {} for u in units.values()]
    rows = [r for r in rows if r]
    return {
        "units": len(rows),
        "accuracy_eq12_mean": round(mean(acc), 4) if (acc := [r["accuracy_eq12"] for r in rows]) else None,
        "accuracy_eq12_min": min((r["accuracy_eq12"] for r in rows), default=None),
        "mape_pct_mean": _mean([r.get("mape_pct") for r in rows]),
        "slots_min": min((r["slots"] for r in rows), default=None),
        "slots_max": max((r["slots"] for r in rows), default=None),
        "fits": sum(r.get("fits", 0) for r in rows),
        "season_s": max((r.get("season_s", 0.0) for r in rows), default=None),
    }


def _fig7_forecast(data: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """The Fig. 7 summary of the fig7forecast units per forecaster (the units' last key part), with
    the predictive floor as the reference, and the forecasts' accuracy."""
    groups: dict[str, dict[str, Any]] = {}
    for key, u in _units(data, "fig7forecast/").items():
        groups.setdefault(key.rsplit("/", 1)[1], {})[key] = u
    return {
        f: {**_fig7_summary(us, reference=FORECAST_REFERENCE), "accuracy": _forecast_accuracy(us)}
        for f, us in groups.items()
    }


def summarise(data: dict[str, Any]) -> dict[str, Any]:
    s: dict[str, Any] = {}
    fig7 = _units(data, "fig7/")
    s["fig7"] = _fig7_summary(fig7)
    by_delay = _fig7_by_delay(data)
    if by_delay:
        s["fig7_by_delay"] = by_delay
    forecast = _fig7_forecast(data)
    if forecast:
        s["fig7_forecast"] = forecast
    s["fig8"] = _fig8_summary(fig7)
    gap = data["units"].get("fig9/gap")
    if gap and not gap.get("error"):
        s["fig9_gap"] = {"mean_pct": gap["overall"]["mean_gap_pct"], "max_pct": gap["overall"]["max_gap_pct"]}
    t2 = _units(data, "table2/")
    if t2:
        gaps = [
            u["runs"]["turboserve"]["gap_pct"]
            for u in t2.values()
            if u["runs"]["turboserve"]["gap_pct"] is not None
        ]
        s["table2"] = {"gap_mean_pct": _mean(gaps), "gap_mean_abs_pct": _mean([abs(g) for g in gaps])}
    t8 = data["units"].get("tables8_10")
    if t8 and not t8.get("error"):
        s["tables8_10"] = {
            "gap_pct": t8["gap_pct"],
            "gap_at_online_latency_pct": t8.get("gap_at_online_latency_pct"),
            "oracle_feasible": t8["oracle"]["feasible"],
            "online_meets_slo": t8["online"]["meets_slo"],
        }
    return s


# --------------------------------------------------------------------------------------------------
# figures of each section (the template's context), charts beside them


def run_figures(data: dict[str, Any]) -> list[dict[str, Any]]:
    """The runs behind the figures (meta.runs), for the report's opening paragraph."""
    return [
        {
            "started_utc": r["started_utc"],
            "wall_s": r["wall_s"],
            "jobs": r["jobs"],
            "all_experiments": set(EXPERIMENTS) <= set(r.get("experiments") or []),
            "experiments": list(r.get("experiments") or []),
            "units_run": len(r.get("units_run") or []),
            "core_commit": r.get("core_commit"),
        }
        for r in data["meta"].get("runs", [])
    ]


def headline_figures(summary: dict[str, Any]) -> dict[str, Any]:
    f7 = summary["fig7"]
    no_migration = summary["fig8"].get("turboserve-no-migration")
    no_autoscale = summary["fig8"].get("turboserve-no-autoscale")
    gap = summary.get("fig9_gap")
    t2 = summary.get("table2")
    t8 = summary.get("tables8_10")
    gm = t8.get("gap_at_online_latency_pct") if t8 else None
    return {
        "fig7": f7,
        "latency_met": _met(f7["latency_reduction_mean_pct"], paper.FIG7["latency_reduction_mean_pct"]),
        "latency_where_turboserve_meets_slo_met": _met(
            f7["latency_reduction_mean_pct_where_turboserve_meets_slo"],
            paper.FIG7["latency_reduction_mean_pct"],
        ),
        "cost_met": _met(f7["cost_reduction_mean_pct"], paper.FIG7["cost_reduction_mean_pct"]),
        "no_baseline_wins": not f7["baseline_wins"],
        "instant": summary.get("fig7_by_delay", {}).get("0"),
        "peer": (peer := summary.get("fig7_by_delay", {}).get("peer")),
        # Issue 13's target for the peer row: both means at or above the paper's, no baseline-win cell.
        "peer_met": None
        if not peer
        else bool(
            _met(peer["latency_reduction_mean_pct"], paper.FIG7["latency_reduction_mean_pct"])
            and _met(peer["cost_reduction_mean_pct"], paper.FIG7["cost_reduction_mean_pct"])
            and not peer["baseline_wins"]
        ),
        # Issue 16's target for the ETS floor at the profiles' own boot: no baseline-win cell on the grid.
        "forecast": (forecast := summary.get("fig7_forecast", {}).get("ets")),
        "forecast_met": None
        if not forecast
        else forecast["units"] == summary["fig7"]["units"] and not forecast["baseline_wins"],
        # Fig. 8: the paper's ablations cost more than full TurboServe; "in sign" = ours do too.
        "no_migration": no_migration,
        "no_migration_in_sign": no_migration is not None and no_migration["mean_pct"] > 0,
        "no_autoscale": no_autoscale,
        "no_autoscale_in_sign": no_autoscale is not None and no_autoscale["mean_pct"] > 0,
        "fig9_gap": gap,
        "fig9_gap_met": bool(gap)
        and gap["mean_pct"] <= paper.FIG9["gap_mean_pct"]
        and gap["max_pct"] <= paper.FIG9["gap_max_pct"],
        "table2": t2,
        "table2_met": bool(t2)
        and t2["gap_mean_abs_pct"] is not None
        and t2["gap_mean_abs_pct"] <= paper.TABLE2["gap_mean_pct"],
        "tables8_10": t8,
        "tables8_10_met": gm is not None and abs(gm) <= paper.TABLES8_10["gap_pct"],
    }


def fig4_figures(data: dict[str, Any], out: Path) -> dict[str, Any]:
    units = {k: v for k, v in sorted(data["units"].items()) if k == "fig4" or k.startswith("fig4/")}
    shown = []
    for key, u in units.items():
        if u.get("error"):
            shown.append({"key": key, "error": u["error"]})
            continue
        shown.append(
            {
                "key": key,
                "error": None,
                "unit": u,
                "load_mix": [{"share_pct": w * 100, "load": load} for load, w in u.get("load_mix") or []],
                "profile_slo_ms": u.get("profile_slo_ms", 0),
                "chart": _plot_fig4(key, u["rows"], out),
            }
        )
    mixed = units.get("fig4/mixed")
    reading = None
    if mixed and not mixed.get("error"):
        a1 = mixed["rows"]["migration"]
        change = a1.get("latency_pct")
        reading = {
            "lowered": change is not None and change < 0,
            "change_pct": change,
            "migrations": a1["migrations"],
            "base_p99_ms": mixed["rows"]["base"]["p99_ms"],
            "a1_p99_ms": a1["p99_ms"],
        }
    return {"units": shown, "mixed": reading}


def _plot_fig4(key: str, rows: dict[str, Any], out: Path) -> str:
    p = paper.FIG4
    plt = _pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(8, 3))
    keys = ["base", "migration", "autoscaling", "joint"]
    names = ["base", "A1 mig.", "A2 auto.", "A3 joint"]
    ours_l = [rows[k]["worst_ms"] / rows["base"]["worst_ms"] for k in keys]
    ours_c = [rows[k]["cost_usd"] / rows["base"]["cost_usd"] for k in keys]
    pap_l = [1.0, 1 + p["migration"]["latency_pct"] / 100, 1.0, 1 + p["joint"]["latency_pct"] / 100]
    pap_c = [1.0, 1.0, 1 + p["autoscaling"]["cost_pct"] / 100, 1 + p["joint"]["cost_pct"] / 100]
    x = range(len(keys))
    for ax, ours, pap, title in (
        (axes[0], ours_l, pap_l, "worst chunk latency / base"),
        (axes[1], ours_c, pap_c, "GPU cost / base"),
    ):
        ax.bar([i - 0.2 for i in x], ours, 0.4, label="ours")
        ax.bar([i + 0.2 for i in x], pap, 0.4, label="paper", hatch="//", alpha=0.6)
        ax.set_xticks(list(x), names)
        ax.set_title(f"{title} ({key})", fontsize=9)
        ax.axhline(1.0, color="grey", lw=0.5)
    axes[0].legend()
    name = "fig4_motivation.png" if key == "fig4" else f"fig4_motivation_{key.split('/', 1)[1]}.png"
    return _save(fig, out / name)


def fig7_figures(data: dict[str, Any], out: Path, summary: dict[str, Any]) -> dict[str, Any]:
    units = _units(data, "fig7/")
    if not units:
        return {"units": [], "errors": _errors(data, "fig7/")}
    f = summary["fig7"]
    target = paper.FIG7
    return {
        "units": [
            {
                "trace": u["trace"],
                "profile": u["profile"],
                "slo_ms": u["slo_ms"],
                "par": u["shape"]["par"],
                "turboserve": _policy(u["policies"]["turboserve"]),
                "baselines": [{**_policy(u["policies"][r["baseline"]]), **r} for r in _reductions(u)],
                "wall_s": u["unit"]["wall_s"],
            }
            for u in units.values()
        ],
        "summary": f,
        "latency_met": _met(f["latency_reduction_mean_pct"], target["latency_reduction_mean_pct"]),
        "latency_where_turboserve_meets_slo_met": _met(
            f["latency_reduction_mean_pct_where_turboserve_meets_slo"], target["latency_reduction_mean_pct"]
        ),
        "cost_met": _met(f["cost_reduction_mean_pct"], target["cost_reduction_mean_pct"]),
        "chart": _plot_fig7(units, out),
    }


def _plot_fig7(units: dict[str, Any], out: Path) -> str:
    plt = _pyplot()
    keys = list(units)
    fig, axes = plt.subplots(2, 1, figsize=(max(6, 0.9 * len(keys) + 2), 5.5), sharex=True)
    width = 0.25
    for ax, metric, target, title in (
        (
            axes[0],
            "latency_pct",
            paper.FIG7["latency_reduction_mean_pct"],
            "worst latency reduction at matched cost (%)",
        ),
        (axes[1], "cost_pct", paper.FIG7["cost_reduction_mean_pct"], "cost reduction at matched latency (%)"),
    ):
        for j, b in enumerate(BASELINES):
            vals = [units[k]["reduction_vs"][b].get(metric) for k in keys]
            xs = [i + (j - 1) * width for i in range(len(keys))]
            ax.bar(xs, [v if v is not None else 0 for v in vals], width, label=b)
            for x, v in zip(xs, vals, strict=True):
                if v is None:
                    ax.text(x, 0, "×", ha="center", va="bottom", fontsize=7)
        ax.axhline(target, color="red", ls="--", lw=1, label=f"paper mean {target} %")
        ax.axhline(0, color="grey", lw=0.5)
        ax.set_title(title, fontsize=9)
    axes[0].legend(fontsize=7, ncol=4)
    axes[1].set_xticks(
        range(len(keys)), [k.removeprefix("fig7/").replace("/", "\n") for k in keys], fontsize=7
    )
    return _save(fig, out / "fig7_end_to_end.png")


def fig8_figures(data: dict[str, Any], out: Path, summary: dict[str, Any]) -> dict[str, Any]:
    units = _units(data, "fig7/")
    if not units:
        return {"units": []}
    names: list[str] = []
    for u in units.values():
        for n in u["policies"]:
            if n not in ("turboserve", *BASELINES) and n not in names:
                names.append(n)
    rows = []
    for u in units.values():
        ts = u["policies"]["turboserve"].get("cost_at_slo_usd")
        cells = []
        for n in names:
            e = u["policies"].get(n)
            c = e.get("cost_at_slo_usd") if e is not None else None
            cells.append(
                None
                if e is None
                else {
                    "cost": c,
                    "change_pct": round((c - ts) / ts * 100.0, 1) if (c and ts) else None,
                    "worst_at_slo_config_ms": e.get("worst_latency_at_slo_config_ms"),
                }
            )
        rows.append(
            {
                "trace": u["trace"],
                "profile": u["profile"],
                "turboserve_cost": ts,
                "max_gpus": u["max_gpus"],
                "variants": cells,
            }
        )
    p = paper.FIG8
    # The two ablations the paper has (Fig. 8), as (mean, max) cost increase.
    paper_means = {
        "turboserve-no-migration": (
            p["no_migration_cost_increase_mean_pct"],
            p["no_migration_cost_increase_max_pct"],
        ),
        "turboserve-no-autoscale": (
            p["no_autoscale_cost_increase_mean_pct"],
            p["no_autoscale_cost_increase_max_pct"],
        ),
    }
    return {
        "units": rows,
        "variants": [
            {"name": _short(n), "summary": summary["fig8"].get(_short(n)), "paper": paper_means.get(n)}
            for n in names
        ],
        "chart": _plot_fig8(units, names, out),
    }


def _plot_fig8(units: dict[str, Any], names: list[str], out: Path) -> str:
    p = paper.FIG8
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(max(6, 0.8 * len(units) + 2), 3.2))
    width = 0.8 / max(1, len(names))
    for j, n in enumerate(names):
        vals = []
        for u in units.values():
            ts = u["policies"]["turboserve"].get("cost_at_slo_usd")
            c = (u["policies"].get(n) or {}).get("cost_at_slo_usd")
            vals.append((c - ts) / ts * 100 if (c and ts) else 0)
        ax.bar(
            [i + (j - (len(names) - 1) / 2) * width for i in range(len(units))], vals, width, label=_short(n)
        )
    ax.axhline(p["no_migration_cost_increase_mean_pct"], color="C0", ls="--", lw=0.8)
    ax.axhline(p["no_autoscale_cost_increase_mean_pct"], color="C1", ls="--", lw=0.8)
    ax.axhline(0, color="grey", lw=0.5)
    ax.set_xticks(range(len(units)), [k.removeprefix("fig7/").replace("/", "\n") for k in units], fontsize=7)
    ax.set_ylabel("cost change vs TurboServe (%)")
    ax.set_title("ablation (dashed: paper means, no-migration / no-autoscale)", fontsize=9)
    ax.legend(fontsize=6)
    return _save(fig, out / "fig8_ablation.png")


def fig9_figures(data: dict[str, Any], out: Path) -> dict[str, Any]:
    bench = data["units"].get("fig9/bench")
    gap = data["units"].get("fig9/gap")
    bench_ok = bench if bench and not bench.get("error") else None
    gap_ok = gap if gap and not gap.get("error") else None
    p = paper.FIG9
    paper_bound_ms = {64: p["sched_ms_at_64_below"], 256: p["sched_ms_at_256_below"]}
    figures: dict[str, Any] = {
        "bench": None,
        "bench_error": bench.get("error") if bench else None,
        "gap": None,
        "gap_error": gap.get("error") if gap else None,
    }
    if bench_ok:
        sizes = []
        for r in bench_ok["sizes"]:
            target = SCHEDULER_TARGET_MS.get(r["gpus"])
            sizes.append(
                {
                    **r,
                    "paper_bound_ms": paper_bound_ms.get(r["gpus"]),
                    "target_ms": target,
                    "met": target is not None and r["p99_ms"] <= target,
                    "met_in_cpu_time": target is not None and r["cpu_p99_ms"] <= target,
                }
            )
        figures["bench"] = {
            "profile": bench_ok["profile"],
            "events_per_size": bench_ok["events_per_size"],
            "sizes": sizes,
        }
    if gap_ok:
        o = gap_ok["overall"]
        figures["gap"] = {
            "instances_per_size": gap_ok["instances_per_size"],
            "eta": gap_ok["eta"],
            "by_gpus": gap_ok["by_gpus"],
            "overall": o,
            "closer_than_paper": o["mean_gap_pct"] <= p["gap_mean_pct"]
            and o["max_gap_pct"] <= p["gap_max_pct"],
            "speedup": o["oracle_ms_mean"] / max(o["heuristic_ms_mean"], 1e-6),
        }
    figures["chart"] = _plot_fig9(bench_ok, gap_ok, out)
    return figures


def _plot_fig9(bench: dict[str, Any] | None, gap: dict[str, Any] | None, out: Path) -> str:
    p = paper.FIG9
    plt = _pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(8, 3))
    if bench:
        gs = [r["gpus"] for r in bench["sizes"]]
        axes[0].loglog(gs, [r["p99_ms"] for r in bench["sizes"]], "o-", label="ours p99 (wall)")
        axes[0].loglog(gs, [r["mean_ms"] for r in bench["sizes"]], "s-", label="ours mean (wall)")
        axes[0].loglog(gs, [r["cpu_p99_ms"] for r in bench["sizes"]], "^-", label="ours p99 (CPU)")
        axes[0].scatter([64, 256], [15, 100], marker="v", color="red", label="paper upper bounds", zorder=5)
        axes[0].set_xlabel("GPUs")
        axes[0].set_ylabel("decision time (ms)")
        axes[0].legend(fontsize=6)
    if gap:
        ms = list(gap["by_gpus"])
        axes[1].bar(ms, [gap["by_gpus"][m]["mean_gap_pct"] for m in ms], label="ours mean")
        axes[1].plot(ms, [gap["by_gpus"][m]["max_gap_pct"] for m in ms], "kx", label="ours max")
        axes[1].axhline(p["gap_mean_pct"], color="red", ls="--", lw=1, label="paper mean 3.6 %")
        axes[1].axhline(p["gap_max_pct"], color="red", ls=":", lw=1, label="paper max 6.5 %")
        axes[1].set_xlabel("GPUs")
        axes[1].set_ylabel("gap to oracle (%)")
        axes[1].legend(fontsize=6)
    return _save(fig, out / "fig9_scheduler.png")


def table2_figures(data: dict[str, Any], out: Path, summary: dict[str, Any]) -> dict[str, Any]:
    units = _units(data, "table2/")
    if not units:
        return {"units": [], "errors": _errors(data, "table2/")}
    s = summary.get("table2", {})
    return {
        "units": list(units.values()),
        "gap_mean_pct": s.get("gap_mean_pct"),
        "gap_mean_abs_pct": s.get("gap_mean_abs_pct"),
        "chart": _plot_table2(units, out),
    }


def _plot_table2(units: dict[str, Any], out: Path) -> str:
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(6, 3))
    ks = list(units)
    xs = range(len(ks))
    ax.bar([x - 0.27 for x in xs], [units[k]["oracle_cost_usd"] for k in ks], 0.27, label="oracle")
    ax.bar(
        list(xs), [units[k]["runs"]["turboserve"]["cost_usd"] for k in ks], 0.27, label="TurboServe (ours)"
    )
    ax.bar(
        [x + 0.27 for x in xs],
        [units[k]["runs"]["turboserve-paper"]["cost_usd"] for k in ks],
        0.27,
        label="paper loop (ours)",
    )
    ax.set_xticks(list(xs), [units[k]["trace"] for k in ks])
    ax.set_ylabel("GPU cost ($)")
    ax.legend(fontsize=7)
    return _save(fig, out / "table2_autoscaling_oracle.png")


def table6_figures(data: dict[str, Any]) -> dict[str, Any] | None:
    u = data["units"].get("table6")
    if not u or u.get("error"):
        return None
    t = u["table"]
    seg = {s["level"]: s for s in t.get("profiled_segments", [])}
    rows = []
    for level, vol, lam, rho, valid, pass_rate, cost in paper.TABLE6:
        s = seg.get(level, {})
        rows.append(
            {
                "level": level,
                "ours": s,
                "pass_pct": 100 * s["pass_rate"] if "pass_rate" in s else None,
                "paper": {
                    "volatility": vol,
                    "lambda": lam,
                    "rho": rho,
                    "valid": valid,
                    "pass_pct": pass_rate * 100,
                    "cost": cost,
                },
            }
        )
    # Our level → ρ̂ mapping as bands of consecutive levels with the same ρ̂.
    bands: list[dict[str, Any]] = []
    for lv in t.get("levels", []):
        if bands and bands[-1]["rho_hat"] == lv["rho_hat"]:
            bands[-1]["levels"].append(lv["level"])
        else:
            bands.append({"rho_hat": lv["rho_hat"], "levels": [lv["level"]]})
    return {"path": u["path"], "table": t, "rows": rows, "bands": bands}


def tables8_10_figures(data: dict[str, Any], out: Path) -> dict[str, Any]:
    u = data["units"].get("tables8_10")
    if not u or u.get("error"):
        return {"unit": None, "error": u.get("error") if u else None}
    o, n = u["oracle"], u["online"]
    m = u.get("oracle_at_online_latency")
    p = paper.TABLES8_10
    windows = []
    for w in range(u["n_windows"]):
        in_paper = w < len(p["oracle_rho"])
        windows.append(
            {
                "n": w + 1,
                "oracle": o["windows"][w],
                "oracle_rho": o["rhos"][w],
                "matched": m["windows"][w] if m else {},
                "matched_rho": m["rhos"][w] if m else None,
                "online": n["windows"][w],
                "paper": {
                    "oracle_rho": p["oracle_rho"][w],
                    "ours_rho": p["ours_rho"][w],
                    "oracle_budget": p["oracle_budgets"][w],
                    "ours_budget": p["ours_budgets"][w],
                }
                if in_paper
                else None,
            }
        )

    def totals(x: dict[str, Any] | None) -> dict[str, Any] | None:
        if not x:
            return None
        return {
            "cost_usd": x["cost_usd"],
            "mean_ms": x["mean_ms"],
            "worst_ms": x["worst_ms"],
            "meets_slo": x["meets_slo"],
            "slo_pass_pct": 100 * x["slo_pass_rate"],
        }

    gap_m = u.get("gap_at_online_latency_pct")
    return {
        "unit": u,
        "oracle": o,
        "has_matched": bool(m),
        "windows": windows,
        "totals": {"oracle": totals(o), "matched": totals(m), "online": totals(n)},
        "gap_pct": u["gap_pct"],
        "gap_at_online_latency_pct": gap_m,
        "online_windows_over_slo": [
            w + 1 for w, x in enumerate(n["windows"]) if (x.get("worst_ms") or 0) > u["slo_ms"]
        ],
        "online_cheaper_than_matched_oracle": gap_m is not None and gap_m < 0,
        "within_paper_gap": gap_m is not None and abs(gap_m) <= p["gap_pct"],
        "chart": _plot_tables8_10(o, n, m, u["n_windows"], out),
    }


def _plot_tables8_10(
    o: dict[str, Any], n: dict[str, Any], m: dict[str, Any] | None, nw: int, out: Path
) -> str:
    p = paper.TABLES8_10
    plt = _pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(9, 3))
    xs = list(range(nw))
    labels = [f"w{w + 1}" for w in xs]
    axes[0].plot(xs, o["rhos"], "o-", label="oracle@670 (ours)")
    if m:
        axes[0].plot(xs, m["rhos"], "d-", label="oracle@online latency (ours)")
    axes[0].plot(xs, [x["rho_mean"] for x in n["windows"]], "s-", label="online (ours)")
    axes[0].plot(xs, p["oracle_rho"][:nw], "o--", alpha=0.5, label="oracle (paper)")
    axes[0].plot(xs, p["ours_rho"][:nw], "s--", alpha=0.5, label="online (paper)")
    axes[0].set_ylabel("ρ̂")
    axes[0].set_xticks(xs, labels)
    axes[0].legend(fontsize=6)
    axes[1].plot(xs, [x.get("budget_end") for x in o["windows"]], "o-", label="oracle@670 (ours)")
    if m:
        axes[1].plot(
            xs, [x.get("budget_end") for x in m["windows"]], "d-", label="oracle@online latency (ours)"
        )
    axes[1].plot(xs, [x.get("budget_end") for x in n["windows"]], "s-", label="online (ours)")
    axes[1].plot(xs, p["oracle_budgets"][:nw], "o--", alpha=0.5, label="oracle (paper)")
    axes[1].plot(xs, p["ours_budgets"][:nw], "s--", alpha=0.5, label="online (paper)")
    axes[1].set_ylabel("window-end GPUs")
    axes[1].set_xticks(xs, labels)
    axes[1].legend(fontsize=6)
    return _save(fig, out / "tables8_10_rho_oracle.png")


def _sweep_row(u: dict[str, Any]) -> dict[str, Any]:
    return {
        "trace": u["trace"],
        "profile": u["profile"],
        "delay_s": u.get("provisioning_delay_s"),
        "par": u["shape"]["par"],
        "turboserve_cost": u["policies"]["turboserve"].get("cost_at_slo_usd"),
        "reductions": _reductions(u),
    }


def sweep_figures(data: dict[str, Any], out: Path) -> dict[str, Any]:
    delay = _units(data, "sweep/delay/")
    shape = _units(data, "sweep/shape/")
    if not delay and not shape:
        return {"delay": [], "shape": []}
    fig7 = _units(data, "fig7/")
    by_trace = [
        {
            "trace": trace,
            "points": [
                {"delay_s": u["provisioning_delay_s"], "cost_pct": u["reduction_vs"]["lag"].get("cost_pct")}
                for u in sorted(
                    (u for u in delay.values() if u["trace"] == trace),
                    key=lambda u: u["provisioning_delay_s"],
                )
            ],
        }
        for trace in sorted({u["trace"] for u in delay.values()})
    ]
    bursty = next((u for u in shape.values() if u["trace"] == "bursty"), None)
    bursty_red = bursty["reduction_vs"]["lag"].get("cost_pct") if bursty else None
    return {
        "delay": [
            _sweep_row(u)
            for u in sorted(delay.values(), key=lambda u: (u["trace"], u["provisioning_delay_s"]))
        ],
        "shape": [_sweep_row(u) for u in shape.values()],
        "fig7": [_sweep_row(u) for u in fig7.values()],
        "delay_by_trace": by_trace,
        "shape_by_par": [
            {
                "trace": u["trace"],
                "par": u["shape"]["par"],
                "cost_pct": u["reduction_vs"]["lag"].get("cost_pct"),
            }
            for u in sorted(shape.values(), key=lambda u: u["shape"]["par"] or 0)
        ],
        "bursty_loses": bursty_red is not None and bursty_red < 0,
        "chart": _plot_sweep(delay, shape, fig7, out),
    }


def _plot_sweep(delay: dict[str, Any], shape: dict[str, Any], fig7: dict[str, Any], out: Path) -> str:
    plt = _pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(9, 3))
    if delay:
        for trace in sorted({u["trace"] for u in delay.values()}):
            us = sorted(
                [u for u in delay.values() if u["trace"] == trace], key=lambda u: u["provisioning_delay_s"]
            )
            for b, m in (("base", "o-"), ("lag", "s-")):
                axes[0].plot(
                    [u["provisioning_delay_s"] for u in us],
                    [u["reduction_vs"][b].get("cost_pct") for u in us],
                    m,
                    label=f"{trace} vs {b}",
                )
        axes[0].set_xlabel("provisioning delay (s)")
        axes[0].set_ylabel("cost reduction at SLO (%)")
        axes[0].axhline(0, color="grey", lw=0.5)
        axes[0].legend(fontsize=6)
    pts = list(shape.values()) + list(fig7.values())
    for b, m in (("base", "o"), ("lag", "s")):
        xs = [u["shape"]["par"] for u in pts if u["reduction_vs"][b].get("cost_pct") is not None]
        ys = [
            u["reduction_vs"][b]["cost_pct"] for u in pts if u["reduction_vs"][b].get("cost_pct") is not None
        ]
        axes[1].scatter(xs, ys, marker=m, label=f"vs {b}")
    axes[1].set_xlabel("peak-to-average ratio of active sessions")
    axes[1].set_ylabel("cost reduction at SLO (%)")
    axes[1].axhline(0, color="grey", lw=0.5)
    axes[1].legend(fontsize=6)
    return _save(fig, out / "sweep_dependencies.png")


def fig7_delay_figures(data: dict[str, Any], out: Path, summary: dict[str, Any]) -> dict[str, Any] | None:
    by_delay = summary.get("fig7_by_delay")
    units = _units(data, "fig7delay/")
    if not by_delay or not units:
        return None
    delays = [
        {"delay": d, "instant": d not in ("profile", "peer") and float(d) == 0, "summary": s}
        for d, s in by_delay.items()
    ]
    fig7 = _units(data, "fig7/")
    keyed: dict[tuple[str, str], list[tuple[float, dict[str, Any]]]] = {}
    for u in units.values():
        keyed.setdefault((u["trace"], u["profile"]), []).append((u["provisioning_delay_s"], u))
    per_unit = []
    for (trace, profile), us in sorted(keyed.items()):
        own = fig7.get(f"fig7/{trace}/{profile}")
        if own:
            us = [*us, (own["provisioning_delay_s"], own)]
        peer = _units(data, "fig7peer/").get(f"fig7peer/{trace}/{profile}")
        for delay, u in sorted(us, key=lambda x: x[0]):
            per_unit.append(
                {
                    "trace": trace,
                    "profile": profile,
                    "delay_s": delay,
                    "peer": False,
                    "turboserve": _policy(u["policies"]["turboserve"]),
                    "reductions": _reductions(u),
                }
            )
        if peer:
            got = peer["policies"]["turboserve"].get("scale_out") or {}
            per_unit.append(
                {
                    "trace": trace,
                    "profile": profile,
                    "delay_s": got.get("delay_s_mean"),
                    "peer": True,
                    "turboserve": _policy(peer["policies"]["turboserve"]),
                    "reductions": _reductions(peer),
                }
            )
    instant, own, peer_row = by_delay.get("0"), by_delay.get("profile"), by_delay.get("peer")
    return {
        "delays": delays,
        "units": per_unit,
        "instant": instant,
        "own": own,
        "peer": peer_row,
        "peer_cost_met": bool(
            peer_row and _met(peer_row["cost_reduction_mean_pct"], paper.FIG7["cost_reduction_mean_pct"])
        ),
        "peer_latency_met": bool(
            peer_row
            and _met(peer_row["latency_reduction_mean_pct"], paper.FIG7["latency_reduction_mean_pct"])
        ),
        "instant_cost_met": bool(
            instant and _met(instant["cost_reduction_mean_pct"], paper.FIG7["cost_reduction_mean_pct"])
        ),
        "instant_latency_met": bool(
            instant and _met(instant["latency_reduction_mean_pct"], paper.FIG7["latency_reduction_mean_pct"])
        ),
        "chart": _plot_fig7_delay(by_delay, out),
    }


def _plot_fig7_delay(by_delay: dict[str, dict[str, Any]], out: Path) -> str:
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(6.5, 3.4))
    pts = [(float(d), s) for d, s in by_delay.items() if d not in ("profile", "peer")]
    if "profile" in by_delay:
        pts.append((30.0, by_delay["profile"]))
    peer = by_delay.get("peer")
    if peer and peer["delays"]["mean_s"] is not None:
        x = peer["delays"]["mean_s"]
        ax.plot(
            [x], [peer["cost_reduction_mean_pct"]], "D", color="C0", label=f"peer scale-out (mean {x:.1f} s)"
        )
        ax.plot([x], [peer["latency_reduction_mean_pct"]], "D", color="C1")
    pts.sort(key=lambda x: x[0])
    xs = [p[0] for p in pts]
    ax.plot(xs, [p[1]["cost_reduction_mean_pct"] for p in pts], "o-", label="cost red. at matched latency")
    ax.plot(xs, [p[1]["latency_reduction_mean_pct"] for p in pts], "s-", label="latency red. at matched cost")
    ax.axhline(37.2, color="C0", ls="--", lw=0.8, label="paper 37.2 % / 37.5 %")
    ax.axhline(37.5, color="C1", ls="--", lw=0.8)
    ax.axhline(0, color="grey", lw=0.5)
    ax.set_xlabel("provisioning delay (s; 30 = profiles' own, 7B units 45 s)")
    ax.set_ylabel("mean reduction vs base/LAG/MAG (%)")
    ax.legend(fontsize=6)
    fig.tight_layout()
    return _save(fig, out / "fig7_by_delay.png")


def fig7_forecast_figures(data: dict[str, Any], summary: dict[str, Any]) -> dict[str, Any] | None:
    """Section 10: every Fig. 7 cell with the predictive floor beside TurboServe without it and the
    baselines. "Without the floor" is the fig7 experiment (same cells, protocol and delay); each ETS
    unit also reruns TurboServe without the floor, whose cost at the SLO must equal fig7's."""
    by_forecast = summary.get("fig7_forecast")
    units = _units(data, "fig7forecast/")
    if not by_forecast or not units:
        return None
    fig7 = _units(data, "fig7/")
    without = summary["fig7"]
    without_cells = {tuple(c) for c in without.get("baseline_win_cells", [])}
    planned = [
        u.key
        for u in plan(quick=data["meta"]["quick"], seed=data["meta"]["seed"], experiments=["fig7forecast"])
    ]
    rows = []
    for name, s in by_forecast.items():
        cells = {tuple(c) for c in s["baseline_win_cells"]}
        delay = {(u["trace"], u["profile"]): u["provisioning_delay_s"] for u in units.values()}
        # Cells compared with fig7 only where this forecaster's unit ran (a run cut short has fewer).
        ran = {(u["trace"], u["profile"]) for k, u in units.items() if k.endswith(f"/{name}")}
        before = {c for c in without_cells if c[:2] in ran}
        rows.append(
            {
                "forecast": name,
                "summary": s,
                "cells_compared": len(ran),
                "wins_without": len(before),
                "wins_removed": sorted(" ".join(c) for c in before - cells),
                "wins_added": sorted(" ".join(c) for c in cells - before),
                # The issue's target names a 30 s boot: the 1.3B profiles' own (the 7B ones boot in 45 s).
                "wins_at_30s": len([c for c in cells if delay.get(tuple(c[:2])) == 30.0]),
                "wins_without_at_30s": len([c for c in before if delay.get(c[:2]) == 30.0]),
                "cells_at_30s": len([c for c in ran if delay.get(c) == 30.0]),
                "target_met": len(ran) == len({(u["trace"], u["profile"]) for u in fig7.values()})
                and not cells,
                "latency_met": _met(
                    s["latency_reduction_mean_pct"], paper.FIG7["latency_reduction_mean_pct"]
                ),
                "cost_met": _met(s["cost_reduction_mean_pct"], paper.FIG7["cost_reduction_mean_pct"]),
            }
        )
    per_unit = []
    mismatched = []
    for key, u in units.items():
        name = key.rsplit("/", 1)[1]
        own = fig7.get(f"fig7/{u['trace']}/{u['profile']}")
        floor = u["policies"][FORECAST_REFERENCE]
        no_floor = u["policies"].get("turboserve")
        if no_floor is None:  # seasonal-naive units reuse the ETS unit's (or fig7's) run without the floor
            ets = units.get(key.rsplit("/", 1)[0] + "/ets")
            no_floor = (ets or {}).get("policies", {}).get("turboserve") or (own or {}).get(
                "policies", {}
            ).get("turboserve")
        elif own and no_floor.get("cost_at_slo_usd") != own["policies"]["turboserve"].get("cost_at_slo_usd"):
            mismatched.append(key)
        vs_no_floor = u["reduction_vs"].get("turboserve", {})
        cost_vs = vs_no_floor.get("cost_pct")
        if cost_vs is None and no_floor and floor.get("meets_slo") and no_floor.get("meets_slo"):
            ref = no_floor["cost_at_slo_usd"]
            cost_vs = round((ref - floor["cost_at_slo_usd"]) / ref * 100.0, 2) if ref else None
        cell = (u["trace"], u["profile"])
        wins = [c for c in by_forecast[name]["baseline_win_cells"] if tuple(c[:2]) == cell]
        fc = floor.get("forecast") or {}
        per_unit.append(
            {
                "trace": u["trace"],
                "profile": u["profile"],
                "delay_s": u["provisioning_delay_s"],
                "forecast": name,
                "floor": _policy(floor),
                "no_floor": _policy(no_floor or {}),
                "cost_vs_no_floor_pct": cost_vs,
                "latency_vs_no_floor_pct": vs_no_floor.get("latency_pct"),
                "reductions": _reductions(u),
                "wins_with": len(wins),
                "wins_without": len([c for c in without_cells if c[:2] == cell]),
                "accuracy_eq12": fc.get("accuracy_eq12"),
                "mape_pct": fc.get("mape_pct"),
                "slots": fc.get("slots"),
                "floor_gpus_max": fc.get("floor_gpus_max"),
                "season_longer_than_trace": bool(fc.get("season_s"))
                and fc.get("season_s", 0) > u["duration_s"],
                "wall_s": u["unit"]["wall_s"],
            }
        )
    per_unit.sort(key=lambda r: (r["trace"], r["profile"], r["forecast"] != "ets", r["forecast"]))
    for row in rows:
        # Cost at the SLO with the floor against without it, over cells where both meet the SLO.
        changes = [
            u["cost_vs_no_floor_pct"]
            for u in per_unit
            if u["forecast"] == row["forecast"] and u["cost_vs_no_floor_pct"] is not None
        ]
        row["cost_higher"] = len([c for c in changes if c < 0])
        row["cost_same"] = len([c for c in changes if c == 0])
        row["cost_lower"] = len([c for c in changes if c > 0])
    return {
        "rows": rows,
        "without": without,
        "units": per_unit,
        "missing": [k for k in planned if k not in data["units"]],
        "failed": _errors(data, "fig7forecast/"),
        "no_floor_mismatched": mismatched,
        "season_longer_than_trace": any(r["season_longer_than_trace"] for r in per_unit),
        "trace_s_max": max(u["duration_s"] for u in units.values()),
    }


def seed_figures(data: dict[str, Any], out: Path, summary: dict[str, Any]) -> list[dict[str, Any]]:
    """The headline of this seed and of other seeds' exported summaries (``<out>/other_seeds``, same
    ``--quick``); empty when there are no others."""
    files = sorted((out / "other_seeds").glob("seed-*.json")) if (out / "other_seeds").is_dir() else []
    others = []
    for f in files:
        try:
            d = json.loads(f.read_text())
        except json.JSONDecodeError:
            continue
        if d["meta"].get("quick") == data["meta"]["quick"] and d["meta"].get("seed") != data["meta"]["seed"]:
            others.append(d)
    if not others:
        return []

    def row(meta: dict[str, Any], s: dict[str, Any], this: bool) -> dict[str, Any]:
        runs = meta.get("runs") or []
        return {
            "seed": meta["seed"],
            "this": this,
            "finished_utc": runs[-1]["finished_utc"] if runs else str(meta.get("finished_utc") or "?"),
            "from_runs": bool(runs),
            "core_commit": (runs[-1].get("core_commit") if runs else None) or meta.get("core_commit"),
            "fig7": s.get("fig7", {}),
            "no_migration": s.get("fig8", {}).get("turboserve-no-migration") or {},
            "no_autoscale": s.get("fig8", {}).get("turboserve-no-autoscale") or {},
            "fig9_gap": s.get("fig9_gap", {}),
            "table2": s.get("table2", {}),
            "tables8_10": s.get("tables8_10", {}),
        }

    return [
        row(data["meta"], summary, True),
        *(row(d["meta"], d["summary"], False) for d in sorted(others, key=lambda d: d["meta"]["seed"])),
    ]


# --------------------------------------------------------------------------------------------------


def render_report(out: Path, data: dict[str, Any], summary: dict[str, Any]) -> str:
    """The report's Markdown for ``data`` (with its ``summary``); draws the charts into ``out``."""
    context = {
        "out": str(out),
        "meta": data["meta"],
        "runs": run_figures(data),
        "paper": {
            "fig4": paper.FIG4,
            "fig7": paper.FIG7,
            "fig8": paper.FIG8,
            "fig9": paper.FIG9,
            "table2": paper.TABLE2,
            "tables8_10": paper.TABLES8_10,
        },
        "baselines": BASELINES,
        "headline": headline_figures(summary),
        "errors": _errors(data, ""),
        "fig4": fig4_figures(data, out),
        "fig7": fig7_figures(data, out, summary),
        "fig8": fig8_figures(data, out, summary),
        "fig9": fig9_figures(data, out),
        "table2": table2_figures(data, out, summary),
        "table6": table6_figures(data),
        "tables8_10": tables8_10_figures(data, out),
        "sweep": sweep_figures(data, out),
        "fig7_delay": fig7_delay_figures(data, out, summary),
        "fig7_forecast": fig7_forecast_figures(data, summary),
        "seeds": seed_figures(data, out, summary),
        "unit_times": [
            {"key": k, "wall_s": v.get("unit", {}).get("wall_s")} for k, v in sorted(data["units"].items())
        ],
    }
    return _environment().get_template("reproduce/report.md").render(context)


def write_report(out: str | Path, data: dict[str, Any]) -> Path:
    out = Path(out)
    summary = summarise(data)
    data["summary"] = summary
    (out / "results.json").write_text(json.dumps(data, indent=1, default=str))
    path = out / "README.md"
    path.write_text(render_report(out, data, summary))
    return path
