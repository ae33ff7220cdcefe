"""``manage.py bench_ingest``: chunk-record ingest rate into PostgreSQL through the workers' path."""

from __future__ import annotations

from django.core.management.base import BaseCommand, CommandError

from contracts import bench
from workers.benchmarks.ingest import format_ingest, run_ingest
from workers.benchmarks.live import ServiceUnavailable


class Command(BaseCommand):
    help = "Benchmark chunk-record ingest (COPY path of the workers' reporter) into PostgreSQL."

    def add_arguments(self, parser):
        parser.add_argument(
            "--records", type=int, default=100_000, help="total chunk records (default 100000)"
        )
        parser.add_argument("--batch", type=int, default=100, help="rows per ingest call (default 100)")
        parser.add_argument(
            "--sessions", type=int, default=16, help="sessions the rows belong to (default 16)"
        )
        parser.add_argument(
            "--database",
            default=None,
            help="database on the configured server (default <configured name>_bench, created and migrated)",
        )
        bench.add_report_arguments(parser)

    def handle(self, *args, **options):
        if options["records"] < 1 or options["batch"] < 1 or options["sessions"] < 1:
            raise CommandError("--records, --batch and --sessions must be at least 1")
        try:
            report = run_ingest(
                records=options["records"],
                batch=options["batch"],
                sessions=options["sessions"],
                database=options["database"],
                say=bench.quiet_unless_text(options["json"], self.stdout.write),
            )
        except ServiceUnavailable as exc:
            raise CommandError(str(exc)) from exc
        bench.emit(
            report, json_mode=options["json"], out=options["out"], text=format_ingest, write=self.stdout.write
        )
