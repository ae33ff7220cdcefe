"""``manage.py bench_stage_handoff``: stage hand-off latency and throughput between two processes."""

from __future__ import annotations

from django.core.management.base import BaseCommand, CommandError

from contracts import bench
from workers.benchmarks.stage_handoff import DEFAULT_PRESETS, format_report, run_stage_handoff
from workers.runtime.models import UnknownPresetError


class Command(BaseCommand):
    help = (
        "One-way latency and streaming throughput of per-session embeddings and latents over a stage "
        "link (Gloo on CPU, NCCL with --device cuda) between two processes (docs/runtime.md)."
    )

    def add_arguments(self, parser):
        parser.add_argument("--presets", nargs="+", default=list(DEFAULT_PRESETS))
        parser.add_argument("--device", default="cpu", help="cpu (Gloo) or cuda[:N] (NCCL)")
        parser.add_argument("--stream", type=int, default=50, help="messages per throughput run (default 50)")
        parser.add_argument(
            "--max-in-flight-mb", type=float, default=256.0, help="the link's in-flight bound (default 256)"
        )
        parser.add_argument(
            "--stage-times",
            nargs="*",
            default=["demo", "tiny", "small"],
            metavar="PRESET",
            help="also time each stage of these presets at batch 1 (default demo tiny small; none: skip)",
        )
        bench.add_repeats_argument(parser, default=20, help="measured round trips per payload (default 20)")
        bench.add_warmup_argument(parser, default=3, help="dropped round trips per payload (default 3)")
        bench.add_report_arguments(parser)

    def handle(self, *args, **options):
        if options["max_in_flight_mb"] <= 0:
            raise CommandError("--max-in-flight-mb must be positive")
        if not options["device"].startswith(("cpu", "cuda")):
            raise CommandError(f"--device: expected cpu or cuda[:N], got {options['device']!r}")
        write = bench.quiet_unless_text(options["json"], self.stdout.write)
        try:
            report = run_stage_handoff(
                tuple(options["presets"]),
                device=options["device"],
                repeats=options["repeats"],
                warmup=options["warmup"],
                stream=options["stream"],
                max_in_flight_bytes=int(options["max_in_flight_mb"] * 2**20),
                stage_time_presets=tuple(options["stage_times"]),
                progress=write,
            )
        except UnknownPresetError as exc:
            raise CommandError(f"--presets/--stage-times: {exc}") from exc
        except ValueError as exc:
            raise CommandError(str(exc)) from exc
        bench.emit(
            report, json_mode=options["json"], out=options["out"], text=format_report, write=self.stdout.write
        )
