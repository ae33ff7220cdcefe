"""``manage.py bench_regions_solve``: time the TORTA macro step (OT + smoothing) for N regions."""

from __future__ import annotations

import json

from django.core.management.base import BaseCommand, CommandError

from scheduling.benchmarks.regions import run_bench_solve
from scheduling.sim.regions.cli import RegionsCliError


class Command(BaseCommand):
    help = "Benchmark (lab): time one macro routing step (OT solve, row-normalise, smoothing); target < 20 ms at 32 regions."

    def add_arguments(self, parser):
        parser.add_argument("--regions", type=int, default=32)
        parser.add_argument("--method", default="emd", help="emd | sinkhorn")
        parser.add_argument("--repeats", type=int, default=200)
        parser.add_argument("--seed", type=int, default=0)
        parser.add_argument("--json", action="store_true")

    def handle(self, *args, **opts):
        try:
            result = run_bench_solve(
                regions=opts["regions"], method=opts["method"], repeats=opts["repeats"], seed=opts["seed"]
            )
        except RegionsCliError as exc:
            raise CommandError(str(exc)) from exc
        if opts["json"]:
            self.stdout.write(json.dumps(result))
        else:
            self.stdout.write(
                f"{result['method']} macro step, {result['regions']} regions ({result['pools']} pools), "
                f"{result['repeats']} solves: p50 {result['solve_ms_p50']:.3f} ms, p99 {result['solve_ms_p99']:.3f} ms, "
                f"max {result['solve_ms_max']:.3f} ms (target < 20 ms) on {result['machine']}"
            )
