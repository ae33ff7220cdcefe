"""``manage.py bench_stages_replan``: time the live planner's re-placement (Alg. 2 + role changes)."""

from __future__ import annotations

import json

from django.core.management.base import BaseCommand, CommandError

from scheduling.benchmarks.stages import run_bench_replan
from scheduling.sim.stages.cli import StagesCliError


class Command(BaseCommand):
    help = "Benchmark (lab): time one live stage re-placement plan (plan_placement + role_changes) per pool size."

    def add_arguments(self, parser):
        parser.add_argument("--workers", type=int, nargs="+", default=[8, 64])
        parser.add_argument("--chunks", type=int, default=2048)
        parser.add_argument("--jobs", type=int, default=100)
        parser.add_argument("--encodes", type=int, default=300)
        parser.add_argument("--repeats", type=int, default=7)
        parser.add_argument("--gpu", default="h100", help="l20 | h100 | h200")
        parser.add_argument("--json", action="store_true")

    def handle(self, *args, **opts):
        try:
            results = [
                run_bench_replan(
                    workers=n,
                    chunks=opts["chunks"],
                    jobs=opts["jobs"],
                    encodes=opts["encodes"],
                    repeats=opts["repeats"],
                    gpu=opts["gpu"],
                )
                for n in opts["workers"]
            ]
        except StagesCliError as exc:
            raise CommandError(str(exc)) from exc
        if opts["json"]:
            self.stdout.write(json.dumps(results))
            return
        for r in results:
            self.stdout.write(
                f"re-plan of {r['workers']} workers from {r['shapes']} requests, {r['repeats']} runs: "
                f"p50 {r['plan_ms_p50']:.1f} ms, max {r['plan_ms_max']:.1f} ms; Alg. 2 roles {r['plan_roles']}, "
                f"live roles {r['live_roles']}, {r['changes']} changes, on {r['machine']}"
            )
