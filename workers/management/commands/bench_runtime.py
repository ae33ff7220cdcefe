"""``manage.py bench_runtime``: coalescing, offload/resume, state sizes, wan-1.3b projections, migration."""

from __future__ import annotations

import torch
from django.core.management.base import BaseCommand, CommandError

from contracts import bench
from contracts.cli import list_option
from workers.benchmarks.runtime import format_bench, run_bench
from workers.runtime.models import UnknownPresetError


class Command(BaseCommand):
    help = "Benchmark the coalesced chunk engine and state offload (figures and JSON; docs/runtime.md)."

    def add_arguments(self, parser):
        parser.add_argument("--preset", default="tiny")
        parser.add_argument("--device", default="cpu")
        parser.add_argument("--batches", default="1,2,4,8", help="comma-separated batch sizes")
        parser.add_argument("--steps", type=int, default=8, help="timed rounds per batch size")
        parser.add_argument("--offload-repeats", type=int, default=20)
        parser.add_argument(
            "--offload-presets", default=None, help="comma-separated (default: preset [+ small])"
        )
        parser.add_argument(
            "--no-migration", action="store_true", help="skip the transport's migration bench"
        )
        parser.add_argument("--threads", type=int, default=1, help="torch CPU threads (default 1)")
        bench.add_report_arguments(parser)

    def handle(self, *args, **options):
        torch.set_num_threads(options["threads"])
        batches = list_option(options, "batches", int, minimum=1)
        offload_presets = list_option(options, "offload_presets")
        try:
            report = run_bench(
                options["preset"],
                device=options["device"],
                batches=batches,
                steps=options["steps"],
                offload_repeats=options["offload_repeats"],
                offload_presets=offload_presets,
                migration=not options["no_migration"],
            )
        except (UnknownPresetError, ValueError) as exc:
            raise CommandError(str(exc)) from exc
        bench.emit(
            report, json_mode=options["json"], out=options["out"], text=format_bench, write=self.stdout.write
        )
