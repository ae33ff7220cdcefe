"""GenServe-shaped job mixes (slides §6: balanced image/video mix, 24 req/min, SLO scale σ).

Arrivals are Poisson at ``rate_per_min``; each request is an image with probability
``image_fraction`` (SD3.5, 28 steps) or else a video (Wan2.2-5B, 81 frames, 50 steps). Resolutions are
drawn from 256², 480², 768² (the slides' 256p/480p/720p, Table 3) with ``resolution_weights``
(``"uniform"``, or ``"skewed"``: 20/30/50 %, large-heavy — the slides' ablation runs a "skewed
resolution setting" whose weights they do not give).

**SLO.** The slides do not define what σ scales. Here ``slo_s = σ × 2.5 × T_iso``, T_iso being the
request's latency alone on one GPU (SP 1, batch 1, all steps plus the decode, from the cost
profile): the 2.5× is TridentServe's SLO convention (NOTES-wave2.md), applied to the one-GPU
latency so that every policy, SP or not, can meet every SLO on an idle pool at σ = 1.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from scheduling.core.jobs.job_profiles import JobCatalog, load_job_catalog

from ..traces import JobEvent

SIDES = (256, 480, 768)
RESOLUTION_WEIGHTS = {"uniform": (1 / 3, 1 / 3, 1 / 3), "skewed": (0.2, 0.3, 0.5)}
SLO_FACTOR = 2.5
VIDEO_FRAMES = 81


def isolated_latency_s(catalog: JobCatalog, kind: str, side: int, frames: int, steps: int) -> float:
    profile = catalog.profile(kind, None)
    step_s = profile.step_ms(side, side, frames) / 1000.0
    return steps * step_s + profile.decode_ms(side, side, frames, steps) / 1000.0


def genserve_jobs(
    *,
    rate_per_min: float = 24.0,
    duration_s: float = 600.0,
    image_fraction: float = 0.5,
    sigma: float = 1.0,
    resolutions: str = "uniform",
    seed: int = 0,
    catalog: JobCatalog | None = None,
    prefix: str = "j",
) -> tuple[dict[str, Any], list[JobEvent]]:
    """Job submits over ``[0, duration_s)``; meta ``duration_s`` adds the longest SLO so every job
    can finish inside the simulated span."""
    if rate_per_min <= 0 or duration_s <= 0 or sigma <= 0:
        raise ValueError("rate_per_min, duration_s and sigma must be > 0")
    if not 0 <= image_fraction <= 1:
        raise ValueError("image_fraction must be in [0, 1]")
    if resolutions not in RESOLUTION_WEIGHTS:
        raise ValueError(f"resolutions must be one of {', '.join(RESOLUTION_WEIGHTS)}")
    catalog = catalog or load_job_catalog()
    rng = np.random.default_rng(seed)
    events: list[JobEvent] = []
    t = float(rng.exponential(60.0 / rate_per_min))
    longest = 0.0
    while t < duration_s:
        kind = "image" if rng.random() < image_fraction else "video"
        side = int(rng.choice(SIDES, p=RESOLUTION_WEIGHTS[resolutions]))
        profile = catalog.profile(kind, None)
        frames = VIDEO_FRAMES if kind == "video" else 1
        steps = profile.default_steps
        slo = round(sigma * SLO_FACTOR * isolated_latency_s(catalog, kind, side, frames, steps), 3)
        longest = max(longest, slo)
        events.append(
            JobEvent(
                round(t, 3),
                f"{prefix}{len(events) + 1:05d}",
                "submit",
                kind,
                None,
                side,
                side,
                frames if kind == "video" else None,
                steps,
                slo,
            )
        )
        t += float(rng.exponential(60.0 / rate_per_min))
    meta = {
        "name": f"genserve-s{sigma:g}",
        "generator": "genserve_jobs",
        "seed": seed,
        "rate_per_min": rate_per_min,
        "image_fraction": image_fraction,
        "sigma": sigma,
        "resolutions": resolutions,
        "slo_factor": SLO_FACTOR,
        "arrivals_s": duration_s,
        "duration_s": round(duration_s + longest, 3),
    }
    return meta, events
