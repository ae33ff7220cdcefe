"""``manage.py gen_trace``: write a seeded session trace (JSON Lines, docs/traces.md), optionally
with a GenServe-shaped mix of one-shot jobs (``--shape genserve`` alone, or ``--job-rate-per-min`` on
any session shape)."""

from __future__ import annotations

import json
import math
import sys

from django.core.management.base import BaseCommand, CommandError

from scheduling.sim import generators
from scheduling.sim.jobs.workload import RESOLUTION_WEIGHTS, genserve_jobs
from scheduling.sim.traces import trace_stats, write_mixed_trace, write_trace

SHAPES = (*generators.TABLE12, "table11", "table7", "poisson", "diurnal", "segment", "genserve")
JOB_FLAGS = ("job_rate_per_min", "job_image_fraction", "job_sigma", "job_resolutions", "job_duration_s")


def parse_load_mix(text: str) -> list[tuple[float, float]]:
    """``"1.0:0.7,2.0:0.3"`` → ``[(1.0, 0.7), (2.0, 0.3)]`` (load : weight)."""
    pairs = []
    for item in text.split(","):
        load, sep, weight = item.partition(":")
        if not sep:
            raise ValueError(f"{item!r} is not load:weight")
        load_f, weight_f = float(load), float(weight)
        if not (math.isfinite(load_f) and load_f > 0 and math.isfinite(weight_f) and weight_f >= 0):
            raise ValueError(f"{item!r}: load must be > 0 and weight >= 0")
        pairs.append((load_f, weight_f))
    if not any(w > 0 for _, w in pairs):
        raise ValueError("at least one weight must be > 0")
    return pairs


class Command(BaseCommand):
    help = (
        "Research tool (lab): generate a seeded session trace: TurboServe-shaped (T1..T6 = Table 12, table11, table7, "
        "segment = Table 5 volatility level) or open-ended (poisson, diurnal). Deterministic per seed."
    )

    def add_arguments(self, parser):
        parser.add_argument("--shape", required=True, help=f"one of {', '.join(SHAPES)}")
        parser.add_argument("--seed", type=int, default=0)
        parser.add_argument("--out", required=True, help="output .jsonl path ('-' for stdout)")
        parser.add_argument("--level", type=int, help="segment: volatility level 1..10 (Table 5)")
        parser.add_argument("--rate-per-min", type=float, help="poisson: mean arrivals per minute")
        parser.add_argument("--duration-s", type=float, help="poisson/diurnal: trace length in seconds")
        parser.add_argument("--mean-session-s", type=float, help="poisson/diurnal: mean session lifetime")
        parser.add_argument("--active-fraction", type=float, help="poisson/diurnal: duty cycle of a session")
        parser.add_argument("--burst-factor", type=float, help="poisson/diurnal: MMPP burst rate multiplier")
        parser.add_argument(
            "--burst-fraction", type=float, help="poisson/diurnal: fraction of time in bursts"
        )
        parser.add_argument("--peak-rate-per-min", type=float, help="diurnal: peak arrivals per minute")
        parser.add_argument("--trough-rate-per-min", type=float, help="diurnal: trough arrivals per minute")
        parser.add_argument("--period-s", type=float, help="diurnal: period of the cycle (default: duration)")
        parser.add_argument("--load-mix", help="relative per-chunk costs, e.g. 1.0:0.7,2.0:0.3")
        parser.add_argument("--stats", action="store_true", help="print per-span statistics")
        parser.add_argument(
            "--job-rate-per-min",
            type=float,
            help="add GenServe-shaped one-shot jobs at this Poisson rate (default 24 with --shape genserve)",
        )
        parser.add_argument("--job-image-fraction", type=float, help="jobs: share of images (default 0.5)")
        parser.add_argument("--job-sigma", type=float, help="jobs: SLO scale σ (default 1.0)")
        parser.add_argument(
            "--job-resolutions", help=f"jobs: resolution mix, one of {', '.join(RESOLUTION_WEIGHTS)}"
        )
        parser.add_argument(
            "--job-duration-s", type=float, help="jobs: submit window (default: the session trace's, or 600)"
        )

    def handle(self, *args, **opts):
        shape = opts["shape"]
        if shape not in SHAPES:
            raise CommandError(f"--shape must be one of {', '.join(SHAPES)}, got {shape!r}")
        if opts["seed"] < 0:
            raise CommandError("--seed must be >= 0")
        load_mix = None
        if opts["load_mix"]:
            try:
                load_mix = parse_load_mix(opts["load_mix"])
            except ValueError as exc:
                raise CommandError(f"--load-mix: {exc}") from None
        open_flags = (
            "rate_per_min",
            "duration_s",
            "mean_session_s",
            "active_fraction",
            "burst_factor",
            "burst_fraction",
            "peak_rate_per_min",
            "trough_rate_per_min",
            "period_s",
        )
        if shape == "genserve" and load_mix is not None:
            raise CommandError("--load-mix is not supported with --shape genserve (jobs only)")
        if shape not in ("poisson", "diurnal"):
            for name in open_flags:
                if opts[name] is not None:
                    raise CommandError(f"--{name.replace('_', '-')} applies only to --shape poisson/diurnal")
        if shape != "segment" and opts["level"] is not None:
            raise CommandError("--level applies only to --shape segment")
        for name in open_flags:
            value = opts[name]
            if value is not None and (not math.isfinite(value) or value < 0):
                raise CommandError(f"--{name.replace('_', '-')} must be a finite number >= 0")
        with_jobs = shape == "genserve" or any(opts[name] is not None for name in JOB_FLAGS)
        meta, events = ({}, []) if shape == "genserve" else self._generate(shape, opts, load_mix)
        jobs = self._jobs(meta, opts) if with_jobs else []
        out = opts["out"]
        try:
            target = sys.stdout if out == "-" else out
            if with_jobs:
                write_mixed_trace(target, events, jobs, meta)
            else:
                write_trace(target, events, meta)
        except OSError as exc:
            raise CommandError(f"--out: cannot write {out}: {exc}") from None
        if out != "-":
            self.stderr.write(f"wrote {len(events) + len(jobs)} events to {out}")
        if opts["stats"]:
            span = meta.get("span_s") or meta.get("window_s") or 60.0
            stats = trace_stats(events, span_s=span, duration_s=meta["duration_s"])
            stream = self.stderr if out == "-" else self.stdout
            stream.write(json.dumps(stats, indent=2))

    def _jobs(self, meta, opts):
        """GenServe-shaped job submits (scheduling.sim.jobs.workload); records them in ``meta``."""
        duration = opts["job_duration_s"] or (meta.get("duration_s") if meta else None) or 600.0
        try:
            jobs_meta, jobs = genserve_jobs(
                rate_per_min=24.0 if opts["job_rate_per_min"] is None else opts["job_rate_per_min"],
                duration_s=duration,
                image_fraction=0.5 if opts["job_image_fraction"] is None else opts["job_image_fraction"],
                sigma=1.0 if opts["job_sigma"] is None else opts["job_sigma"],
                resolutions=opts["job_resolutions"] or "uniform",
                seed=opts["seed"],
            )
        except ValueError as exc:
            raise CommandError(f"--job-*: {exc}") from None
        if not meta:
            meta.update(jobs_meta)
        else:
            meta["jobs"] = jobs_meta
            meta["duration_s"] = max(float(meta.get("duration_s", 0.0)), jobs_meta["duration_s"])
        return jobs

    def _generate(self, shape, opts, load_mix):
        seed = opts["seed"]

        def pick(name, default):
            return default if opts[name] is None else opts[name]

        try:
            if shape in generators.TABLE12 or shape == "table11":
                return generators.paper_trace(shape, seed, load_mix=load_mix)
            if load_mix is not None and shape in ("table7", "segment"):
                raise CommandError(f"--load-mix is not supported with --shape {shape}")
            if shape == "table7":
                return generators.table7_windows(seed)
            if shape == "segment":
                if opts["level"] is None:
                    raise CommandError("--level is required with --shape segment")
                if not 1 <= opts["level"] <= 10:
                    raise CommandError("--level must be 1..10")
                return generators.segment_family(opts["level"], seed)
            common = {
                "active_fraction": pick("active_fraction", 0.6),
                "burst_factor": pick("burst_factor", 1.0),
                "burst_fraction": pick("burst_fraction", 0.1),
                "load_mix": load_mix,
                "seed": seed,
            }
            if shape == "poisson":
                if opts["rate_per_min"] is None:
                    raise CommandError("--rate-per-min is required with --shape poisson")
                return generators.poisson_trace(
                    opts["rate_per_min"], pick("duration_s", 600.0), pick("mean_session_s", 180.0), **common
                )
            return generators.diurnal_trace(
                pick("duration_s", 3600.0),
                peak_rate_per_min=pick("peak_rate_per_min", 60.0),
                trough_rate_per_min=pick("trough_rate_per_min", 10.0),
                period_s=opts["period_s"],
                mean_session_s=pick("mean_session_s", 180.0),
                **common,
            )
        except ValueError as exc:
            raise CommandError(f"bad shape parameters: {exc}") from None
