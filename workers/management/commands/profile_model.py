"""Measure a model preset on this machine and write the GPU profile the scheduler's simulator loads.

With ``--one-shot image|video`` it measures the model's one-shot mode instead: seconds per
denoising step for each (resolution, frames, batch), as ``{"model", "kind", "points": [{"width",
"height", "frames", "batch", "step_s"}], "machine"}`` (issue 14's job-cost profile)."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from django.core.management.base import BaseCommand, CommandError

from contracts.cli import list_option
from workers.benchmarks.jobs import parse_resolution, profile_one_shot
from workers.benchmarks.runtime import profile_model
from workers.runtime.models import UnknownPresetError


class Command(BaseCommand):
    help = "Per-chunk latency at batch 1..K and per-session state size → GPU profile JSON (docs/runtime.md)."

    def add_arguments(self, parser):
        parser.add_argument("--preset", default="tiny")
        parser.add_argument("--device", default="cpu", help="cpu, cuda, cuda:1, ...")
        parser.add_argument("--max-batch", type=int, default=8)
        parser.add_argument("--steps", type=int, default=6, help="timed steps per batch size")
        parser.add_argument("--out", required=True, help="where to write the profile JSON")
        parser.add_argument("--name", default=None)
        parser.add_argument("--gpu-type", default=None)
        parser.add_argument("--price-per-hour", type=float, default=0.0)
        parser.add_argument("--link-gbps", type=float, default=None)
        parser.add_argument("--slo-ms", type=float, default=None, help="capacity K = largest batch within it")
        parser.add_argument("--threads", type=int, default=1, help="torch CPU threads (default 1)")
        parser.add_argument(
            "--one-shot", choices=("image", "video"), default=None, help="profile job steps of this kind"
        )
        parser.add_argument("--resolutions", default="64x64", help="--one-shot: comma-separated WxH")
        parser.add_argument("--frames", default="8,16", help="--one-shot video: comma-separated frame counts")
        parser.add_argument("--batches", default="1,2,4", help="--one-shot: comma-separated batch sizes")

    def handle(self, *args, **options):
        if options["threads"]:
            torch.set_num_threads(options["threads"])
        if options["one_shot"]:
            self._one_shot(options)
            return
        try:
            profile, raw = profile_model(
                options["preset"],
                device=options["device"],
                max_batch=options["max_batch"],
                steps=options["steps"],
                name=options["name"],
                gpu_type=options["gpu_type"],
                price_per_hour=options["price_per_hour"],
                link_gbps=options["link_gbps"],
                slo_ms=options["slo_ms"],
            )
        except (UnknownPresetError, ValueError) as exc:
            raise CommandError(str(exc)) from exc
        Path(options["out"]).write_text(json.dumps(profile, indent=2) + "\n")
        self.stdout.write(json.dumps({"profile": profile, "measured": raw}, indent=2))
        self.stdout.write(self.style.SUCCESS(f"wrote {options['out']}"))

    def _one_shot(self, options: dict) -> None:
        resolutions = list(list_option(options, "resolutions", parse_resolution))
        frames = list(list_option(options, "frames", int, minimum=1))
        batches = list_option(options, "batches", int, minimum=1)
        if options["steps"] < 1:
            raise CommandError("--steps must be at least 1")
        try:
            profile = profile_one_shot(
                options["preset"],
                kind=options["one_shot"],
                resolutions=resolutions,
                frames=frames,
                batches=batches,
                repeats=options["steps"],
                device=options["device"],
            )
        except (UnknownPresetError, NotImplementedError, ValueError) as exc:
            raise CommandError(str(exc)) from exc
        Path(options["out"]).write_text(json.dumps(profile, indent=2) + "\n")
        self.stdout.write(json.dumps(profile, indent=2))
        self.stdout.write(self.style.SUCCESS(f"wrote {options['out']}"))
