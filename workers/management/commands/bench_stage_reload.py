"""``manage.py bench_stage_reload``: weights freed and stage load time on a role change."""

from __future__ import annotations

from django.core.management.base import BaseCommand, CommandError

from contracts import bench
from contracts.catalog.presets import PRESETS
from workers.benchmarks.stage_reload import format_report, run_stage_reload


class Command(BaseCommand):
    help = (
        "A worker's weight bytes before/after EDC -> DC, and the DC -> EDC stage load time from the "
        "local file and from a peer holder (docs/runtime.md)."
    )

    def add_arguments(self, parser):
        parser.add_argument("--preset", default="tiny", help="tiny or small (default tiny)")
        bench.add_repeats_argument(parser, default=10, help="measured loads (default 10)")
        bench.add_warmup_argument(parser, default=1, help="dropped loads (default 1)")
        bench.add_report_arguments(parser)

    def handle(self, *args, **options):
        if options["preset"] not in PRESETS:
            raise CommandError(f"--preset: unknown preset {options['preset']!r}")
        write = bench.quiet_unless_text(options["json"], self.stdout.write)
        report = run_stage_reload(
            options["preset"], repeats=options["repeats"], warmup=options["warmup"], progress=write
        )
        bench.emit(
            report, json_mode=options["json"], out=options["out"], text=format_report, write=self.stdout.write
        )
