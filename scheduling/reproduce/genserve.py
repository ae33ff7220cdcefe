"""GenServe reproduction (``manage.py reproduce_genserve``): docs/results/genserve.md, .json, .png.

Three experiments, each on seeded GenServe-shaped mixes (``workload.genserve_jobs``), simulated with
the stream simulator and its job side (``cosim``):

1. **Ablation ladder** (slides Fig. 14): σ = 1.0, balanced mix, skewed resolutions, 8 GPUs, jobs only;
   the paper's cumulative rungs fcfs → fcfs-preempt → genserve-no-sp (+DP with EDF batching) →
   genserve (+SP), plus edf and the leave-one-out ablations.
2. **SLO scale** (Fig. 10): attainment against σ for fcfs, edf and genserve.
3. **Beside the streams**: a session trace and a job mix on one TurboServe-autoscaled pool, against
   the streams alone (chunks over their SLO) and against the jobs alone on a dedicated fixed pool
   whose cost equals what the shared pool spent beyond the streams alone. The streams are paced at
   one chunk period (the SLO: ``SimConfig.stream_period_ms``), alone as with jobs, so jobs step on
   the empty GPUs the round solver plans and beside the streams when ``contracts.coserve`` says a
   step fits the slack they leave (issue 32: the rule the live worker runs).

Experiments 1 and 2 also run every policy beside the streams (same jobs, one autoscaled pool with
a Poisson session trace), reporting its attainment and the stream chunks over SLO there.

Every figure is an average over ``seeds``; the rates are the paper's anchor (24 req/min) and the
heavier ones given, because the derived step times (core/jobs/job_profiles.py) make 24 req/min a light load on
8 GPUs — the offered load (Σ one-GPU latencies / GPU-time) is reported for each rate.
"""

from __future__ import annotations

import json
import platform
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from scheduling.core.gpu_profiles import load_profiles
from scheduling.core.jobs.job_profiles import load_job_catalog
from scheduling.core.policy import make_policy
from scheduling.sim.generators import poisson_trace
from scheduling.sim.jobs.cosim import job_config
from scheduling.sim.jobs.workload import genserve_jobs, isolated_latency_s
from scheduling.sim.simulator import SimConfig, simulate

LADDER = ("fcfs", "fcfs-preempt", "genserve-no-sp", "genserve")
ABLATIONS = ("edf", "genserve-no-preempt", "genserve-no-dp")
PAPER_LADDER = {"fcfs": 20, "fcfs-preempt": 39, "genserve-no-sp": 58, "genserve": 63}
SIGMA_POLICIES = ("fcfs", "edf", "genserve")
GPUS = 8
STREAM_PROFILE = "h20-1.3b"


def _mean(values: Sequence[float | None]) -> float | None:
    kept = [v for v in values if v is not None]
    return round(float(np.mean(kept)), 4) if kept else None


def _jobs_only(policy: str, jobs: list, duration_s: float, gpus: int = GPUS) -> dict[str, Any]:
    """The job metrics of ``jobs`` alone (no streams) on a fixed pool of ``gpus``."""
    config = SimConfig(
        profiles=load_profiles(STREAM_PROFILE),
        initial_gpus=gpus,
        min_gpus=gpus,
        max_gpus=gpus,
        duration_s=duration_s,
    )
    result = simulate([], make_policy("base"), config, job_events=jobs, jobs=job_config(policy))
    assert result.jobs is not None
    return result.jobs


def offered_load(jobs: list, gpus: int, window_s: float) -> float:
    catalog = load_job_catalog()
    work = sum(isolated_latency_s(catalog, j.kind, j.width, j.frames or 1, j.steps) for j in jobs)
    return round(work / (gpus * window_s), 3)


_KEYS = (
    "slo_attainment",
    "image_slo_attainment",
    "video_slo_attainment",
    "image_wait_p50_s",
    "image_wait_mean_s",
    "latency_p99_s",
)


def _averaged(runs: list[dict[str, Any]]) -> dict[str, Any]:
    return {k: _mean([r[k] for r in runs]) for k in _KEYS}


def _beside_streams(
    policy: str, jobs: list, meta: dict, seed: int, session_rate: float, window_s: float
) -> dict:
    """The same job mix on one TurboServe-autoscaled pool with a Poisson session trace."""
    smeta, sessions = poisson_trace(session_rate, window_s, 180.0, seed=seed)
    duration = max(smeta["duration_s"], meta["duration_s"])
    profile = load_profiles(STREAM_PROFILE)[0]
    result = simulate(
        sessions,
        make_policy("turboserve"),
        _autoscaled(profile, duration),
        job_events=jobs,
        jobs=job_config(policy),
    )
    assert result.jobs is not None
    return {**result.jobs, "chunks_over_slo": _chunks_over(result)}


def _streams_columns(runs: list[dict[str, Any]]) -> dict[str, Any]:
    return {
        "slo_attainment_beside_streams": _mean([r["slo_attainment"] for r in runs]),
        "stream_chunks_over_slo_beside_jobs": sum(r["chunks_over_slo"] for r in runs),
    }


def _policy_columns(policy: str, mixes: list, session_rate: float, window_s: float) -> dict[str, Any]:
    """One policy's row columns over the seeds' job mixes ``(seed, meta, jobs)``: the job metrics
    alone on the fixed pool, averaged, then beside a session trace (`_streams_columns`)."""
    runs = [_jobs_only(policy, jobs, meta["duration_s"]) for _, meta, jobs in mixes]
    shared = [_beside_streams(policy, jobs, meta, seed, session_rate, window_s) for seed, meta, jobs in mixes]
    return {**_averaged(runs), **_streams_columns(shared)}


def ladder(
    rates: Sequence[float],
    seeds: Sequence[int],
    window_s: float,
    log: Callable[[str], None],
    session_rate: float = 6.0,
) -> list[dict[str, Any]]:
    rows = []
    for rate in rates:
        mixes = [
            (
                seed,
                *genserve_jobs(
                    rate_per_min=rate, duration_s=window_s, sigma=1.0, resolutions="skewed", seed=seed
                ),
            )
            for seed in seeds
        ]
        load = _mean([offered_load(jobs, GPUS, window_s) for _, _, jobs in mixes])
        for policy in LADDER + ABLATIONS:
            rows.append(
                {
                    "rate_per_min": rate,
                    "offered_load": load,
                    "policy": policy,
                    **_policy_columns(policy, mixes, session_rate, window_s),
                }
            )
            log(f"ladder {rate}/min {policy}: {rows[-1]['slo_attainment']}")
    return rows


def sigma_sweep(
    rates: Sequence[float],
    sigmas: Sequence[float],
    seeds: Sequence[int],
    window_s: float,
    log: Callable[[str], None],
    session_rate: float = 6.0,
) -> list[dict[str, Any]]:
    rows = []
    for rate in rates:
        for sigma in sigmas:
            mixes = [
                (seed, *genserve_jobs(rate_per_min=rate, duration_s=window_s, sigma=sigma, seed=seed))
                for seed in seeds
            ]
            for policy in SIGMA_POLICIES:
                rows.append(
                    {
                        "rate_per_min": rate,
                        "sigma": sigma,
                        "policy": policy,
                        **_policy_columns(policy, mixes, session_rate, window_s),
                    }
                )
                log(f"sigma {rate}/min σ={sigma} {policy}: {rows[-1]['slo_attainment']}")
    return rows


def _chunks_over(result: Any) -> int:
    return round(result.chunks * (1.0 - result.slo_pass_rate))


def with_streams(
    *,
    session_rate_per_min: float,
    job_rate_per_min: float,
    seeds: Sequence[int],
    window_s: float,
    log: Callable[[str], None],
) -> list[dict[str, Any]]:
    """Streams alone, streams + jobs on one autoscaled pool, and jobs alone on a dedicated pool of
    the shared pool's extra cost (rounded to whole GPUs over the run)."""
    rows = []
    profile = load_profiles(STREAM_PROFILE)[0]
    for seed in seeds:
        smeta, sessions = poisson_trace(session_rate_per_min, window_s, 180.0, seed=seed)
        jmeta, jobs = genserve_jobs(rate_per_min=job_rate_per_min, duration_s=window_s, sigma=1.0, seed=seed)
        duration = max(smeta["duration_s"], jmeta["duration_s"])

        alone = simulate(sessions, make_policy("turboserve"), _autoscaled(profile, duration))
        shared = simulate(
            sessions,
            make_policy("turboserve"),
            _autoscaled(profile, duration),
            job_events=jobs,
            jobs=job_config("genserve"),
        )
        assert shared.jobs is not None
        extra_usd = shared.gpu_cost_usd - alone.gpu_cost_usd
        dedicated_gpus = max(1, round(extra_usd / (profile.price_per_hour * duration / 3600.0)))
        dedicated = _jobs_only("genserve", jobs, duration, dedicated_gpus)
        rows.append(
            {
                "seed": seed,
                "duration_s": duration,
                "sessions": sum(1 for e in sessions if e.event == "arrive"),
                "jobs": len(jobs),
                "stream_chunks_alone": alone.chunks,
                "stream_chunks_over_slo_alone": _chunks_over(alone),
                "stream_chunks_shared": shared.chunks,
                "stream_chunks_over_slo_shared": _chunks_over(shared),
                "stream_slo_ms": alone.slo_ms,
                "worst_chunk_ms_alone": alone.worst_chunk_latency_ms,
                "worst_chunk_ms_shared": shared.worst_chunk_latency_ms,
                "cost_usd_alone": alone.gpu_cost_usd,
                "cost_usd_shared": shared.gpu_cost_usd,
                "peak_gpus_shared": shared.peak_gpus,
                "dedicated_gpus": dedicated_gpus,
                "jobs_shared": {k: shared.jobs[k] for k in _KEYS},
                "job_steps_beside_streams": shared.jobs["beside_steps"],
                "job_gpu_s_beside_streams": shared.jobs["beside_gpu_s"],
                "jobs_dedicated": {k: dedicated[k] for k in _KEYS},
            }
        )
        log(
            f"streams seed {seed}: shared {shared.jobs['slo_attainment']} dedicated {dedicated['slo_attainment']}"
        )
    return rows


def _autoscaled(profile: Any, duration_s: float) -> SimConfig:
    """The shared pool, its streams paced at one chunk period: the SLO (a chunk plays for as long as
    it may take to make), so the time their steps leave is there for jobs (issue 32)."""
    return SimConfig(
        profiles=[profile],
        initial_gpus=GPUS,
        min_gpus=1,
        max_gpus=32,
        duration_s=duration_s,
        stream_period_ms=profile.default_slo_ms,
    )


def run_reproduction(
    *,
    rates: Sequence[float] = (24.0, 48.0, 72.0),
    sigmas: Sequence[float] = (0.5, 0.75, 1.0, 1.25, 1.5),
    seeds: Sequence[int] = (0, 1),
    window_s: float = 600.0,
    session_rate_per_min: float = 6.0,
    log: Callable[[str], None] = lambda _: None,
) -> dict[str, Any]:
    started = time.process_time()
    return {
        "setup": {
            "gpus": GPUS,
            "rates_per_min": list(rates),
            "sigmas": list(sigmas),
            "seeds": list(seeds),
            "window_s": window_s,
            "session_rate_per_min": session_rate_per_min,
            "stream_profile": STREAM_PROFILE,
            "stream_period_ms": load_profiles(STREAM_PROFILE)[0].default_slo_ms,
            "job_profiles": "built-in, derived from the GenServe slides (docs/traces.md)",
        },
        "ladder": ladder(rates, seeds, window_s, log, session_rate_per_min),
        "sigma": sigma_sweep(rates, sigmas, seeds, window_s, log, session_rate_per_min),
        "streams": with_streams(
            session_rate_per_min=session_rate_per_min,
            job_rate_per_min=rates[0],
            seeds=seeds,
            window_s=window_s,
            log=log,
        ),
        "paper_ladder_pct": PAPER_LADDER,
        "cpu_s": round(time.process_time() - started, 1),
        "machine": f"{platform.machine()}, python {platform.python_version()}",
    }


# -- the report -----------------------------------------------------------------------------------
def _pct(x: float | None) -> str:
    return "—" if x is None else f"{100 * x:.1f} %"


def _s(x: float | None) -> str:
    return "—" if x is None else f"{x:.2f} s"


def render_markdown(data: dict[str, Any], png_name: str) -> str:
    setup = data["setup"]
    lines = [
        "# GenServe co-serving: reproduction (issue 14)",
        "",
        "Generated by `python manage.py reproduce_genserve` (do not edit by hand; the analysis is in",
        'docs/scheduling.md, "One-shot jobs"). Simulated: 8 GPUs, built-in job profiles derived from the',
        f"GenServe slides, seeds {setup['seeds']}, submits over {setup['window_s']:.0f} s; {data['cpu_s']} s CPU on",
        f"{data['machine']} (2-core shared box, no GPU).",
        "",
        f"![GenServe reproduction]({png_name})",
        "",
        "## Ablation ladder (slides Fig. 14: σ = 1.0, balanced mix, skewed resolutions)",
        "",
        'Jobs alone on 8 GPUs; "beside streams": the same jobs on one TurboServe-autoscaled pool (1–32 GPUs) '
        f"with {setup['session_rate_per_min']:g} sessions/min, and the stream chunks over SLO there (sum over seeds; "
        "0 for the streams alone on every seed, see the last section).",
        "",
        "| rate | offered load | policy | SLO attainment | paper | image | video | image wait p50 | image wait mean | latency p99 | beside streams | stream chunks over SLO |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in data["ladder"]:
        paper = data["paper_ladder_pct"].get(r["policy"])
        lines.append(
            f"| {r['rate_per_min']:g}/min | {r['offered_load']:.2f} | {r['policy']} | {_pct(r['slo_attainment'])} | "
            f"{'' if paper is None else f'{paper} %'} | {_pct(r['image_slo_attainment'])} | "
            f"{_pct(r['video_slo_attainment'])} | {_s(r['image_wait_p50_s'])} | {_s(r['image_wait_mean_s'])} | "
            f"{_s(r['latency_p99_s'])} | {_pct(r['slo_attainment_beside_streams'])} | "
            f"{r['stream_chunks_over_slo_beside_jobs']} |"
        )
    lines += [
        "",
        "## SLO attainment against the SLO scale σ (slides Fig. 10; balanced mix, uniform resolutions)",
        "",
        '"beside streams": the same jobs on one TurboServe-autoscaled pool (1–32 GPUs, 8 at start) with '
        f"{setup['session_rate_per_min']:g} sessions/min ({STREAM_PROFILE}); the stream chunks over SLO of those "
        "runs are in genserve.json.",
        "",
    ]
    sigmas = setup["sigmas"]
    lines.append("| rate | policy | " + " | ".join(f"σ = {s:g}" for s in sigmas) + " |")
    lines.append("|---|---|" + "---|" * len(sigmas))
    for rate in setup["rates_per_min"]:
        for policy in SIGMA_POLICIES:
            for key, label in (
                ("slo_attainment", policy),
                ("slo_attainment_beside_streams", f"{policy} beside streams"),
            ):
                cells = [
                    _pct(
                        next(
                            r[key]
                            for r in data["sigma"]
                            if r["rate_per_min"] == rate and r["sigma"] == s and r["policy"] == policy
                        )
                    )
                    for s in sigmas
                ]
                lines.append(f"| {rate:g}/min | {label} | " + " | ".join(cells) + " |")
    lines += [
        "",
        f"## Beside the streams ({STREAM_PROFILE} streams, Poisson {setup['session_rate_per_min']:g} sessions/min, "
        f"TurboServe autoscaling 1–32 GPUs; jobs {setup['rates_per_min'][0]:g}/min, σ = 1.0, genserve)",
        "",
        f"Streams paced at one chunk period ({setup.get('stream_period_ms', 0):.0f} ms, the SLO) alone as beside jobs; "
        "jobs step on the GPUs the streams leave empty and, when `contracts.coserve` says a step fits, in the "
        "slack between the paced steps of a GPU with streams (steps beside streams: count and GPU-seconds).",
        "",
        "| seed | chunks over SLO: streams alone | shared | worst chunk alone / shared | cost alone / shared | dedicated job pool (same extra cost) | job SLO attainment shared | dedicated | ratio | job steps beside streams |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in data["streams"]:
        shared, dedicated = r["jobs_shared"]["slo_attainment"], r["jobs_dedicated"]["slo_attainment"]
        ratio = "—" if not dedicated else f"{shared / dedicated:.2f}"
        lines.append(
            f"| {r['seed']} | {r['stream_chunks_over_slo_alone']} of {r['stream_chunks_alone']} | "
            f"{r['stream_chunks_over_slo_shared']} of {r['stream_chunks_shared']} | "
            f"{r['worst_chunk_ms_alone']:.0f} / {r['worst_chunk_ms_shared']:.0f} ms (SLO {r['stream_slo_ms']:.0f}) | "
            f"${r['cost_usd_alone']:.2f} / ${r['cost_usd_shared']:.2f} | {r['dedicated_gpus']} GPUs | "
            f"{_pct(shared)} | {_pct(dedicated)} | {ratio} | "
            f"{r.get('job_steps_beside_streams', 0)} ({r.get('job_gpu_s_beside_streams', 0.0):.1f} GPU-s) |"
        )
    lines += ["", "## Targets (measured above)", ""]
    lines += _targets(data)
    return "\n".join(lines) + "\n"


def _targets(data: dict[str, Any]) -> list[str]:
    out = []
    for rate in data["setup"]["rates_per_min"]:
        sig = {r["policy"]: r for r in data["sigma"] if r["rate_per_min"] == rate and r["sigma"] == 1.0}
        if "fcfs" in sig and "genserve" in sig:
            f, g = sig["fcfs"]["slo_attainment"], sig["genserve"]["slo_attainment"]
            ratio = "∞" if not f else f"{g / f:.2f}×"
            out.append(
                f"* {rate:g}/min, σ = 1.0: genserve {_pct(g)} vs FCFS {_pct(f)} = {ratio} (target ≥ 3×); "
                f"image wait p50 {_s(sig['genserve']['image_wait_p50_s'])} (target < 0.5 s)."
            )
    for r in data["streams"]:
        shared, dedicated = r["jobs_shared"]["slo_attainment"], r["jobs_dedicated"]["slo_attainment"]
        out.append(
            f"* streams seed {r['seed']}: chunks over SLO {r['stream_chunks_over_slo_alone']} alone → "
            f"{r['stream_chunks_over_slo_shared']} shared (target: no more); job attainment "
            f"{_pct(shared)} shared vs {_pct(dedicated)} dedicated (target ≥ 80 %)."
        )
    return out


def plot(data: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rates = data["setup"]["rates_per_min"]
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    ax = axes[0]
    width = 0.8 / (len(rates) + 1)
    x = np.arange(len(LADDER))
    ax.bar(x, [PAPER_LADDER[p] for p in LADDER], width, label="paper (Fig. 14)", color="lightgray")
    for i, rate in enumerate(rates):
        values = [
            100
            * next(
                r["slo_attainment"] for r in data["ladder"] if r["rate_per_min"] == rate and r["policy"] == p
            )
            for p in LADDER
        ]
        ax.bar(x + (i + 1) * width, values, width, label=f"ours, {rate:g}/min")
    ax.set_xticks(x + width * len(rates) / 2, ["FCFS", "+preempt", "+DP", "+SP"])
    ax.set_ylabel("overall SLO attainment (%)")
    ax.set_title("Ablation ladder, σ = 1.0")
    ax.legend()
    ax = axes[1]
    for rate in rates:
        for policy in SIGMA_POLICIES:
            rows = [r for r in data["sigma"] if r["rate_per_min"] == rate and r["policy"] == policy]
            ax.plot(
                [r["sigma"] for r in rows],
                [100 * r["slo_attainment"] for r in rows],
                marker="o",
                label=f"{policy}, {rate:g}/min",
            )
    ax.set_xlabel("SLO scale σ")
    ax.set_ylabel("SLO attainment (%)")
    ax.set_title("SLO attainment against σ")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write_outputs(data: dict[str, Any], out_dir: Path) -> list[Path]:
    out_dir.mkdir(parents=True, exist_ok=True)
    png, md, js = out_dir / "genserve.png", out_dir / "genserve.md", out_dir / "genserve.json"
    plot(data, png)
    md.write_text(render_markdown(data, png.name), encoding="utf-8")
    js.write_text(json.dumps(data, indent=1) + "\n", encoding="utf-8")
    return [md, js, png]
