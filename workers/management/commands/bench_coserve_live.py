"""``manage.py bench_coserve_live``: one-shot jobs beside N live streams on a real worker process,
each job's completion time against its compute time and the streams' chunk lateness with and without
jobs (docs/jobs.md "Jobs beside streams", issue 32)."""

from __future__ import annotations

from django.conf import settings
from django.core.management.base import BaseCommand, CommandError

from contracts import bench
from contracts.cli import list_option
from workers.benchmarks.coserve import DEFAULT_MIX, format_coserve_bench, parse_job, run_coserve_bench


class Command(BaseCommand):
    help = "Jobs beside N live streams on a worker process: completion vs compute, chunk lateness p50/p99."

    def add_arguments(self, parser):
        parser.add_argument("--preset", default="tiny", help="the worker's model preset (default tiny)")
        parser.add_argument(
            "--streams", default="1,2,4", help="comma-separated stream counts (default 1,2,4)"
        )
        parser.add_argument(
            "--jobs",
            default=",".join(DEFAULT_MIX),
            help="comma-separated KIND:WxH[xFRAMES]:STEPS, run in turn",
        )
        parser.add_argument("--seconds", type=float, default=5.0, help="streams alone, measured (default 5)")
        parser.add_argument("--warmup", type=float, default=3.0, help="seconds before measuring (default 3)")
        bench.add_report_arguments(parser)

    def handle(self, *args, **options):
        counts = list(list_option(options, "streams", int, minimum=1))
        try:
            mix = [parse_job(s.strip()) for s in options["jobs"].split(",") if s.strip()]
        except ValueError as exc:
            raise CommandError(f"--jobs: {exc}") from exc
        report = run_coserve_bench(
            settings.REDIS_URL,
            preset=options["preset"],
            stream_counts=counts,
            mix=mix,
            seconds=options["seconds"],
            warmup_s=options["warmup"],
        )
        bench.emit(
            report,
            json_mode=options["json"],
            out=options["out"],
            text=format_coserve_bench,
            write=self.stdout.write,
        )
