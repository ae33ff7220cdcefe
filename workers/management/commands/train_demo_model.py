"""Train the demo model on procedurally generated clips and write its weights (safetensors)."""

from __future__ import annotations

import json

from django.core.management.base import BaseCommand, CommandError
from tqdm import tqdm

from workers.runtime.models.demo_train import train


class Command(BaseCommand):
    help = (
        "Train the `demo` preset on this CPU in minutes (docs/models.md, 'The demo model'); writes "
        "safetensors to --out (default: the weights shipped in the repository)."
    )

    def add_arguments(self, parser):
        parser.add_argument("--seed", type=int, default=0, help="data and initial-weight seed (default 0)")
        parser.add_argument("--steps", type=int, default=3000, help="optimiser steps (default 3000)")
        parser.add_argument(
            "--minutes", type=float, default=None, help="stop after this much wall time if sooner"
        )
        parser.add_argument("--batch", type=int, default=64, help="clips per step (default 64)")
        parser.add_argument("--threads", type=int, default=1, help="torch CPU threads (default 1)")
        parser.add_argument("--out", default=None, help="weights file (default: the shipped demo weights)")
        parser.add_argument("--json", action="store_true", help="print the report as JSON only")

    def handle(self, *args, **options):
        for flag in ("steps", "batch", "threads"):
            if options[flag] < 1:
                raise CommandError(f"--{flag} must be at least 1")
        if options["minutes"] is not None and options["minutes"] <= 0:
            raise CommandError("--minutes must be positive")
        bar = tqdm(total=options["steps"], desc="train demo", unit="step", disable=options["json"])

        def progress(done: int, total: int, loss: float) -> None:
            bar.update(1)
            if done % 50 == 0:
                bar.set_postfix(loss=f"{loss:.4f}")

        try:
            report = train(
                seed=options["seed"],
                steps=options["steps"],
                minutes=options["minutes"],
                batch=options["batch"],
                threads=options["threads"],
                out=options["out"],
                progress=progress,
            )
        except OSError as exc:
            raise CommandError(f"--out: cannot write the weights: {exc}") from exc
        finally:
            bar.close()
        self.stdout.write(json.dumps(report.as_dict(), indent=2))
