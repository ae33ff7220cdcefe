"""``manage.py bench_decision_run``: the whole live decision run on synthetic rows at several sizes."""

from __future__ import annotations

from django.core.management.base import BaseCommand, CommandError

from contracts import bench
from scheduling.benchmarks.decision_run import format_bench, run_bench
from scheduling.sim.cli import CliError


class Command(BaseCommand):
    help = (
        "Benchmark (lab): the live decision run (rows → snapshot → policy → apply → commands) p50/p99 "
        "and queries per run, on synthetic workers and sessions inserted in a transaction rolled back after."
    )

    def add_arguments(self, parser):
        parser.add_argument("--gpus", default="1024,10000", help="comma list of cluster sizes")
        parser.add_argument("--runs", type=int, default=50, help="timed runs per size")
        bench.add_seed_argument(parser)
        bench.add_report_arguments(parser)

    def handle(self, *args, **opts):
        try:
            report = run_bench(gpus=opts["gpus"], runs=opts["runs"], seed=opts["seed"])
        except CliError as exc:
            raise CommandError(str(exc)) from exc
        bench.emit(
            report, json_mode=opts["json"], out=opts["out"], text=format_bench, write=self.stdout.write
        )
