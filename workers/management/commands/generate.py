"""Generate a clip from the command line: MP4 or PNG frames, with the platform's session semantics."""

from __future__ import annotations

import json

import torch
from django.core.management.base import BaseCommand, CommandError
from tqdm import tqdm

from contracts.catalog.presets import DEFAULT_PRESET
from workers.runtime.generate import (
    GenerateError,
    check_output,
    generate_frames,
    prompt_schedule,
    write_output,
)
from workers.runtime.models import MODEL_REGISTRY, build_model


class Command(BaseCommand):
    help = (
        'Generate one session\'s clip: --prompt "…" [--prompt-at CHUNK:"…"]… --chunks N --out clip.mp4|DIR '
        "(docs/models.md)."
    )

    def add_arguments(self, parser):
        parser.add_argument(
            "--preset", default=DEFAULT_PRESET, help=f"model preset (default {DEFAULT_PRESET})"
        )
        parser.add_argument("--prompt", required=True, help="the prompt the clip starts with")
        parser.add_argument(
            "--prompt-at",
            action="append",
            default=[],
            metavar='CHUNK:"PROMPT"',
            help="switch to PROMPT from chunk CHUNK on (repeatable)",
        )
        parser.add_argument("--seed", type=int, default=0, help="session seed (default 0)")
        parser.add_argument("--chunks", type=int, required=True, help="number of chunks to generate")
        parser.add_argument("--out", required=True, help="clip.mp4 (H.264) or a directory for PNG frames")
        parser.add_argument("--device", default="cpu", help="cpu, cuda, cuda:1, ...")
        parser.add_argument("--threads", type=int, default=1, help="torch CPU threads (default 1)")
        parser.add_argument("--json", action="store_true", help="print a JSON summary, no progress bar")

    def handle(self, *args, **options):
        preset = options["preset"]
        if preset not in MODEL_REGISTRY:
            raise CommandError(
                f"--preset: unknown model preset {preset!r}; available: {', '.join(sorted(MODEL_REGISTRY))}"
            )
        if options["threads"] < 1:
            raise CommandError("--threads must be at least 1")
        try:
            changes = prompt_schedule(options["prompt"], options["prompt_at"], options["chunks"])
            out = check_output(options["out"])
        except GenerateError as exc:
            raise CommandError(str(exc)) from exc
        torch.set_num_threads(options["threads"])
        try:
            model = build_model(preset, device=options["device"])
        except (OSError, ValueError, RuntimeError) as exc:
            raise CommandError(f"--preset {preset}: cannot build the model: {exc}") from exc
        with tqdm(
            total=options["chunks"], desc=f"generate {preset}", unit="chunk", disable=options["json"]
        ) as bar:
            frames = generate_frames(
                model,
                options["prompt"],
                seed=options["seed"],
                chunks=options["chunks"],
                changes=changes,
                progress=bar.update,
            )
        try:
            written = write_output(frames, out, model.fps)
        except OSError as exc:
            raise CommandError(f"--out: cannot write {out}: {exc}") from exc
        if options["json"]:
            summary = {
                "preset": preset,
                "out": str(out),
                "frames": int(frames.shape[0]),
                "width": int(frames.shape[2]),
                "height": int(frames.shape[1]),
                "fps": model.fps,
                "prompts": {"0": options["prompt"], **{str(k): v for k, v in sorted(changes.items())}},
            }
            self.stdout.write(json.dumps(summary))
        else:
            self.stdout.write(self.style.SUCCESS(f"wrote {written}"))
