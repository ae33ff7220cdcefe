"""``manage.py bench_stages_dispatch``: time one TridentServe dispatcher tick (program + HiGHS + GPUs)."""

from __future__ import annotations

import json

from django.core.management.base import BaseCommand, CommandError

from scheduling.benchmarks.stages import run_bench_dispatch
from scheduling.sim.stages.cli import StagesCliError


class Command(BaseCommand):
    help = (
        "Benchmark (lab): time the stage dispatcher's integer program per tick; target <= 50 ms at 128 GPUs."
    )

    def add_arguments(self, parser):
        parser.add_argument("--gpus", type=int, default=128)
        parser.add_argument("--repeats", type=int, default=50)
        parser.add_argument("--pending-per-gpu", type=float, default=1.0)
        parser.add_argument("--idle-fraction", type=float, default=0.25)
        parser.add_argument("--model", default="wan-t2v", help="wan-t2v | sd3-image")
        parser.add_argument("--seed", type=int, default=0)
        parser.add_argument("--json", action="store_true")

    def handle(self, *args, **opts):
        try:
            result = run_bench_dispatch(
                gpus=opts["gpus"],
                repeats=opts["repeats"],
                seed=opts["seed"],
                pending_per_gpu=opts["pending_per_gpu"],
                idle_fraction=opts["idle_fraction"],
                model=opts["model"],
            )
        except StagesCliError as exc:
            raise CommandError(str(exc)) from exc
        if opts["json"]:
            self.stdout.write(json.dumps(result))
        else:
            self.stdout.write(
                f"dispatch tick at {result['gpus']} GPUs, {result['pending']} pending, {result['repeats']} ticks: "
                f"p50 {result['dispatch_ms_p50']:.1f} ms, p99 {result['dispatch_ms_p99']:.1f} ms "
                f"(HiGHS p99 {result['solve_ms_p99']:.1f} ms; target <= 50 ms) on {result['machine']}"
            )
