"""``manage.py reproduce_genserve``: the GenServe results section (docs/results/genserve.md, .json, .png)."""

from __future__ import annotations

from pathlib import Path

from django.core.management.base import BaseCommand, CommandError

from scheduling.reproduce.genserve import run_reproduction, write_outputs


def _floats(flag: str, text: str) -> tuple[float, ...]:
    try:
        values = tuple(float(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise CommandError(f"--{flag}: expected comma-separated numbers, got {text!r}") from None
    if not values or any(not v > 0 for v in values):
        raise CommandError(f"--{flag}: expected positive numbers, got {text!r}")
    return values


class Command(BaseCommand):
    help = "Research tool (lab): reproduce GenServe's ablation ladder and σ sweep, with and without streams (issue 14)."

    def add_arguments(self, parser):
        parser.add_argument("--rates", default="24,48,72", help="job arrivals per minute, comma-separated")
        parser.add_argument("--sigmas", default="0.5,0.75,1,1.25,1.5", help="SLO scales σ")
        parser.add_argument("--seeds", default="0,1", help="comma-separated seeds (figures are averages)")
        parser.add_argument("--window-s", type=float, default=600.0, help="submit window per run")
        parser.add_argument("--session-rate-per-min", type=float, default=6.0, help="streams beside the jobs")
        parser.add_argument("--out-dir", default="docs/results", help="where genserve.md/.json/.png go")

    def handle(self, *args, **opts):
        try:
            seeds = tuple(int(x) for x in opts["seeds"].split(",") if x.strip())
        except ValueError:
            raise CommandError(f"--seeds: expected comma-separated integers, got {opts['seeds']!r}") from None
        if not seeds or min(seeds) < 0:
            raise CommandError("--seeds: give at least one seed >= 0")
        if not opts["window_s"] > 0:
            raise CommandError("--window-s must be > 0")
        if not opts["session_rate_per_min"] > 0:
            raise CommandError("--session-rate-per-min must be > 0")
        data = run_reproduction(
            rates=_floats("rates", opts["rates"]),
            sigmas=_floats("sigmas", opts["sigmas"]),
            seeds=seeds,
            window_s=opts["window_s"],
            session_rate_per_min=opts["session_rate_per_min"],
            log=lambda line: self.stderr.write(line),
        )
        for path in write_outputs(data, Path(opts["out_dir"])):
            self.stdout.write(f"wrote {path}")
