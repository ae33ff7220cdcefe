"""``manage.py bench_scheduler``: scheduler decision time per event at several cluster sizes."""

from __future__ import annotations

from django.core.management.base import BaseCommand, CommandError

from contracts import bench
from scheduling.benchmarks.scheduler import format_bench, run_bench
from scheduling.sim.cli import CliError


class Command(BaseCommand):
    help = "Benchmark (lab): decision time per event (mean/p99/max) with K sessions per GPU and a realistic event mix."

    def add_arguments(self, parser):
        parser.add_argument("--gpus", default="4,16,64,256,1024", help="comma list of cluster sizes")
        parser.add_argument("--events", type=int, default=2000, help="measured events per size")
        parser.add_argument("--profile", default="b300-1.3b", help="built-in profile (sets K)")
        parser.add_argument(
            "--tenants", type=int, default=0, help="sessions of N tenants (weights 1..N): fair share on"
        )
        bench.add_seed_argument(parser)
        bench.add_report_arguments(parser)

    def handle(self, *args, **opts):
        try:
            report = run_bench(
                gpus=opts["gpus"],
                events=opts["events"],
                profile=opts["profile"],
                seed=opts["seed"],
                progress=not opts["json"],
                tenants=opts["tenants"],
            )
        except CliError as exc:
            raise CommandError(str(exc)) from exc
        bench.emit(
            report, json_mode=opts["json"], out=opts["out"], text=format_bench, write=self.stdout.write
        )
