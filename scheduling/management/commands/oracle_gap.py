"""``manage.py oracle_gap``: placement heuristic vs the exact MILP oracle (TurboServe Fig. 9 right)."""

from __future__ import annotations

import json
import sys

from django.core.management.base import BaseCommand, CommandError

from contracts.cli import list_option
from scheduling.sim.oracles.gap import load_heuristic, placement_gap

DEFAULT_HEURISTIC = "scheduling.sim.oracles.gap:turboserve_heuristic"


class Command(BaseCommand):
    help = (
        "Research tool (lab): mean and max gap of a placement heuristic (default: the scheduling core's placement controller) "
        "to the exact min-max placement (MILP, HiGHS) on random heterogeneous instances."
    )

    def add_arguments(self, parser):
        parser.add_argument("--gpus", default="4,8,12,16", help="comma-separated GPU counts")
        parser.add_argument("--instances", type=int, default=10, help="instances per GPU count")
        parser.add_argument("--seed", type=int, default=0)
        parser.add_argument("--eta", type=float, default=0.5, help="migration weight η in L + η·Σκ")
        parser.add_argument("--time-limit", type=float, default=60.0, help="MILP time limit per instance (s)")
        parser.add_argument("--heuristic", default=DEFAULT_HEURISTIC, help="package.module:function")
        parser.add_argument("--json", action="store_true", help="print exactly one JSON object")
        parser.add_argument("--rows", action="store_true", help="with --json, include every instance")

    def handle(self, *args, **opts):
        gpu_counts = list_option(opts, "gpus", int, minimum=1, maximum=64)
        if opts["instances"] < 1:
            raise CommandError("--instances must be >= 1")
        if not opts["eta"] >= 0:
            raise CommandError("--eta must be >= 0")
        if not opts["time_limit"] > 0:
            raise CommandError("--time-limit must be > 0")
        try:
            heuristic = load_heuristic(opts["heuristic"])
        except (ImportError, ValueError) as exc:
            raise CommandError(f"--heuristic: {exc} (pass --heuristic package.module:function)") from None

        progress = None
        bar = None
        try:
            from tqdm import tqdm

            bar = tqdm(total=opts["instances"] * len(gpu_counts), desc="oracle_gap", file=sys.stderr)

            def progress(done, total):
                bar.update(done - bar.n)
        except ImportError:  # pragma: no cover - tqdm is a dependency
            pass
        try:
            report = placement_gap(
                heuristic,
                n_instances=opts["instances"],
                gpu_counts=gpu_counts,
                seed=opts["seed"],
                eta=opts["eta"],
                time_limit_s=opts["time_limit"],
                progress=progress,
            )
        finally:
            if bar is not None:
                bar.close()
        report["heuristic"] = opts["heuristic"]
        if not opts["rows"]:
            report.pop("rows")
        if opts["json"]:
            self.stdout.write(json.dumps(report))
            return
        self.stdout.write(f"heuristic {opts['heuristic']}  eta={opts['eta']}  seed={opts['seed']}")
        self.stdout.write(
            f"{'GPUs':>5} {'inst':>5} {'sess':>6} {'mean gap %':>11} {'max gap %':>10} "
            f"{'mean L gap %':>13} {'heur ms':>8} {'oracle ms':>10} {'unproven':>9}"
        )
        for key, row in [*report["by_gpus"].items(), ("all", report["overall"])]:
            self.stdout.write(
                f"{key:>5} {row['instances']:>5} {row['sessions_mean']:>6.1f} {row['mean_gap_pct']:>11.2f} "
                f"{row['max_gap_pct']:>10.2f} {row['mean_bottleneck_gap_pct']:>13.2f} "
                f"{row['heuristic_ms_mean']:>8.2f} {row['oracle_ms_mean']:>10.1f} {row['not_proven']:>9}"
            )
        self.stdout.write("paper (TurboServe Fig. 9 right): 3.6 % mean, 6.5 % max")
