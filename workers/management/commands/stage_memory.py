"""``manage.py stage_memory``: sessions per GPU, monolithic vs a shared text-encoder pool (memory model)."""

from __future__ import annotations

import json

from django.core.management.base import BaseCommand, CommandError

from workers.runtime.models import UnknownPresetError
from workers.runtime.stages.memory import ENCODERS, GB, encoder_pool_memory


class Command(BaseCommand):
    help = (
        "Encoder bytes freed per diffusion worker and sessions per GPU, monolithic vs with the shared "
        "text-encoder pool, at equal chunk latency (analytic; docs/runtime.md, stage-level serving)."
    )

    def add_arguments(self, parser):
        parser.add_argument("--preset", default="wan-1.3b")
        parser.add_argument(
            "--encoder",
            default="umt5-xxl",
            help=f"text encoder standing in for the preset's: {', '.join(sorted(ENCODERS))}, or 'preset'",
        )
        parser.add_argument(
            "--gpu-memory-gb", type=float, default=80.0, help="GPU memory, 10^9 bytes (default 80)"
        )
        parser.add_argument(
            "--reserved-gb",
            type=float,
            default=0.0,
            help="CUDA context + activation workspace, the same in both",
        )
        parser.add_argument(
            "--gpus-per-encoder", type=int, default=8, help="diffusion GPUs one encoder replica serves"
        )
        parser.add_argument(
            "--switch-interval-s", type=float, default=None, help="mean time between prompt switches"
        )
        parser.add_argument("--encode-ms", type=float, default=None, help="one encode on the encoder's GPU")
        parser.add_argument("--json", action="store_true", help="print one JSON object only")

    def handle(self, *args, **options):
        checks = {
            "--gpu-memory-gb": options["gpu_memory_gb"] > 0,
            "--reserved-gb": 0 <= options["reserved_gb"] < options["gpu_memory_gb"],
            "--gpus-per-encoder": options["gpus_per_encoder"] >= 1,
            "--switch-interval-s": options["switch_interval_s"] is None or options["switch_interval_s"] > 0,
            "--encode-ms": options["encode_ms"] is None or options["encode_ms"] > 0,
        }
        for flag, ok in checks.items():
            if not ok:
                raise CommandError(f"{flag} is out of range")
        if options["encoder"] != "preset" and options["encoder"] not in ENCODERS:
            raise CommandError(
                f"--encoder: unknown encoder {options['encoder']!r}; known: {', '.join(ENCODERS)}, preset"
            )
        try:
            report = encoder_pool_memory(
                options["preset"],
                encoder=None if options["encoder"] == "preset" else options["encoder"],
                gpu_memory_bytes=int(options["gpu_memory_gb"] * GB),
                reserved_bytes=int(options["reserved_gb"] * GB),
                gpus_per_encoder=options["gpus_per_encoder"],
                switch_interval_s=options["switch_interval_s"],
                encode_ms=options["encode_ms"],
            )
        except (UnknownPresetError, ValueError) as exc:
            raise CommandError(f"--preset: {exc}") from exc
        if options["json"]:
            self.stdout.write(json.dumps(report))
            return
        self.stdout.write(format_report(report))


def format_report(report: dict) -> str:
    weights, sessions, gain = report["weights_bytes"], report["sessions_per_gpu"], report["gain"]
    lines = [
        f"preset {report['preset']}, encoder {report['encoder']}, GPU {report['gpu_memory_bytes'] / 1e9:.1f} GB "
        f"({report['reserved_bytes'] / 1e9:.1f} GB reserved)",
        f"weights: encode {weights['encode'] / 1e9:.3f} GB, diffuse {weights['diffuse'] / 1e9:.3f} GB, "
        f"decode {weights['decode'] / 1e9:.4f} GB; state {report['state_bytes_per_session'] / 1e9:.3f} GB/session",
        f"encoder bytes freed per diffusion worker: {report['encoder_bytes_freed_per_diffusion_worker'] / 1e9:.3f} GB",
        f"sessions per GPU: monolithic {sessions['monolithic']}, shared pool {sessions['shared_pool']} "
        f"({_percent(gain['shared_pool'])}), with the encoder's share over {report['gpus_per_encoder']} GPUs "
        f"{sessions['shared_pool_with_encoder_share']} ({_percent(gain['shared_pool_with_encoder_share'])})",
    ]
    if "encoder_load" in report:
        lines.append(f"encoder load: {json.dumps(report['encoder_load'])}")
    return "\n".join(lines)


def _percent(gain: float | None) -> str:
    return "n/a" if gain is None else f"{gain * 100:+.1f} %"
