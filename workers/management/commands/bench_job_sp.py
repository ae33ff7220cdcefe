"""``manage.py bench_job_sp``: a video job's step time at SP degrees 1/2/4 (docs/jobs.md)."""

from __future__ import annotations

import torch
from django.core.management.base import BaseCommand, CommandError

from contracts import bench
from contracts.cli import list_option
from workers.benchmarks.job_sp import format_job_sp_bench, run_job_sp_bench
from workers.benchmarks.jobs import parse_video
from workers.runtime.models import UnknownPresetError


class Command(BaseCommand):
    help = "Elastic SP: one video job's denoising step time per sequence-parallel degree (figures and JSON)."

    def add_arguments(self, parser):
        parser.add_argument("--preset", default="tiny")
        parser.add_argument("--device", default="cpu")
        parser.add_argument("--video", default="128x128x16", help="video WxHxFRAMES")
        parser.add_argument("--degrees", default="1,2,4", help="comma-separated SP degrees")
        parser.add_argument("--repeats", type=int, default=10, help="measured steps per degree")
        parser.add_argument("--threads", type=int, default=1, help="torch CPU threads (default 1)")
        bench.add_report_arguments(parser)

    def handle(self, *args, **options):
        torch.set_num_threads(options["threads"])
        try:
            width, height, frames = parse_video(options["video"])
        except ValueError as exc:
            raise CommandError(f"--video: {exc}") from exc
        degrees = list_option(options, "degrees", int, minimum=1)
        if options["repeats"] < 1:
            raise CommandError("--repeats must be at least 1")
        try:
            report = run_job_sp_bench(
                options["preset"],
                device=options["device"],
                width=width,
                height=height,
                frames=frames,
                degrees=degrees,
                repeats=options["repeats"],
            )
        except (UnknownPresetError, NotImplementedError, ValueError) as exc:
            raise CommandError(str(exc)) from exc
        bench.emit(
            report,
            json_mode=options["json"],
            out=options["out"],
            text=format_job_sp_bench,
            write=self.stdout.write,
        )
