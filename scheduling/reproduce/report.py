"""Markdown + PNG writer for the reproduction (everything from ``results.json``; no simulation here)."""

from __future__ import annotations

import math
from pathlib import Path
from statistics import mean
from typing import Any

from . import paper
from .experiments import EXPERIMENTS

BASELINES = ("base", "lag", "mag")


# --------------------------------------------------------------------------------------------------
# formatting helpers


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


def _table(header: list[str], rows: list[list[Any]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for r in rows:
        lines.append("| " + " | ".join(str(c) for c in r) + " |")
    return "\n".join(lines)


def _mean(xs: list[float]) -> float | None:
    xs = [x for x in xs if x is not None]
    return round(mean(xs), 2) if xs else None


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


def _errors(data: dict[str, Any], prefix: str) -> list[str]:
    return [
        f"`{k}`: {v['error']}"
        for k, v in sorted(data["units"].items())
        if k.startswith(prefix) and v.get("error")
    ]


# --------------------------------------------------------------------------------------------------
# summaries (also stored in results.json under "summary")


def _fig7_summary(units: dict[str, Any]) -> dict[str, Any]:
    """Mean reductions, baseline wins and SLO misses over a set of §7.1 comparison units."""
    lat, cost, losses, no_slo, ts_no_slo = [], [], [], [], []
    lat_ok: list[float] = []
    for key, u in units.items():
        if not u["policies"]["turboserve"].get("meets_slo"):
            ts_no_slo.append(key)
        for b in BASELINES:
            red = u["reduction_vs"].get(b, {})
            if red.get("latency_pct") is not None:
                lat.append(red["latency_pct"])
                if u["policies"]["turboserve"].get("meets_slo"):
                    lat_ok.append(red["latency_pct"])
                if red["latency_pct"] < 0:
                    losses.append(f"{key} latency vs {b} ({-red['latency_pct']:.1f} % higher)")
            if red.get("cost_pct") is not None:
                cost.append(red["cost_pct"])
                if red["cost_pct"] < 0:
                    losses.append(f"{key} cost vs {b} ({-red['cost_pct']:.1f} % higher)")
            elif u["policies"][b].get("meets_slo") is False and u["policies"]["turboserve"].get("meets_slo"):
                no_slo.append(f"{key} {b}")
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
        "turboserve_misses_slo": ts_no_slo,
        "baseline_wins": losses,
    }


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


def _fig7_by_delay(data: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """The Fig. 7 summary per provisioning delay: the fig7delay units grouped by their delay, and the
    fig7 units (each profile's own delay) under ``"profile"``."""
    groups: dict[str, dict[str, Any]] = {}
    for key, u in _units(data, "fig7delay/").items():
        groups.setdefault(f"{u['provisioning_delay_s']:g}", {})[key] = u
    out = {
        d: {**_fig7_summary(groups[d]), "fig8": _fig8_summary(groups[d])} for d in sorted(groups, key=float)
    }
    fig7 = _units(data, "fig7/")
    if out and fig7:
        out["profile"] = {**_fig7_summary(fig7), "fig8": _fig8_summary(fig7)}
    return out


def summarise(data: dict[str, Any]) -> dict[str, Any]:
    s: dict[str, Any] = {}
    fig7 = _units(data, "fig7/")
    s["fig7"] = _fig7_summary(fig7)
    by_delay = _fig7_by_delay(data)
    if by_delay:
        s["fig7_by_delay"] = by_delay
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


def _short(name: str) -> str:
    return {
        "scheduling.reproduce.policies:NoHeadroom": "turboserve-no-headroom",
        "scheduling.reproduce.policies:NoCooldown": "turboserve-no-cooldown",
        "scheduling.reproduce.policies:WithScaleInWindow": "turboserve-scale-in-window",
    }.get(name, name)


# --------------------------------------------------------------------------------------------------
# sections


def section_fig4(data: dict[str, Any], out: Path) -> str:
    head = "## 1. Motivation study (§3.2, Fig. 4)\n\n"
    units = {k: v for k, v in sorted(data["units"].items()) if k == "fig4" or k.startswith("fig4/")}
    if not units:
        return head + "Not run.\n"
    md = head
    for key, u in units.items():
        if u.get("error"):
            md += f"`{key}` failed: {u['error']}.\n\n"
            continue
        md += _fig4_unit(key, u, out)
    md += (
        "\nDifferences in set-up and why A1 buys little here: the paper's A1 rebalances every 10 s; ours rebalances "
        "on every event (the TurboServe placement controller, migration-aware with κ). More importantly, in our model "
        "every policy suspends a session the moment it goes idle and re-places it when it resumes, so with sessions "
        "of equal cost least-loaded assignment keeps GPUs within about one session of each other and the worst "
        "chunk is set by ⌈active / GPUs⌉ at the peak — which no migration can lower. Imbalance (and with it what "
        "migration buys) needs sessions of unequal cost, which the mixed-load variant tests: "
        + _fig4_mixed_reading(units)
        + " The paper's production "
        "trace is not published, so whether its 26.53 % came from unequal sessions, from sessions staying resident "
        "while idle, or from a slower base cannot be checked. Our trace is generated to match Table 11's per-span "
        "arrivals, departures and average active sessions; the H100 profile is our calibration "
        "(docs/scheduling.md), so absolute latencies and dollars differ. Holding the autoscalers to the fixed pool's "
        "own worst chunk is strict when that pool is balanced (any burst during a 30 s boot breaks it): at the "
        "profile's SLO the same autoscalers save far more (rows \"at the profile's SLO\").\n"
    )
    return md


def _fig4_mixed_reading(units: dict[str, Any]) -> str:
    u = units.get("fig4/mixed")
    if not u or u.get("error"):
        return "(not run)."
    a1 = u["rows"]["migration"]
    change = a1.get("latency_pct")
    if change is not None and change < 0:
        return f"there A1 lowers the base's worst chunk by {-change:.1f} % ({a1['migrations']} migrations)."
    base = u["rows"]["base"]
    return (
        f"even there A1 does not lower the base's worst chunk ({_pct(change)}, {a1['migrations']} migrations; p99 "
        f"{_f(base['p99_ms'], 0)} → {_f(a1['p99_ms'], 0)} ms): each "
        "move adds its κ stall to the moved session's next chunk, and least-loaded placement of every resumed session "
        "already repairs most imbalance. That migration does not pay on these traces is a finding about our "
        "placement controller under this workload model; it is reported, not tuned away."
    )


def _fig4_unit(key: str, u: dict[str, Any], out: Path) -> str:
    rows = u["rows"]
    p = paper.FIG4
    mix = u.get("load_mix")
    what = (
        "sessions of equal cost (load 1.0), as in our T1–T6"
        if not mix
        else "mixed per-session load "
        + ", ".join(f"{w * 100:.0f} % at {load:g}" for load, w in mix)
        + " (an assumption)"
    )
    md = (
        f"**{key}** — Table-11-shaped trace (`generators.paper_trace('table11', seed)`, {u['duration_s']:.0f} s, "
        f"peak {u['shape']['peak_active']} / mean {u['shape']['mean_active']:.1f} active, PAR {u['shape']['par']}), "
        f"{what}; profile `{u['profile']}`, {u['gpus']} GPUs. A2/A3 run their cheapest configuration "
        f"(`compare.autoscaler_for_slo`) whose worst chunk stays within the base's worst ({u['slo_for_autoscalers_ms']:.0f} ms), "
        'as in the paper (A2 "maintaining the worst-case latency within 0.71 s"). Paper base: 0.71 s worst, 3.99 $.\n\n'
    )
    labels = [
        ("base", "base (least-loaded on activation, fixed budget)", None, None),
        (
            "migration",
            "A1: + migration (TurboServe placement, fixed budget)",
            p["migration"]["latency_pct"],
            p["migration"]["cost_pct"],
        ),
        ("autoscaling", "A2: + autoscaling (no migration)", "≤ base (0.71 s)", p["autoscaling"]["cost_pct"]),
        ("joint", "A3: joint (TurboServe)", p["joint"]["latency_pct"], p["joint"]["cost_pct"]),
        (
            "autoscaling_at_profile_slo",
            f"A2 at the profile's SLO ({u.get('profile_slo_ms', 0):.0f} ms)",
            "",
            "",
        ),
        ("joint_at_profile_slo", f"A3 at the profile's SLO ({u.get('profile_slo_ms', 0):.0f} ms)", "", ""),
        ("base_round_robin", "(extra) round-robin base", None, None),
    ]
    table = []
    for k, label, plat, pcost in labels:
        r = rows.get(k)
        if r is None:
            continue
        table.append(
            [
                label,
                r["config"],
                _f(r["worst_ms"], 0, " ms"),
                _f(r["p99_ms"], 0, " ms"),
                _f(r["cost_usd"], 3, " $"),
                r["migrations"],
                _pct(r.get("latency_pct"), 2),
                _pct(r.get("cost_pct"), 2),
                plat if isinstance(plat, str) else _pct(plat, 2),
                pcost if isinstance(pcost, str) else _pct(pcost, 2),
            ]
        )
    md += _table(
        [
            "variant",
            "configuration",
            "worst chunk",
            "p99 chunk",
            "cost",
            "migrations",
            "Δ latency (ours)",
            "Δ cost (ours)",
            "Δ latency (paper)",
            "Δ cost (paper)",
        ],
        table,
    )
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
    return md + f"\n\n![Fig. 4 {key}]({_save(fig, out / name)})\n\n"


def section_fig7(data: dict[str, Any], out: Path, summary: dict[str, Any]) -> str:
    head = "## 2. End-to-end comparison on T1–T6 (§7.1–7.2, Fig. 7)\n\n"
    units = _units(data, "fig7/")
    if not units:
        return head + "Not run.\n" + "\n".join(_errors(data, "fig7/"))
    md = head + (
        "Protocol: `scheduling.core.compare.compare_policies` (the §7.1 protocol). *Cost at matched latency*: "
        "each policy's cheapest configuration whose worst chunk meets the SLO (static policies: smallest fixed "
        "budget; autoscalers: adaptive table or fixed ρ̂ 0.9…0.4 × initial pool). *Latency at matched cost*: "
        "TurboServe at its cheapest SLO-meeting configuration; each static policy at the fixed budget whose "
        "cost is closest. Reductions are TurboServe's relative to the baseline (positive = TurboServe lower; "
        "– = the baseline never meets the SLO within the cluster, so it has no cost at that latency). "
        "T1–T3 run on the H20 profiles (16 GPUs, Cluster 1), T4–T6 on B300 (64 GPUs, Cluster 2); SLO = the "
        "profile's default, ℓ(K) plus one stall (the resume copy), so K is the load that meets it for every "
        "policy (`compare_policies(capacity='slo')`).\n\n"
    )
    rows = []
    for _key, u in units.items():
        pol = u["policies"]
        ts = pol["turboserve"]
        r = [
            u["trace"],
            u["profile"],
            _f(u["slo_ms"], 0),
            _f(u["shape"]["par"], 2),
            f"{_f(ts.get('cost_at_slo_usd'), 2)} ({ts.get('config_at_slo')})"
            if ts.get("meets_slo")
            else f"SLO missed ({_f(ts.get('worst_latency_at_slo_config_ms'), 0)} ms)",
            _f(ts.get("worst_latency_at_matched_cost_ms"), 0),
        ]
        for b in BASELINES:
            e = pol[b]
            red = u["reduction_vs"][b]
            r.append(
                f"{_f(e.get('cost_at_slo_usd'), 2)} [{e.get('budget_at_slo') or '–'}] / {_f(e.get('worst_latency_at_matched_cost_ms'), 0)} "
                f"({_pct(red.get('cost_pct'))} / {_pct(red.get('latency_pct'))})"
            )
        r.append(_f(u["unit"]["wall_s"], 0, " s"))
        rows.append(r)
    md += _table(
        ["trace", "profile", "SLO ms", "PAR", "TurboServe cost@SLO $ (config)", "TurboServe worst@cost ms"]
        + [f"{b}: cost@SLO $ [GPUs] / worst@cost ms (cost red. / latency red.)" for b in BASELINES]
        + ["wall"],
        rows,
    )
    f = summary["fig7"]
    p = paper.FIG7
    md += "\n\n**Average reductions against base/LAG/MAG** (over every trace × profile × baseline with a value):\n\n"
    md += _table(
        ["metric", "ours mean", "ours max", "comparisons", "paper mean", "paper max", "target met?"],
        [
            [
                "worst-case latency at matched cost",
                _f(f["latency_reduction_mean_pct"], 1, " %"),
                _f(f["latency_reduction_max_pct"], 1, " %"),
                f["comparisons_latency"],
                f"{p['latency_reduction_mean_pct']} %",
                f"{p['latency_reduction_max_pct']} %",
                _yes(f["latency_reduction_mean_pct"], p["latency_reduction_mean_pct"]),
            ],
            [
                "worst-case latency at matched cost, only where TurboServe meets the SLO",
                _f(f["latency_reduction_mean_pct_where_turboserve_meets_slo"], 1, " %"),
                "",
                f["comparisons_latency_where_turboserve_meets_slo"],
                f"{p['latency_reduction_mean_pct']} %",
                "",
                _yes(
                    f["latency_reduction_mean_pct_where_turboserve_meets_slo"],
                    p["latency_reduction_mean_pct"],
                ),
            ],
            [
                "GPU cost at matched latency",
                _f(f["cost_reduction_mean_pct"], 1, " %"),
                _f(f["cost_reduction_max_pct"], 1, " %"),
                f["comparisons_cost"],
                f"{p['cost_reduction_mean_pct']} %",
                f"{p['cost_reduction_max_pct']} %",
                _yes(f["cost_reduction_mean_pct"], p["cost_reduction_mean_pct"]),
            ],
        ],
    )
    md += "\n\n"
    if f["baseline_never_meets_slo"]:
        md += (
            "Baselines that never meet the SLO within the cluster (TurboServe does; no cost figure, left out of "
            "the cost average — counting them would only raise it): "
            + ", ".join(f["baseline_never_meets_slo"])
            + ".\n\n"
        )
    if f["turboserve_misses_slo"]:
        md += (
            "TurboServe misses the SLO in every configuration tried on: "
            + ", ".join(f["turboserve_misses_slo"])
            + " — there the comparison has no matched-latency cost for anyone who also misses it.\n\n"
        )
    if f["baseline_wins"]:
        md += "**Where a baseline wins** (stated plainly): " + "; ".join(f["baseline_wins"]) + ".\n\n"
    else:
        md += "No baseline beats TurboServe on either metric on any trace here.\n\n"
    md += (
        "Why our figures differ from the paper's, and why baselines win where they do:\n\n"
        "1. *Traces.* Our T1–T6 are generated to reproduce Table 12's per-minute arrivals, departures and average "
        "active sessions, not the production traces; the paper publishes only averages and one per-trace example, "
        "so only averages can be compared.\n"
        "2. *Little off-peak to save.* An autoscaler saves only the off-peak. These traces last 5 minutes and most "
        "ramp up within the first 1–2 minutes (PAR 1.3–2.1); a fixed pool sized for the peak is then close to "
        "optimal, while the autoscaler pays 30–45 s of paid boot on every scale-out, must absorb the ramp with GPUs "
        "that are not ready yet, and therefore needs headroom (a lower ρ̂) or a warm start — which it then pays for "
        "over the whole trace. The traces where a baseline wins on cost (listed above) are the ones whose ramp is "
        "steepest relative to one provisioning delay; the provisioning-delay sweep (section 8) shows the same "
        "dependency directly.\n"
        "3. *K and the SLO agree.* The SLO is ℓ(K) plus one stall (the resume copy), and K follows the SLO under "
        "test (`compare_policies(capacity='slo')`: the largest load whose chunk, one stall included, still meets "
        "it). So no policy meets the SLO with more than K per GPU at the peak, and the autoscaler's ρ̂ is a "
        "fraction of that same K, as in the paper's §5.1. (Reports before 2026-11-22 used SLO = 1.1 × ℓ(K) with "
        "the profile's K, which let a static pool run its GPUs above the K the autoscaler was held below; making "
        "them consistent did not favour TurboServe — the 10 % slack had also absorbed its bursts while GPUs "
        "booted.)\n"
        "4. *Least-loaded baselines are already balanced.* Every policy suspends a session when it goes idle and "
        "re-places it when it resumes, and all sessions have the same cost, so `lag`/`mag` stay within about one "
        "session of perfect balance; migration has little imbalance to remove (section 1, mixed-load variant), and "
        "the latency gains at matched cost are small except against round-robin `base`. `lag` and `mag` coincide "
        "because every session has the same load and state size.\n"
        "5. *Overloaded clusters.* With the 7B profiles, T2/T3 (16 H20, K = 6) and T5/T6 (64 B300, K = 10) exceed "
        "the cluster's capacity at the peak, so no policy meets the SLO; the autoscaler, capped at the same M_max "
        "but growing to it through boot delays, can then be worse than a static pool holding every GPU from t = 0 "
        '(T2/h20-7b). These units count in the all-units latency average and not in the "only where TurboServe meets the SLO" row.\n'
        "6. *Profiles.* Our curves are linear, calibrated to Table 4's mean chunk latencies; the latency at matched "
        "cost depends on the slope of ℓ(load) beyond K, which the paper does not give.\n"
    )
    md += f"\n![Fig. 7]({_plot_fig7(units, out)})\n"
    return md


def _yes(ours: float | None, target: float) -> str:
    if ours is None:
        return "no figure"
    return "met" if ours >= target else "missed"


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


def section_fig8(data: dict[str, Any], out: Path, summary: dict[str, Any]) -> str:
    head = "## 3. Ablation (§7.3, Fig. 8) and what the beyond-the-paper extensions buy\n\n"
    units = _units(data, "fig7/")
    if not units:
        return head + "Not run.\n"
    names = []
    for u in units.values():
        for n in u["policies"]:
            if n not in ("turboserve", *BASELINES) and n not in names:
                names.append(n)
    rows = []
    for _key, u in units.items():
        ts = u["policies"]["turboserve"].get("cost_at_slo_usd")
        r = [u["trace"], u["profile"], _f(ts, 3)]
        for n in names:
            e = u["policies"].get(n)
            if e is None:
                r.append("")
                continue
            c = e.get("cost_at_slo_usd")
            inc = round((c - ts) / ts * 100.0, 1) if (c and ts) else None
            if c:
                r.append(f"{_f(c, 3)} ({_pct(inc)})")
            elif e.get("worst_latency_at_slo_config_ms") is not None:
                r.append(f"SLO missed ({_f(e['worst_latency_at_slo_config_ms'], 0)} ms)")
            else:
                r.append(f"SLO missed even at {u['max_gpus']} GPUs")
        rows.append(r)
    md = head + (
        "Cost at matched latency (the same §7.1 search) of each variant, and its change relative to full TurboServe "
        "(positive = the variant costs more). `turboserve-no-headroom`/`-no-cooldown` switch off one extension and "
        "`turboserve-scale-in-window` switches on the opt-in scale-in stabilisation window (policies in "
        "`scheduling/reproduce/policies.py`, run by dotted path); `turboserve-paper` is the paper's loop without "
        "headroom, cooldown and release grace.\n\n"
    )
    md += _table(["trace", "profile", "TurboServe $"] + [_short(n) for n in names], rows)
    s = summary["fig8"]
    p = paper.FIG8
    md += "\n\n"
    rows = []
    for n in names:
        e = s.get(_short(n))
        pm = {
            "turboserve-no-migration": (
                p["no_migration_cost_increase_mean_pct"],
                p["no_migration_cost_increase_max_pct"],
            ),
            "turboserve-no-autoscale": (
                p["no_autoscale_cost_increase_mean_pct"],
                p["no_autoscale_cost_increase_max_pct"],
            ),
        }.get(n)
        rows.append(
            [
                _short(n),
                _pct(e["mean_pct"]) if e else "–",
                _pct(e["max_pct"]) if e else "–",
                _pct(e["min_pct"]) if e else "–",
                e["n"] if e else 0,
                f"+{pm[0]} % (max +{pm[1]} %)" if pm else "(not in the paper)",
            ]
        )
    md += _table(["variant", "mean cost change", "max", "min", "traces with a value", "paper"], rows)
    md += (
        "\n\nA negative minimum means the variant was cheaper than full TurboServe at the SLO on some trace; the "
        "comparison searches each variant's own cheapest SLO-meeting configuration, so an extension that buys "
        "worst-case latency with cost shows up as a cost increase when it is switched *on*, i.e. a negative change "
        "here. Variants that never meet the SLO have no cost and are not averaged.\n"
    )
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
    md += f"\n![Fig. 8]({_save(fig, out / 'fig8_ablation.png')})\n"
    return md


def section_fig9(data: dict[str, Any], out: Path) -> str:
    md = "## 4. Scheduler time and placement-oracle gap (§7.4, Fig. 9)\n\n"
    bench = data["units"].get("fig9/bench")
    gap = data["units"].get("fig9/gap")
    p = paper.FIG9
    plt = _pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(8, 3))
    if bench and not bench.get("error"):
        md += (
            f"`scheduling.core.bench.bench_scheduler` (what `manage.py bench_scheduler` runs): profile `{bench['profile']}`, "
            f"{bench['events_per_size']} timed events per size, K sessions per GPU, ~70 % active. Wall time includes "
            "preemption by other processes on this shared 2-core box; CPU time is the process's own.\n\n"
        )
        rows = []
        for r in bench["sizes"]:
            paper_col = {64: "< 15 ms", 256: "< 100 ms"}.get(r["gpus"], "")
            target = {64: 1.0, 1024: 10.0}.get(r["gpus"])
            rows.append(
                [
                    r["gpus"],
                    f"{r['live_sessions']:,} / {r['active_sessions']:,}",
                    _f(r["mean_ms"], 3),
                    _f(r["p99_ms"], 3),
                    _f(r["max_ms"], 2),
                    _f(r["cpu_p99_ms"], 3),
                    paper_col,
                    (
                        f"p99 ≤ {target:g} ms: "
                        + (
                            "met"
                            if r["p99_ms"] <= target
                            else ("met in CPU time" if r["cpu_p99_ms"] <= target else "missed")
                        )
                    )
                    if target
                    else "",
                ]
            )
        md += _table(
            [
                "GPUs",
                "live / active sessions",
                "mean ms",
                "p99 ms",
                "max ms",
                "CPU p99 ms",
                "paper",
                "our target",
            ],
            rows,
        )
        gs = [r["gpus"] for r in bench["sizes"]]
        axes[0].loglog(gs, [r["p99_ms"] for r in bench["sizes"]], "o-", label="ours p99 (wall)")
        axes[0].loglog(gs, [r["mean_ms"] for r in bench["sizes"]], "s-", label="ours mean (wall)")
        axes[0].loglog(gs, [r["cpu_p99_ms"] for r in bench["sizes"]], "^-", label="ours p99 (CPU)")
        axes[0].scatter([64, 256], [15, 100], marker="v", color="red", label="paper upper bounds", zorder=5)
        axes[0].set_xlabel("GPUs")
        axes[0].set_ylabel("decision time (ms)")
        axes[0].legend(fontsize=6)
    else:
        md += f"Benchmark not available: {bench.get('error') if bench else 'not run'}.\n"
    md += "\n\n"
    if gap and not gap.get("error"):
        md += (
            f"Placement gap (`scheduling.core.oracles.gap.placement_gap`, what `manage.py oracle_gap` runs): "
            f"{gap['instances_per_size']} random heterogeneous instances per size, objective = bottleneck latency + "
            f"η·Σκ (η = {gap['eta']}), exact MILP (HiGHS) as the oracle.\n\n"
        )
        rows = []
        for m, r in gap["by_gpus"].items():
            rows.append(
                [
                    m,
                    _f(r["sessions_mean"], 0),
                    _f(r["mean_gap_pct"], 2, " %"),
                    _f(r["max_gap_pct"], 2, " %"),
                    _f(r["heuristic_ms_mean"], 2),
                    _f(r["oracle_ms_mean"], 0),
                    r["not_proven"],
                ]
            )
        o = gap["overall"]
        rows.append(
            [
                "all",
                _f(o["sessions_mean"], 0),
                f"**{_f(o['mean_gap_pct'], 2, ' %')}**",
                f"**{_f(o['max_gap_pct'], 2, ' %')}**",
                _f(o["heuristic_ms_mean"], 2),
                _f(o["oracle_ms_mean"], 0),
                o["not_proven"],
            ]
        )
        rows.append(["paper", "", f"{p['gap_mean_pct']} %", f"{p['gap_max_pct']} %", "", "", ""])
        md += _table(
            [
                "GPUs",
                "sessions",
                "mean gap",
                "max gap",
                "heuristic ms",
                "oracle ms",
                "oracle not proven optimal",
            ],
            rows,
        )
        closer = o["mean_gap_pct"] <= p["gap_mean_pct"] and o["max_gap_pct"] <= p["gap_max_pct"]
        md += (
            f"\n\nCloser to the placement oracle than the paper (mean ≤ 3.6 %, max ≤ 6.5 %): **{'met' if closer else 'missed'}**. "
            "The paper measures on Trace 1 snapshots; ours on random heterogeneous instances (two GPU types, mixed "
            "loads, a drifted prior placement), which is a harder mix for a greedy heuristic. Speed-up over the MILP: "
            f"{o['oracle_ms_mean'] / max(o['heuristic_ms_mean'], 1e-6):.0f}× on average (paper: > 10×).\n"
        )
        ms = list(gap["by_gpus"])
        axes[1].bar(ms, [gap["by_gpus"][m]["mean_gap_pct"] for m in ms], label="ours mean")
        axes[1].plot(ms, [gap["by_gpus"][m]["max_gap_pct"] for m in ms], "kx", label="ours max")
        axes[1].axhline(p["gap_mean_pct"], color="red", ls="--", lw=1, label="paper mean 3.6 %")
        axes[1].axhline(p["gap_max_pct"], color="red", ls=":", lw=1, label="paper max 6.5 %")
        axes[1].set_xlabel("GPUs")
        axes[1].set_ylabel("gap to oracle (%)")
        axes[1].legend(fontsize=6)
    else:
        md += f"Oracle gap not available: {gap.get('error') if gap else 'not run'}.\n"
    md += f"\n![Fig. 9]({_save(fig, out / 'fig9_scheduler.png')})\n"
    return md


def section_table2(data: dict[str, Any], out: Path, summary: dict[str, Any]) -> str:
    md = "## 5. Autoscaling vs the offline oracle (§7.4, Table 2)\n\n"
    units = _units(data, "table2/")
    if not units:
        return md + "Not run.\n" + "\n".join(_errors(data, "table2/"))
    md += (
        "Oracle: `scheduling.core.oracles.autoscaling.trace_autoscaling_oracle` — per 1-minute slot the minimum GPUs "
        "that keep the slot's peak active load ≤ K·ρ̂, then a DP over budgets that honours the provisioning delay "
        "(boot paid, serves nothing). Ours: the simulator running TurboServe at the same fixed ρ̂, price, delay and "
        "warm start (the oracle's first-slot budget). The oracle ignores latency; our worst chunk is listed beside it.\n\n"
    )
    rows = []
    for _key, u in units.items():
        ts, tp = u["runs"]["turboserve"], u["runs"]["turboserve-paper"]
        rows.append(
            [
                u["trace"],
                u["profile"],
                u["rho_hat"],
                _f(u["oracle_cost_usd"], 2),
                _f(ts["cost_usd"], 2),
                _pct(ts["gap_pct"]),
                f"{_f(ts['worst_ms'], 0)} / {_f(ts['slo_ms'], 0)}",
                _f(tp["cost_usd"], 2),
                _pct(tp["gap_pct"]),
                f"{_f(tp['worst_ms'], 0)}",
            ]
        )
    p = paper.TABLE2
    for i, t in enumerate(p["traces"]):
        rows.append(
            [
                f"paper {t}",
                "B300 (Cluster 2)",
                "",
                p["oracle_usd"][i],
                p["turboserve_usd"][i],
                _pct(p["gap_pct"][i]),
                "",
                "",
                "",
                "",
            ]
        )
    md += _table(
        [
            "trace",
            "profile",
            "ρ̂",
            "oracle $",
            "TurboServe $",
            "vs oracle",
            "worst / SLO ms",
            "paper loop $",
            "vs oracle",
            "worst ms",
        ],
        rows,
    )
    s = summary.get("table2", {})
    md += (
        f"\n\nMean gap: ours {_pct(s.get('gap_mean_pct'))} (mean |gap| {_f(s.get('gap_mean_abs_pct'), 1, ' %')}); paper +6.1 % "
        "(the paper's 6.1 % is the mean of |+4.7|, |+8.3|, |−5.5|). Being *below* the oracle is possible: the oracle "
        "provisions each whole minute for its peak, while the online controller follows the load within the minute "
        "(and, unlike the oracle, may let latency rise above ℓ(K·ρ̂) — check the worst/SLO column). The extensions "
        "(headroom, cooldown, release grace) buy worst-case latency with GPU time, so full TurboServe sits further "
        "above this cost-only oracle than the paper's loop.\n"
    )
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
    md += f"\n![Table 2]({_save(fig, out / 'table2_autoscaling_oracle.png')})\n"
    return md


def section_table6(data: dict[str, Any]) -> str:
    md = "## 6. Volatility table (Appendix A, Tables 5–6)\n\n"
    u = data["units"].get("table6")
    if not u or u.get("error"):
        return md + "Not available.\n"
    t = u["table"]
    md += (
        f"The shipped `{u['path']}` (profile `{t['profile']}`, SLO {t['slo_ms']:.0f} ms, σ over {t['window_bins']} bins of "
        f"{t['bin_s']:g} s) was produced by `python manage.py profile_volatility`: the ten Table-5-shaped segments "
        "(`generators.segment_family`) are replayed through TurboServe at each ρ̂ ∈ {0.95, 0.90, …, 0.25} (warm start, "
        "only the 60 s segment measured); the cheapest ρ̂ whose worst chunk meets the SLO is kept; level edges are "
        "midpoints between segment volatilities and ρ̂ is made non-increasing with level. This report reads the table; "
        "it does not re-profile (run the command to regenerate it).\n\n"
    )
    seg = {s["level"]: s for s in t.get("profiled_segments", [])}
    rows = []
    for level, vol, lam, rho, valid, pr, cost in paper.TABLE6:
        s = seg.get(level, {})
        rows.append(
            [
                level,
                _f(s.get("volatility"), 2),
                vol,
                s.get("lambda", "–"),
                lam,
                s.get("rho_hat_monotone", s.get("rho_hat", "–")),
                rho,
                ("✓" if s.get("valid") else "✗") if s else "–",
                "✓" if valid else "✗",
                _f(100 * s["pass_rate"], 1, " %") if "pass_rate" in s else "–",
                f"{pr * 100:.0f} %",
                _f(s.get("worst_ms"), 0),
                _f(s.get("cost_usd"), 4),
                cost,
            ]
        )
    md += _table(
        [
            "level",
            "σ ours",
            "σ paper",
            "λ ours",
            "λ paper",
            "ρ̂ ours",
            "ρ* paper",
            "valid ours",
            "valid paper",
            "pass ours",
            "pass paper",
            "worst ms ours",
            "cost ours $ (60 s)",
            "avg. cost paper",
        ],
        rows,
    )
    md += "\n\n" + _table6_reading(t) + "\n"
    return md


def _table6_reading(t: dict[str, Any]) -> str:
    levels = t.get("levels", [])
    bands: list[tuple[float, list[int]]] = []
    for lv in levels:
        if bands and bands[-1][0] == lv["rho_hat"]:
            bands[-1][1].append(lv["level"])
        else:
            bands.append((lv["rho_hat"], [lv["level"]]))
    ours = ", ".join(
        f"{r:g} (levels {ls[0]}–{ls[-1]})" if len(ls) > 1 else f"{r:g} (level {ls[0]})" for r, ls in bands
    )
    return (
        f"Our mapping: ρ̂ = {ours}; the paper's: 0.80 (1–2), 0.65 (3–5), 0.50 (6–8), 0.25 (9–10). Both are "
        "non-increasing in volatility, but ours stays denser. Why: our segments are generated to Table 5's "
        "volatility and session counts at the Appendix-A scale (K = 5, 16 GPUs) and replayed on our paper-k5 "
        "profile, whose latency slope decides how much overload 670 ms tolerates; and our controller adds "
        "headroom from the expected net activations within one provisioning delay (an extension), so part of "
        "the burst margin the paper obtains by lowering ρ* comes from that term instead. λ is 0.2 at every "
        "level, as in the paper (adaptation is through ρ̂). Costs are our simulated dollars for the 60 s "
        "segment; the paper's are in its own units."
    )


def section_tables8_10(data: dict[str, Any], out: Path) -> str:
    md = "## 7. Per-window ρ̂ oracle vs the online mapping (Appendix A, Tables 7–10)\n\n"
    u = data["units"].get("tables8_10")
    if not u or u.get("error"):
        return md + f"Not available: {u.get('error') if u else 'not run'}.\n"
    o, n = u["oracle"], u["online"]
    m = u.get("oracle_at_online_latency")
    p = paper.TABLES8_10
    md += (
        f"Trace: `generators.table7_windows(seed)` ({u['n_windows']} windows of {u['window_s']:.0f} s with Table 7's "
        f"average/max active sessions), profile `{u['profile']}` (K = 5, memory for 10 sessions per GPU), 16 GPUs "
        f"max, {u['initial_gpus']} warm at t = 0, SLO {u['slo_ms']:.0f} ms. Oracle: "
        "`oracles.autoscaling.per_window_rho_oracle` (greedy in time order with full knowledge, then coordinate "
        f"passes; {o['evaluations']} replays, {o['search_s']:.0f} s) over ρ̂ ∈ {{0.50, 0.55, …, 0.95}}, each replay the "
        "TurboServe policy with ρ̂ switched per window (`scheduling.reproduce.policies.WindowRhoPolicy`; same "
        "placement, migration, autoscaler and extensions). Online: TurboServe with the shipped volatility table. "
        "Because neither reaches 670 ms here (below), the same oracle is also run with the online mapping's own "
        "worst chunk as its constraint — the cheapest per-window ρ̂ sequence that is no worse on worst-case latency.\n\n"
    )
    nw = u["n_windows"]
    rows = []
    for w in range(nw):
        ow, nw_ = o["windows"][w], n["windows"][w]
        mw = m["windows"][w] if m else {}
        pw = w < len(p["oracle_rho"])
        rows.append(
            [
                f"w{w + 1}",
                nw_.get("active_max"),
                o["rhos"][w],
                m["rhos"][w] if m else "–",
                p["oracle_rho"][w] if pw else "",
                _f(nw_["rho_mean"], 2),
                p["ours_rho"][w] if pw else "",
                ow.get("budget_end"),
                mw.get("budget_end", "–"),
                p["oracle_budgets"][w] if pw else "",
                nw_.get("budget_end"),
                p["ours_budgets"][w] if pw else "",
                f"{_f(ow.get('worst_ms'), 0)} / {_f(nw_.get('worst_ms'), 0)}",
            ]
        )
    md += "**Tables 8 and 10: ρ̂ and window-end GPU budget per window** (online ρ̂ = mean over the window's decisions)\n\n"
    md += _table(
        [
            "window",
            "max active",
            "oracle@670 ρ̂",
            "oracle@online-latency ρ̂",
            "paper oracle ρ*",
            "online ρ̂",
            "paper online ρ*",
            "oracle@670 GPUs",
            "oracle@online-latency GPUs",
            "paper oracle GPUs",
            "online GPUs",
            "paper online GPUs",
            "worst ms oracle@670 / online",
        ],
        rows,
    )
    md += "\n\n**Table 9: totals**\n\n"
    trows = [
        ["offline oracle, SLO 670 ms (ours)", o],
        ["offline oracle, online's worst latency (ours)", m],
        ["online mapping (ours)", n],
    ]
    body = []
    for label, x in trows:
        if not x:
            continue
        body.append(
            [
                label,
                _f(x["cost_usd"], 4, " $"),
                _f(x["mean_ms"], 1, " ms"),
                _f(x["worst_ms"], 1, " ms"),
                "yes" if x["meets_slo"] else "no",
                _f(100 * x["slo_pass_rate"], 2, " %"),
            ]
        )
    body.append(
        [
            "offline oracle (paper)",
            p["oracle_cost"],
            f"{p['oracle_avg_ms']} ms",
            f"{p['oracle_max_ms']} ms",
            "yes",
            "",
        ]
    )
    body.append(
        [
            "online mapping (paper)",
            p["ours_cost"],
            f"{p['ours_avg_ms']} ms",
            f"{p['ours_max_ms']} ms",
            "yes",
            "",
        ]
    )
    md += _table(["method", "cost", "mean lat.", "max lat.", "meets 670 ms", "chunks ≤ 670 ms"], body)
    gap = u["gap_pct"]
    gap_m = u.get("gap_at_online_latency_pct")
    md += (
        f"\n\nOnline cost vs the oracle: {_pct(gap, 2)} against the 670 ms oracle, {_pct(gap_m, 2)} against the oracle "
        f"held to the online mapping's worst chunk; paper +{p['gap_pct']} % (+{p['other_traces_gap_pct'][0]} % and "
        f"+{p['other_traces_gap_pct'][1]} % on two more traces). "
    )
    if not o["meets_slo"]:
        md += (
            "No per-window ρ̂ sequence meets 670 ms from this start, online or oracle. The online mapping's worst "
            "chunks are in "
            + ", ".join(
                f"w{w + 1}" for w, x in enumerate(n["windows"]) if (x.get("worst_ms") or 0) > u["slo_ms"]
            )
            + ", where active sessions jump after a calmer window in which the pool was scaled in; until new GPUs are ready (20 s) the ready ones take sessions up to their memory limit "
            "(10 > K = 5), and ℓ(10) plus the resume copy is ≈ 1.1 s. In the paper's set-up a GPU hosts at most five "
            "sessions, so the same burst would queue instead of slowing a GPU down; how the paper counts that "
            "wait is not stated. ρ̂ alone cannot fix a burst larger than the headroom one provisioning delay allows, "
            "which is why the matched-latency oracle is the fair comparison here. "
        )
    if gap_m is not None and gap_m < 0:
        md += (
            "A negative gap means the online mapping is cheaper than this oracle: the oracle is a greedy search (one "
            "window at a time, then coordinate passes) rather than an exhaustive one over 10¹⁰ sequences, and the "
            "online ρ̂ can change within a window. "
        )
    ok = gap_m is not None and abs(gap_m) <= p["gap_pct"]
    md += (
        f"Within the paper's 0.73 % of the oracle at equal worst latency: **{'met' if ok else 'missed'}**.\n"
    )
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
    md += f"\n![Tables 8–10]({_save(fig, out / 'tables8_10_rho_oracle.png')})\n"
    return md


def _sweep_reading(delay: dict[str, Any], shape: dict[str, Any]) -> str:
    lines = []
    for trace in sorted({u["trace"] for u in delay.values()}):
        us = sorted(
            [u for u in delay.values() if u["trace"] == trace], key=lambda u: u["provisioning_delay_s"]
        )
        parts = ", ".join(
            f"{u['provisioning_delay_s']:g} s: {_pct(u['reduction_vs']['lag'].get('cost_pct'))}" for u in us
        )
        lines.append(f"* {trace}, TurboServe's cost reduction vs `lag` by provisioning delay — {parts}.")
    if delay:
        lines.append(
            "  Every scale-out is paid for a whole delay before it serves, and a burst that arrives during boot must "
            "be absorbed by headroom the controller holds in advance; the longer the delay, the more headroom and "
            "paid boot, until a static pool sized for the peak is cheaper (– = TurboServe never meets the SLO "
            "within 16 GPUs at that delay)."
        )
    if shape:
        parts = ", ".join(
            f"{u['trace']} (PAR {u['shape']['par']:.2f}): {_pct(u['reduction_vs']['lag'].get('cost_pct'))}"
            for u in sorted(shape.values(), key=lambda u: u["shape"]["par"] or 0)
        )
        lines.append(f"* Open workloads, cost reduction vs `lag` — {parts}.")
        bursty = next((u for u in shape.values() if u["trace"] == "bursty"), None)
        red = bursty["reduction_vs"]["lag"].get("cost_pct") if bursty else None
        if red is not None and red < 0:
            lines.append(
                "  PAR alone does not predict the gain. The bursty trace has the highest PAR but its peaks are MMPP "
                "bursts of ~20 s — shorter than the 30 s boot — so the autoscaler cannot follow them and pays for "
                "headroom (and boots that arrive after the burst), while a static pool simply runs above K for the "
                "burst's few seconds within the SLO. The autoscaler wins where peaks last longer than the "
                "provisioning delay (diurnal, the Poisson ramp, T1, T3)."
            )
        else:
            lines.append(
                "  The saving is the off-peak: it grows where demand has more of it and peaks last longer than the "
                "provisioning delay."
            )
    return "\n".join(lines)


def section_sweep(data: dict[str, Any], out: Path) -> str:
    md = "## 8. Where the gains come from: provisioning delay and peak-to-average ratio\n\n"
    delay = _units(data, "sweep/delay/")
    shape = _units(data, "sweep/shape/")
    if not delay and not shape:
        return md + "Not run.\n"
    md += (
        "Same §7.1 protocol (turboserve vs base/lag/mag), H20-1.3B profile (16 GPUs), with (a) the provisioning delay "
        "replaced and (b) open workloads of rising peak-to-average ratio (PAR = peak / time-average active sessions). "
        "Reductions are TurboServe's (positive = TurboServe lower; – = that policy never meets the SLO).\n\n"
    )

    def row(label, u):
        r = [label, _f(u["shape"]["par"], 2), _f(u["policies"]["turboserve"].get("cost_at_slo_usd"), 3)]
        for b in BASELINES:
            red = u["reduction_vs"][b]
            r.append(f"{_pct(red.get('cost_pct'))} / {_pct(red.get('latency_pct'))}")
        return r

    if delay:
        md += "**(a) provisioning delay**\n\n"
        ordered = sorted(delay.values(), key=lambda u: (u["trace"], u["provisioning_delay_s"]))
        rows = [row(f"{u['trace']}, delay {u['provisioning_delay_s']:g} s", u) for u in ordered]
        md += _table(
            ["trace, delay", "PAR", "TurboServe cost@SLO $"]
            + [f"vs {b}: cost / latency red." for b in BASELINES],
            rows,
        )
        md += "\n\n"
    if shape:
        md += "**(b) demand shape**\n\n"
        rows = [row(u["trace"], u) for u in shape.values()]
        fig7 = _units(data, "fig7/")
        rows += [row(f"{u['trace']} ({u['profile']})", u) for u in fig7.values()]
        md += _table(
            ["trace", "PAR", "TurboServe cost@SLO $"] + [f"vs {b}: cost / latency red." for b in BASELINES],
            rows,
        )
        md += "\n\n"
    md += "Reading:\n\n" + _sweep_reading(delay, shape) + "\n"
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
    pts = list(shape.values()) + list(_units(data, "fig7/").values())
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
    md += f"\n![sweep]({_save(fig, out / 'sweep_dependencies.png')})\n"
    return md


def _delay_label(d: str) -> str:
    if d == "profile":
        return "profiles' own (1.3B 30 s, 7B 45 s)"
    return "0 s (instant attach)" if float(d) == 0 else f"{d} s"


def section_fig7_delay(data: dict[str, Any], out: Path, summary: dict[str, Any]) -> str:
    md = "## 9. The whole Fig. 7 grid at shorter provisioning delays\n\n"
    by_delay = summary.get("fig7_by_delay")
    units = _units(data, "fig7delay/")
    if not by_delay or not units:
        return md + "Not run (`--experiments fig7delay`).\n"
    md += (
        "Every Fig. 7 unit (T1–T6 × both profiles, same traces, SLOs, clusters and §7.1 protocol) rerun with only "
        "the provisioning delay of the GPU type replaced (`fig7delay` experiment: turboserve, base, lag, mag and the two "
        "Fig. 8 ablations). "
        "0 s is instant attach — the limit that TurboServe's pre-staged pool (§6.2: images and checkpoints already "
        "on the node) approaches; 10 s is a warm node that only starts the worker and loads the model from local "
        "disk. The static baselines do not depend on the delay (their pool is there from t = 0); only the autoscalers' "
        "figures move.\n\n"
    )
    rows = []
    for d, s in by_delay.items():
        rows.append(
            [
                _delay_label(d),
                s["units"],
                s["units"] - len(s["turboserve_misses_slo"]),
                _f(s["latency_reduction_mean_pct"], 1, " %"),
                _f(s["latency_reduction_mean_pct_where_turboserve_meets_slo"], 1, " %"),
                _f(s["cost_reduction_mean_pct"], 1, " %"),
                _f(s["cost_reduction_max_pct"], 1, " %"),
                len(s["baseline_wins"]),
            ]
        )
    rows.append(["paper (production traces)", "–", "–", "37.5 %", "37.5 %", "37.2 %", "49.0 %", 0])
    md += _table(
        [
            "provisioning delay",
            "units",
            "TurboServe meets SLO",
            "latency red. at matched cost (mean)",
            "… where TurboServe meets the SLO",
            "cost red. at matched latency (mean)",
            "cost red. (max)",
            "baseline-win cells",
        ],
        rows,
    )
    md += (
        "\n\nFig. 8 at each delay — mean cost change at the SLO of each ablation relative to full TurboServe "
        "(positive = the ablation costs more; n = units where both meet the SLO):\n\n"
    )
    abl_rows = []
    for d, s in by_delay.items():
        cells = [_delay_label(d)]
        for name in ("turboserve-no-migration", "turboserve-no-autoscale"):
            e = s.get("fig8", {}).get(name)
            cells.append(f"{_pct(e['mean_pct'])} (max {_pct(e['max_pct'])}, n = {e['n']})" if e else "–")
        abl_rows.append(cells)
    abl_rows.append(["paper", "+15.0 % (max +28.0 %)", "+42.9 % (max +80.4 %)"])
    md += _table(["provisioning delay", "no migration", "no autoscaling"], abl_rows)
    md += "\n\nPer unit (TurboServe's cheapest SLO-meeting configuration; reductions cost / latency, positive = TurboServe lower):\n\n"
    fig7 = _units(data, "fig7/")
    per_unit = []
    keyed: dict[tuple[str, str], list[tuple[float, dict[str, Any]]]] = {}
    for u in units.values():
        keyed.setdefault((u["trace"], u["profile"]), []).append((u["provisioning_delay_s"], u))
    for (trace, profile), us in sorted(keyed.items()):
        own = fig7.get(f"fig7/{trace}/{profile}")
        if own:
            us = [*us, (own["provisioning_delay_s"], own)]
        for delay, u in sorted(us, key=lambda x: x[0]):
            ts = u["policies"]["turboserve"]
            cells = [
                trace,
                profile,
                f"{delay:g} s",
                f"{_f(ts.get('cost_at_slo_usd'), 3)} ({ts.get('config_at_slo')})"
                if ts.get("meets_slo")
                else f"SLO missed ({_f(ts.get('worst_latency_at_slo_config_ms'), 0)} ms)",
            ]
            for b in BASELINES:
                red = u["reduction_vs"].get(b, {})
                cells.append(f"{_pct(red.get('cost_pct'))} / {_pct(red.get('latency_pct'))}")
            per_unit.append(cells)
    md += _table(
        ["trace", "profile", "delay", "TurboServe cost@SLO $ (config)"] + [f"vs {b}" for b in BASELINES],
        per_unit,
    )
    md += "\n\nReading:\n\n" + _fig7_delay_reading(by_delay) + "\n"
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(6.5, 3.4))
    pts = [(float(d), s) for d, s in by_delay.items() if d != "profile"]
    if "profile" in by_delay:
        pts.append((30.0, by_delay["profile"]))
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
    md += f"\n![Fig. 7 by provisioning delay]({_save(fig, out / 'fig7_by_delay.png')})\n"
    return md


def _fig7_delay_reading(by_delay: dict[str, dict[str, Any]]) -> str:
    lines = []
    instant = by_delay.get("0")
    own = by_delay.get("profile")
    if instant and own:
        lines.append(
            f"* From the profiles' own delays to instant attach, the mean cost reduction goes from "
            f"{_f(own['cost_reduction_mean_pct'], 1, ' %')} to {_f(instant['cost_reduction_mean_pct'], 1, ' %')} and "
            f"the mean latency reduction from {_f(own['latency_reduction_mean_pct'], 1, ' %')} to "
            f"{_f(instant['latency_reduction_mean_pct'], 1, ' %')} (paper: 37.2 % and 37.5 %); baseline-win cells "
            f"go from {len(own['baseline_wins'])} to {len(instant['baseline_wins'])}."
        )
        met = [
            name
            for name, ours, target in (
                ("cost", instant["cost_reduction_mean_pct"], 37.2),
                ("latency", instant["latency_reduction_mean_pct"], 37.5),
            )
            if ours is not None and ours >= target
        ]
        lines.append(
            "  With instant attach the paper's average is reached on "
            + (" and ".join(met) if met else "neither metric")
            + ". The scheduler, traces and baselines are the same in every row: the provisioning delay alone "
            "moves the result, because every scale-out is paid for one delay before it serves and a burst that "
            "arrives during it must be covered by headroom held in advance, while a static pool sized for the peak "
            "pays neither. The paper does not state its scale-out time; its pool is pre-staged (§6.2), which puts "
            "its scale-out nearer the top rows than ours (how near is not stated)."
        )
    if instant and own:
        parts = []
        for name, paper_pct in (
            ("turboserve-no-migration", "+15.0 %"),
            ("turboserve-no-autoscale", "+42.9 %"),
        ):
            a, b = own["fig8"].get(name), instant["fig8"].get(name)
            parts.append(
                f"{name} {_pct(a['mean_pct']) if a else '–'} → {_pct(b['mean_pct']) if b else '–'} (paper {paper_pct})"
            )
        lines.append("* Fig. 8 from the profiles' own delays to instant attach: " + "; ".join(parts) + ".")
    if instant and instant["baseline_wins"]:
        lines.append(
            "* Cells a baseline still wins with instant attach: " + "; ".join(instant["baseline_wins"]) + "."
        )
    return "\n".join(lines)


# --------------------------------------------------------------------------------------------------


def section_seeds(data: dict[str, Any], out: Path, summary: dict[str, Any]) -> str:
    import json

    files = sorted((out / "other_seeds").glob("seed-*.json")) if (out / "other_seeds").is_dir() else []
    others = []
    for f in files:
        try:
            d = json.loads(f.read_text())
        except json.JSONDecodeError:
            continue
        if d["meta"].get("quick") == data["meta"]["quick"] and d["meta"].get("seed") != data["meta"]["seed"]:
            others.append(d)
    md = "## Seed sensitivity\n\n"
    if not others:
        return md + (
            "Only this seed. To add another: `python manage.py reproduce_paper --seed N --out /tmp/seedN --jobs 2 "
            f"--export-summary-to {out}` and regenerate this report (`--resume`).\n\n"
        )
    md += (
        "The headline figures for other seeds of the trace generators (each a full run of this command, "
        "`--seed N --export-summary-to`), beside this report's seed. Differences are the spread of a single "
        "generated trace; read single-trace rows above with that in mind.\n\n"
    )

    def cells(s: dict[str, Any]) -> list[str]:
        f7 = s.get("fig7", {})
        f8 = s.get("fig8", {})
        g = s.get("fig9_gap", {})
        t2 = s.get("table2", {})
        t8 = s.get("tables8_10", {})
        return [
            _f(f7.get("latency_reduction_mean_pct"), 1, " %"),
            _f(f7.get("latency_reduction_mean_pct_where_turboserve_meets_slo"), 1, " %"),
            _f(f7.get("cost_reduction_mean_pct"), 1, " %"),
            str(len(f7.get("baseline_wins", []))),
            _pct((f8.get("turboserve-no-migration") or {}).get("mean_pct")),
            _pct((f8.get("turboserve-no-autoscale") or {}).get("mean_pct")),
            f"{_f(g.get('mean_pct'), 2)} / {_f(g.get('max_pct'), 2)} %",
            _pct(t2.get("gap_mean_pct")),
            _pct(t8.get("gap_at_online_latency_pct"), 2),
        ]

    def when(meta: dict[str, Any]) -> str:
        runs = meta.get("runs") or []
        core = (runs[-1].get("core_commit") if runs else None) or meta.get("core_commit")
        stamp = f"{runs[-1]['finished_utc']} UTC" if runs else str(meta.get("finished_utc") or "?")
        return stamp + (f", core {core}" if core else "")

    rows = [[f"{data['meta']['seed']} (this report)", when(data["meta"]), *cells(summary)]]
    for d in sorted(others, key=lambda d: d["meta"]["seed"]):
        rows.append([str(d["meta"]["seed"]), when(d["meta"]), *cells(d["summary"])])
    rows.append(
        [
            "paper",
            "",
            "37.5 %",
            "37.5 %",
            "37.2 %",
            "0",
            "+15.0 %",
            "+42.9 %",
            "3.6 / 6.5 %",
            "+6.1 %",
            "+0.73 %",
        ]
    )
    md += _table(
        [
            "seed",
            "last run (scheduling/core commit)",
            "Fig. 7 latency red.",
            "… where TS meets SLO",
            "Fig. 7 cost red.",
            "baseline wins",
            "no-migration cost",
            "no-autoscale cost",
            "placement gap mean / max",
            "Table 2 gap",
            "Table 9 gap (equal latency)",
        ],
        rows,
    )
    return md + "\n\n"


def write_report(out: str | Path, data: dict[str, Any]) -> Path:
    import json

    out = Path(out)
    summary = summarise(data)
    data["summary"] = summary
    (out / "results.json").write_text(json.dumps(data, indent=1, default=str))
    meta = data["meta"]
    f7 = summary["fig7"]
    md = ["# Reproducing the TurboServe paper with StreamServe's scheduler\n"]
    runs = meta.get("runs", [])
    run_lines = "; ".join(
        f"{r['started_utc']} UTC, {r['wall_s']:.0f} s wall, --jobs {r['jobs']}, "
        + (
            "all experiments"
            if set(EXPERIMENTS) <= set(r.get("experiments") or [])
            else f"--experiments {','.join(r.get('experiments') or [])}"
        )
        + f" ({len(r.get('units_run') or [])} units"
        + (f", scheduling/core at {r['core_commit']}" if r.get("core_commit") else "")
        + ")"
        for r in runs
    )
    md.append(
        f"Generated by `python manage.py reproduce_paper --out {out}{' --quick' if meta['quick'] else ''} --seed {meta['seed']} "
        f"[--jobs J]` on {meta['machine']}, Python {meta['python']}. Runs behind these figures: {run_lines or '–'}. "
        "All raw figures: `results.json`. Everything below is simulated (`scheduling.core.simulator`) on generated traces "
        "shaped like the paper's published tables; the paper's figures come from production traces on real clusters.\n"
    )
    if meta["quick"]:
        md.append(
            "\n> **`--quick` run**: every input is shrunk (60 s trace prefixes, tiny grids); the figures are for testing the pipeline only.\n"
        )
    md.append("\n## Headline\n\n")
    head_rows = [
        [
            "Fig. 7 worst latency at matched cost, mean reduction vs base/LAG/MAG",
            _f(f7["latency_reduction_mean_pct"], 1, " %"),
            "37.5 %",
            _yes(f7["latency_reduction_mean_pct"], 37.5),
        ],
        [
            "Fig. 7 cost at matched latency, mean reduction vs base/LAG/MAG",
            _f(f7["cost_reduction_mean_pct"], 1, " %"),
            "37.2 %",
            _yes(f7["cost_reduction_mean_pct"], 37.2),
        ],
        [
            "Fig. 7 traces × baselines where a baseline wins on a metric",
            str(len(f7["baseline_wins"])),
            "0",
            "met" if not f7["baseline_wins"] else "missed",
        ],
    ]
    instant = summary.get("fig7_by_delay", {}).get("0")
    if instant:
        head_rows.append(
            [
                "Fig. 7 mean reductions (latency / cost) with instant GPU attach, same traces and protocol (§9)",
                f"{_f(instant['latency_reduction_mean_pct'], 1, ' %')} / {_f(instant['cost_reduction_mean_pct'], 1, ' %')}"
                f" ({len(instant['baseline_wins'])} baseline-win cells)",
                "37.5 % / 37.2 %",
                "dependency, not a target",
            ]
        )
    for n, label in (
        ("turboserve-no-migration", "Fig. 8 no-migration cost increase (mean)"),
        ("turboserve-no-autoscale", "Fig. 8 no-autoscale cost increase (mean)"),
    ):
        e = summary["fig8"].get(n)
        head_rows.append(
            [
                label,
                _pct(e["mean_pct"]) if e else "–",
                "+15.0 %" if "migration" in n else "+42.9 %",
                "not reproduced" if (e is None or e["mean_pct"] <= 0) else "reproduced in sign",
            ]
        )
    if "fig9_gap" in summary:
        g = summary["fig9_gap"]
        head_rows.append(
            [
                "Fig. 9 placement gap to the MILP oracle (mean / max)",
                f"{g['mean_pct']:.2f} % / {g['max_pct']:.2f} %",
                "3.6 % / 6.5 %",
                "met" if g["mean_pct"] <= 3.6 and g["max_pct"] <= 6.5 else "missed",
            ]
        )
    if "table2" in summary:
        t = summary["table2"]
        head_rows.append(
            [
                "Table 2 autoscaling cost above the offline oracle (mean; mean |gap|)",
                f"{_pct(t['gap_mean_pct'])}; {_f(t['gap_mean_abs_pct'], 1, ' %')}",
                "+6.1 % (mean |gap|)",
                "met" if (t["gap_mean_abs_pct"] is not None and t["gap_mean_abs_pct"] <= 6.1) else "missed",
            ]
        )
    if "tables8_10" in summary:
        t = summary["tables8_10"]
        gm = t.get("gap_at_online_latency_pct")
        head_rows.append(
            [
                "Table 9 online cost vs per-window ρ̂ oracle at equal worst latency (at 670 ms)",
                f"{_pct(gm, 2)} ({_pct(t['gap_pct'], 2)}; 670 ms met: oracle {'yes' if t['oracle_feasible'] else 'no'}, online {'yes' if t['online_meets_slo'] else 'no'})",
                "+0.73 % (both meet 670 ms)",
                "met" if (gm is not None and abs(gm) <= 0.73) else "missed",
            ]
        )
    head_rows.insert(
        1,
        [
            "… the same, only where TurboServe meets the SLO",
            _f(f7["latency_reduction_mean_pct_where_turboserve_meets_slo"], 1, " %"),
            "37.5 %",
            _yes(f7["latency_reduction_mean_pct_where_turboserve_meets_slo"], 37.5),
        ],
    )
    md.append(_table(["figure", "ours", "paper", "target"], head_rows))
    md.append(
        "\n\nTargets (issue 3): at least the paper's average reductions on the paper-shaped traces; better than every "
        'baseline on both metrics on every trace; closer to the oracles than the paper. "missed" is reported as is — '
        "nothing here is tuned to a number.\n\n"
    )
    errors = [f"`{k}`: {v['error']}" for k, v in sorted(data["units"].items()) if v.get("error")]
    if errors:
        md.append("**Units that failed** (their sections are incomplete): " + "; ".join(errors) + "\n\n")
    md.append(section_fig4(data, out) + "\n")
    md.append(section_fig7(data, out, summary) + "\n")
    md.append(section_fig8(data, out, summary) + "\n")
    md.append(section_fig9(data, out) + "\n")
    md.append(section_table2(data, out, summary) + "\n")
    md.append(section_table6(data) + "\n")
    md.append(section_tables8_10(data, out) + "\n")
    md.append(section_sweep(data, out) + "\n")
    md.append(section_fig7_delay(data, out, summary) + "\n")
    md.append(section_seeds(data, out, summary))
    md.append(
        "## Limits of this reproduction\n\n"
        "* Every figure is simulated on generated traces that match the paper's published per-span statistics "
        "(Tables 7, 11, 12), not on the production traces, with our calibrated GPU profiles and assumed prices and "
        "provisioning delays (docs/scheduling.md); absolute latencies and dollars are not comparable with the paper's.\n"
        "* Every table above is one seed of the trace generators; the seed-sensitivity table gives the headline for "
        "other seeds (no confidence intervals).\n"
        "* Table 6 is read from the shipped table, not re-profiled here (`manage.py profile_volatility` does that).\n"
        "* The placement gap uses random heterogeneous instances (the `oracle_gap` command), not snapshots of the "
        "paper's Trace 1.\n"
        "* Table 2's oracle and ours are compared at one fixed ρ̂ (0.8); the oracle ignores latency.\n"
        "* The per-window ρ̂ oracle is a greedy search with coordinate passes, not exhaustive.\n\n"
    )
    md.append(
        "## Unit run times\n\n"
        + _table(
            ["unit", "wall s"],
            [[k, _f(v.get("unit", {}).get("wall_s"), 1)] for k, v in sorted(data["units"].items())],
        )
        + "\n"
    )
    path = out / "README.md"
    path.write_text("".join(md))
    return path
