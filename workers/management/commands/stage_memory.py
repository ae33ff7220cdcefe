"""``manage.py stage_memory``: sessions per GPU, monolithic vs a shared text-encoder pool (memory model).

The model is ``scheduling.sim.stages.encoder_pool`` (the one ``reproduce_stages`` prints too); the
preset's figures come from the runtime (``workers.runtime.stages.memory.stream_figures``). This
command joins them: neither pure layer may import the other.
"""

from __future__ import annotations

import json
from dataclasses import replace

from django.core.management.base import BaseCommand, CommandError

from scheduling.core.stages.stage_profiles import GB, GPUS
from scheduling.sim.stages.encoder_pool import (
    ACTIVE_SESSIONS,
    SWITCHES_PER_SESSION_S,
    encoder_pool_gain,
    stream_model,
)
from workers.runtime.models import UnknownPresetError
from workers.runtime.stages.memory import ENCODERS, stream_figures


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
            "--gpu", default="h100", help=f"GPU profile (encode time, reserve): {', '.join(GPUS)}"
        )
        parser.add_argument(
            "--gpu-memory-gb",
            type=float,
            nargs="+",
            default=None,
            help="GPU memory sizes, 10^9 bytes (default: the --gpu profile's); one row each",
        )
        parser.add_argument(
            "--reserved-gb", type=float, default=None, help="CUDA context and slack (default: the profile's)"
        )
        parser.add_argument(
            "--active",
            type=int,
            default=ACTIVE_SESSIONS,
            help="sessions whose chunk is in flight at once (their activations are resident)",
        )
        parser.add_argument(
            "--switch-interval-s",
            type=float,
            default=1 / SWITCHES_PER_SESSION_S,
            help="mean time between a session's prompt encodes (start and switches)",
        )
        parser.add_argument(
            "--encode-ms", type=float, default=None, help="one encode on a pool GPU (default: analytic)"
        )
        parser.add_argument("--json", action="store_true", help="print one JSON object only")

    def handle(self, *args, **options):
        gpu = GPUS.get(options["gpu"].lower())
        if gpu is None:
            raise CommandError(f"--gpu: unknown GPU {options['gpu']!r}; known: {', '.join(GPUS)}")
        sizes = options["gpu_memory_gb"] or [gpu.memory_bytes / GB]
        reserved = gpu.reserve_bytes / GB if options["reserved_gb"] is None else options["reserved_gb"]
        checks = {
            "--gpu-memory-gb": all(size > 0 for size in sizes),
            "--reserved-gb": all(0 <= reserved < size for size in sizes),
            "--active": options["active"] >= 0,
            "--switch-interval-s": options["switch_interval_s"] > 0,
            "--encode-ms": options["encode_ms"] is None or options["encode_ms"] > 0,
        }
        for flag, ok in checks.items():
            if not ok:
                raise CommandError(f"{flag} is out of range")
        encoder = options["encoder"]
        if encoder != "preset" and encoder not in ENCODERS:
            raise CommandError(
                f"--encoder: unknown encoder {encoder!r}; known: {', '.join(ENCODERS)}, preset"
            )
        try:
            figures = stream_figures(options["preset"], encoder=None if encoder == "preset" else encoder)
        except (UnknownPresetError, ValueError) as exc:
            raise CommandError(f"--preset: {exc}") from exc
        model = stream_model(**figures)
        rows = [
            encoder_pool_gain(
                model,
                replace(gpu, memory_bytes=size * GB, reserve_bytes=reserved * GB),
                active=options["active"],
                switches_per_session_s=1 / options["switch_interval_s"],
                encode_s=None if options["encode_ms"] is None else options["encode_ms"] / 1000,
            ).to_json()
            for size in sizes
        ]
        report = {
            "preset": options["preset"],
            "encoder": encoder if encoder != "preset" else f"{options['preset']} (built-in)",
            "gpu": gpu.name,
            "switch_interval_s": options["switch_interval_s"],
            "figures": figures,
            "chunk_workspace_bytes": model.chunk_workspace_bytes,
            "rows": rows,
        }
        if options["json"]:
            self.stdout.write(json.dumps(report))
            return
        self.stdout.write(format_report(report))


def format_report(report: dict) -> str:
    figures = report["figures"]
    lines = [
        f"preset {report['preset']}, encoder {report['encoder']}, {report['gpu']} profile; "
        f"one prompt encode per session per {report['switch_interval_s']:g} s",
        f"weights: diffusion worker (diffuse + decode) {figures['worker_weight_bytes'] / 1e9:.3f} GB, "
        f"encoder {figures['encoder_weight_bytes'] / 1e9:.3f} GB; state {figures['state_bytes'] / 1e9:.3f} GB "
        f"per session; chunk workspace {report['chunk_workspace_bytes'] / 1e9:.3f} GB per active session",
        "| GPU GB | reserve GB | active | monolithic | shared pool | gain | encoder share | "
        "pool GPUs per 100 | gain after pool GPUs |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for row in report["rows"]:
        lines.append(
            f"| {row['memory_gb']:g} | {row['reserve_gb']:g} | {row['active']} | {row['sessions_monolithic']} | "
            f"{row['sessions_with_pool']} | {_percent(row['gain'])} | {row['encoder_share'] * 100:.1f} % | "
            f"{row['pool_gpus_per_100']:.2f} | {_percent(row['amortised_gain'])} |"
        )
    return "\n".join(lines)


def _percent(gain: float) -> str:
    return "n/a" if gain == float("inf") else f"{gain * 100:+.1f} %"
