"""``manage.py bench_glass``: glass to glass in headless Chromium, per transport (sessions.benchmarks.glass)."""

from __future__ import annotations

from django.core.management.base import BaseCommand, CommandError

from contracts import bench
from contracts.cli import list_option
from sessions.benchmarks.glass import TRANSPORTS, format_verdict, run_glass
from workers.benchmarks.content import CONTENTS
from workers.benchmarks.live import ServiceUnavailable


class Command(BaseCommand):
    help = "Benchmark glass to glass (worker encode done → first frame presented) in headless Chromium."

    def add_arguments(self, parser):
        parser.add_argument(
            "--transports", default=",".join(TRANSPORTS), help=f"comma-separated, of {', '.join(TRANSPORTS)}"
        )
        parser.add_argument("--chunks", type=int, default=24, help="chunks per transport (default 24)")
        bench.add_warmup_argument(parser, default=4, help="first chunks not counted (the player starting)")
        parser.add_argument(
            "--period", type=float, default=0.75, help="seconds between chunks (default 0.75)"
        )
        parser.add_argument("--width", type=int, default=832)
        parser.add_argument("--height", type=int, default=480)
        parser.add_argument("--frames", type=int, default=12, help="frames per chunk (default 12)")
        parser.add_argument("--content", choices=CONTENTS, default="photo")
        parser.add_argument("--database", default=None, help="default <configured name>_bench")
        parser.add_argument("--keep-logs", default=None, help="copy the processes' logs to this folder")
        bench.add_report_arguments(parser)

    def handle(self, *args, **options):
        transports = list(list_option(options, "transports", str))
        unknown = [t for t in transports if t not in TRANSPORTS]
        if unknown or not transports:
            raise CommandError(f"--transports: choose from {', '.join(TRANSPORTS)} (got {unknown or 'none'})")
        if options["chunks"] < 1 or not 0 <= options["warmup"] < options["chunks"]:
            raise CommandError("--chunks must be positive and 0 <= --warmup < --chunks")
        try:
            report = run_glass(
                transports=transports,
                chunks=options["chunks"],
                warmup=options["warmup"],
                period=options["period"],
                width=options["width"],
                height=options["height"],
                frames=options["frames"],
                content=options["content"],
                database=options["database"],
                keep_logs=options["keep_logs"],
                say=bench.quiet_unless_text(options["json"], self.stdout.write),
            )
        except (ServiceUnavailable, FileNotFoundError) as exc:
            raise CommandError(str(exc)) from exc
        bench.emit(
            report,
            json_mode=options["json"],
            out=options["out"],
            text=format_verdict,
            write=self.stdout.write,
        )
