"""``manage.py bench_stage_decode``: a one-shot job's final decode on a C worker vs in process."""

from __future__ import annotations

from django.core.management.base import BaseCommand, CommandError

from contracts import bench
from workers.benchmarks.stage_decode import format_report, run_stage_decode
from workers.runtime.models import UnknownPresetError


class Command(BaseCommand):
    help = (
        "A D worker's one-shot job decode on a decoder (C) worker process vs the same decode in "
        "process (docs/runtime.md)."
    )

    def add_arguments(self, parser):
        parser.add_argument("--preset", default="tiny", help="tiny or small (default tiny)")
        parser.add_argument("--device", default="cpu", help="cpu (Gloo) or cuda[:N] (NCCL, needs two GPUs)")
        parser.add_argument(
            "--kind", default="video", choices=["video", "image"], help="job kind (default video)"
        )
        parser.add_argument("--size", type=int, default=64, help="width and height in pixels (default 64)")
        parser.add_argument("--frames", type=int, default=16, help="video frames (default 16)")
        bench.add_repeats_argument(parser, default=10, help="measured rounds (default 10)")
        bench.add_warmup_argument(parser, default=2, help="dropped rounds (default 2)")
        bench.add_report_arguments(parser)

    def handle(self, *args, **options):
        if not options["device"].startswith(("cpu", "cuda")):
            raise CommandError(f"--device: expected cpu or cuda[:N], got {options['device']!r}")
        write = bench.quiet_unless_text(options["json"], self.stdout.write)
        try:
            report = run_stage_decode(
                options["preset"],
                device=options["device"],
                kind=options["kind"],
                size=options["size"],
                frames=options["frames"],
                repeats=options["repeats"],
                warmup=options["warmup"],
                progress=write,
            )
        except UnknownPresetError as exc:
            raise CommandError(f"--preset: {exc}") from exc
        except ValueError as exc:
            raise CommandError(str(exc)) from exc
        bench.emit(
            report, json_mode=options["json"], out=options["out"], text=format_report, write=self.stdout.write
        )
