"""``manage.py bench_scaleplan``: how long the scale planner takes to plan a scale-out."""

from __future__ import annotations

from django.core.management.base import BaseCommand, CommandError

from contracts import bench
from scheduling.benchmarks.scaleplan import format_bench, run_bench
from scheduling.sim.cli import CliError


class Command(BaseCommand):
    help = "Benchmark (lab): scale-plan decision time (p50/p99/max) for the largest scale-out at several cluster sizes."

    def add_arguments(self, parser):
        parser.add_argument("--gpus", default="8,64,256,1024", help="comma list of cluster sizes")
        parser.add_argument("--weights-gb", type=float, default=14.0, help="model weights in GB (default 14)")
        bench.add_repeats_argument(parser, default=200, help="measured plans per size")
        bench.add_warmup_argument(parser, default=20, help="warm-up plans per size (dropped)")
        bench.add_report_arguments(parser)

    def handle(self, *args, **opts):
        try:
            report = run_bench(
                gpus=opts["gpus"],
                weights_gb=opts["weights_gb"],
                repeats=opts["repeats"],
                warmup=opts["warmup"],
            )
        except CliError as exc:
            raise CommandError(str(exc)) from exc
        bench.emit(
            report, json_mode=opts["json"], out=opts["out"], text=format_bench, write=self.stdout.write
        )
