"""``manage.py bench_jobs_round``: time GenServe's round decision for 1..12 video groups."""

from __future__ import annotations

import json

from django.core.management.base import BaseCommand, CommandError

from scheduling.benchmarks.jobs_round import bench_round
from scheduling.core.jobs.solver import ROUND_SOLVERS


class Command(BaseCommand):
    help = "Benchmark (lab): time one job-scheduling round (GenServe Alg. 1) for up to 12 groups; target < 2 ms p99."

    def add_arguments(self, parser):
        parser.add_argument("--max-groups", type=int, default=12, help="rounds with 1..N video groups")
        parser.add_argument("--gpus", type=int, default=8)
        parser.add_argument("--repeats", type=int, default=300, help="random rounds per group count")
        parser.add_argument("--policy", default="genserve", help=f"one of {', '.join(ROUND_SOLVERS)}")
        parser.add_argument("--seed", type=int, default=0)
        parser.add_argument("--json", action="store_true")

    def handle(self, *args, **opts):
        for flag in ("max_groups", "gpus", "repeats"):
            if opts[flag] < 1:
                raise CommandError(f"--{flag.replace('_', '-')} must be >= 1")
        if opts["policy"] not in ROUND_SOLVERS:
            raise CommandError(f"--policy must be one of {', '.join(ROUND_SOLVERS)}")
        result = bench_round(
            groups=tuple(range(1, opts["max_groups"] + 1)),
            gpus=opts["gpus"],
            repeats=opts["repeats"],
            policy=opts["policy"],
            seed=opts["seed"],
        )
        if opts["json"]:
            self.stdout.write(json.dumps(result))
            return
        self.stdout.write(f"{result['policy']} round decision, {result['gpus']} GPUs, on {result['machine']}")
        for row in result["rows"]:
            self.stdout.write(
                f"  {row['groups']:>2} groups: p50 {row['ms_p50']:.3f} ms  p99 {row['ms_p99']:.3f} ms  "
                f"max {row['ms_max']:.3f} ms  (CPU p50 {row['cpu_ms_p50']:.3f}, p99 {row['cpu_ms_p99']:.3f} ms)"
            )
        self.stdout.write(
            f"worst p99 {result['p99_ms_worst']:.3f} ms wall, {result['cpu_p99_ms_worst']:.3f} ms CPU "
            f"(target < {result['target_ms']} ms)"
        )
