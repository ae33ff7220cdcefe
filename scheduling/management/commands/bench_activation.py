"""``manage.py bench_activation``: activation → first chunk and the control plane's share of it."""

from __future__ import annotations

from django.core.management.base import BaseCommand, CommandError

from contracts import bench
from contracts.cli import list_option
from scheduling.benchmarks.activation import PATHS, format_activation, run_activation
from scheduling.benchmarks.platform import add_platform_arguments, platform_options
from workers.benchmarks.live import BenchmarkFailed, ServiceUnavailable


class Command(BaseCommand):
    help = (
        "Benchmark (lab): activation → first chunk with the control plane's share (real platform processes)."
    )

    def add_arguments(self, parser):
        parser.add_argument("--sessions", type=int, default=20, help="measured activations (default 20)")
        bench.add_warmup_argument(parser, default=2, help="activations before measuring (default 2)")
        parser.add_argument("--workers", type=int, default=2, help="local CPU workers kept ready (default 2)")
        parser.add_argument(
            "--pause", type=float, default=1.0, help="seconds between activations (default 1)"
        )
        parser.add_argument(
            "--paths",
            default="native",
            help="comma list of front doors measured side by side: native (REST + session socket), "
            "realtime (vLLM-Omni's /v1/realtime/video); default native",
        )
        add_platform_arguments(parser)
        bench.add_report_arguments(parser)

    def handle(self, *args, **options):
        if options["sessions"] < 1 or options["warmup"] < 0 or options["workers"] < 1:
            raise CommandError("--sessions and --workers must be at least 1, --warmup at least 0")
        try:
            report = run_activation(
                sessions=options["sessions"],
                paths=list_option(options, "paths", choices=PATHS),
                warmup=options["warmup"],
                workers=options["workers"],
                pause=options["pause"],
                **platform_options(options),
                say=bench.quiet_unless_text(options["json"], self.stdout.write),
            )
        except (ServiceUnavailable, BenchmarkFailed) as exc:
            raise CommandError(str(exc)) from exc
        bench.emit(
            report,
            json_mode=options["json"],
            out=options["out"],
            text=format_activation,
            write=self.stdout.write,
        )
