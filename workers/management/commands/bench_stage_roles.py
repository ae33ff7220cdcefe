"""``manage.py bench_stage_roles``: chunk and prompt-switch latency of a DC worker fed by an E worker."""

from __future__ import annotations

from django.core.management.base import BaseCommand, CommandError

from contracts import bench
from workers.benchmarks.stage_roles import format_report, run_stage_roles
from workers.runtime.models import UnknownPresetError


class Command(BaseCommand):
    help = (
        "Chunk latency of a DC worker fed by an encoder (E) worker process vs a monolithic (EDC) one, "
        "and the prompt-switch latency (encode round trip) (docs/runtime.md)."
    )

    def add_arguments(self, parser):
        parser.add_argument("--preset", default="tiny", help="demo, tiny or small (default tiny)")
        parser.add_argument("--device", default="cpu", help="cpu (Gloo) or cuda[:N] (NCCL, needs two GPUs)")
        parser.add_argument("--sessions", type=int, default=2, help="sessions per batch (default 2)")
        bench.add_repeats_argument(parser, default=20, help="measured rounds (default 20)")
        bench.add_warmup_argument(parser, default=3, help="dropped rounds (default 3)")
        bench.add_report_arguments(parser)

    def handle(self, *args, **options):
        if options["sessions"] < 1:
            raise CommandError("--sessions must be at least 1")
        if not options["device"].startswith(("cpu", "cuda")):
            raise CommandError(f"--device: expected cpu or cuda[:N], got {options['device']!r}")
        write = bench.quiet_unless_text(options["json"], self.stdout.write)
        try:
            report = run_stage_roles(
                options["preset"],
                device=options["device"],
                sessions=options["sessions"],
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
