"""matplotlib charts (Agg backend, no display needed) for simulation results and comparisons."""

from __future__ import annotations

from pathlib import Path
from typing import Any


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_timeline(result: dict[str, Any], path: str | Path) -> Path:
    """Active sessions, GPU budget, worst latency per window and cost per window."""
    plt = _pyplot()
    rows = result["timeline"]
    t = [r["t0"] for r in rows]
    fig, axes = plt.subplots(3, 1, figsize=(9, 7.5), sharex=True)
    ax = axes[0]
    ax.step(t, [r["active_max"] for r in rows], where="post", label="active sessions (max)")
    ax.set_ylabel("sessions")
    ax2 = ax.twinx()
    ax2.step(t, [r["budget_max"] for r in rows], where="post", color="tab:orange", label="GPU budget")
    ax2.set_ylabel("GPUs")
    ax.legend(loc="upper left")
    ax2.legend(loc="upper right")
    axes[1].plot(t, [r["worst_ms"] for r in rows], marker=".", color="tab:red")
    axes[1].axhline(result["slo_ms"], color="gray", linestyle="--", label=f"SLO {result['slo_ms']:.0f} ms")
    axes[1].set_ylabel("worst chunk latency (ms)")
    axes[1].legend(loc="upper right")
    cumulative = []
    total = 0.0
    for r in rows:
        total += r["cost_usd"]
        cumulative.append(total)
    axes[2].plot(t, cumulative, color="tab:green")
    axes[2].set_ylabel("cumulative cost (USD)")
    axes[2].set_xlabel("time (s)")
    fig.suptitle(f"{result['policy']} on {result['trace']}")
    fig.tight_layout()
    out = Path(path)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


def plot_comparison(comparison: dict[str, Any], path: str | Path) -> Path:
    """Bars: cost at the SLO and worst latency at matched cost, per policy."""
    plt = _pyplot()
    names = list(comparison["policies"])
    cost = [comparison["policies"][n].get("cost_at_slo_usd") or 0.0 for n in names]
    lat = [comparison["policies"][n].get("worst_latency_at_matched_cost_ms") or 0.0 for n in names]
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    axes[0].bar(names, lat, color="tab:red")
    axes[0].axhline(comparison["slo_ms"], color="gray", linestyle="--")
    axes[0].set_title("worst chunk latency at matched cost (ms)")
    axes[1].bar(names, cost, color="tab:green")
    axes[1].set_title("GPU cost at matched latency (USD; 0 = SLO not met)")
    for ax in axes:
        ax.tick_params(axis="x", rotation=30)
    fig.suptitle(f"{comparison['trace']} (SLO {comparison['slo_ms']:.0f} ms)")
    fig.tight_layout()
    out = Path(path)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out
