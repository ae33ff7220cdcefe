"""``manage.py bench_jobs_runtime``: one-shot job pause/resume latency and step time per batch size."""

from __future__ import annotations

import torch
from django.core.management.base import BaseCommand, CommandError

from contracts import bench
from contracts.cli import list_option
from workers.benchmarks.jobs import format_jobs_bench, parse_resolution, parse_video, run_jobs_bench
from workers.runtime.models import UnknownPresetError


class Command(BaseCommand):
    help = (
        "One-shot jobs: pause latency, resume latency as % of a step, step time per batch size "
        "(figures and JSON; docs/runtime.md)."
    )

    def add_arguments(self, parser):
        parser.add_argument("--preset", default="tiny")
        parser.add_argument("--device", default="cpu")
        parser.add_argument("--image", default="64x64", help="image resolution WxH ('' to skip)")
        parser.add_argument("--video", default="64x64x16", help="video WxHxFRAMES ('' to skip)")
        parser.add_argument("--batches", default="1,2,4", help="comma-separated batch sizes")
        parser.add_argument("--repeats", type=int, default=20, help="measured rounds per figure")
        parser.add_argument("--threads", type=int, default=1, help="torch CPU threads (default 1)")
        bench.add_report_arguments(parser)

    def handle(self, *args, **options):
        torch.set_num_threads(options["threads"])
        shapes = []
        try:
            if options["image"]:
                width, height = parse_resolution(options["image"])
                shapes.append(("image", width, height, 1))
            if options["video"]:
                shapes.append(("video", *parse_video(options["video"])))
        except ValueError as exc:
            raise CommandError(f"--image/--video: {exc}") from exc
        if not shapes:
            raise CommandError("--image and --video are both empty: nothing to measure")
        batches = list_option(options, "batches", int, minimum=1)
        if options["repeats"] < 1:
            raise CommandError("--repeats must be at least 1")
        try:
            report = run_jobs_bench(
                options["preset"],
                device=options["device"],
                shapes=shapes,
                batches=batches,
                repeats=options["repeats"],
            )
        except (UnknownPresetError, NotImplementedError, ValueError) as exc:
            raise CommandError(str(exc)) from exc
        bench.emit(
            report,
            json_mode=options["json"],
            out=options["out"],
            text=format_jobs_bench,
            write=self.stdout.write,
        )
