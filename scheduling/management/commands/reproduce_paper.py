"""``manage.py reproduce_paper``: regenerate the TurboServe reproduction report (scheduling/reproduce)."""

from __future__ import annotations

import time

from django.core.management.base import BaseCommand, CommandError

from contracts.cli import list_option
from scheduling.reproduce import EXPERIMENTS, run_all
from scheduling.reproduce.runner import export_summary


class Command(BaseCommand):
    help = (
        "Research tool (lab): run the TurboServe paper's experiments (Fig. 4, 7, 8, 9, Tables 2, 6, 8–10 and a dependency sweep) "
        "through the scheduling core and write Markdown, PNG charts and results.json with the paper's figures "
        "beside ours."
    )

    def add_arguments(self, parser):
        parser.add_argument("--out", default="docs/results/", help="output directory (default docs/results/)")
        parser.add_argument("--quick", action="store_true", help="shrink every input (smoke test, iteration)")
        parser.add_argument("--seed", type=int, default=0, help="trace generator seed")
        parser.add_argument("--jobs", type=int, default=1, help="worker processes (keep ≤ 2 on a shared box)")
        parser.add_argument(
            "--experiments",
            default=",".join(EXPERIMENTS),
            help=f"comma list, subset of {','.join(EXPERIMENTS)} (others keep their previous results with --resume)",
        )
        parser.add_argument(
            "--resume",
            action="store_true",
            help="reuse units already in <out>/results.json with the same parameters",
        )
        parser.add_argument("--no-progress", action="store_true", help="no progress bar")
        parser.add_argument(
            "--export-summary-to",
            default=None,
            help="after the run, copy its headline summary to DIR/other_seeds/ (seed sensitivity in DIR's report)",
        )

    def handle(self, *args, **opts):
        if opts["jobs"] < 1:
            raise CommandError("--jobs: must be >= 1")
        experiments = list(list_option(opts, "experiments", choices=EXPERIMENTS))
        started = time.perf_counter()
        data = run_all(
            opts["out"],
            quick=opts["quick"],
            seed=opts["seed"],
            jobs=opts["jobs"],
            experiments=experiments,
            resume=opts["resume"],
            progress=not opts["no_progress"],
            log=lambda line: self.stderr.write(line),
        )
        if opts["export_summary_to"]:
            self.stderr.write(f"summary exported to {export_summary(opts['out'], opts['export_summary_to'])}")
        s = data["summary"]["fig7"]
        self.stdout.write(
            f"wrote {opts['out'].rstrip('/')}/README.md, results.json and charts in {time.perf_counter() - started:.0f} s; "
            f"Fig. 7 mean reductions: latency {s['latency_reduction_mean_pct']} % (paper 37.5 %), "
            f"cost {s['cost_reduction_mean_pct']} % (paper 37.2 %)"
        )
