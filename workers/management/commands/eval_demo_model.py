"""Score the demo model's clips against their prompts on held-out combinations; a real-time check."""

from __future__ import annotations

import json

import torch
from django.core.management.base import BaseCommand, CommandError
from tqdm import tqdm

from workers.runtime.models import build_model
from workers.runtime.models.demo_eval import evaluate, realtime_check


class Command(BaseCommand):
    help = (
        "Generate clips for prompts of held-out (shape, colour, direction) combinations, measure what "
        "they show (colour, shape, background, direction, speed; no learned judge) and print accuracy; "
        "then time a chunk step on one core against the frame-rate budget (docs/models.md)."
    )

    def add_arguments(self, parser):
        parser.add_argument("--clips", type=int, default=128, help="clips to score (default 128)")
        parser.add_argument("--seed", type=int, default=0, help="seed of prompts and sessions (default 0)")
        parser.add_argument("--chunks", type=int, default=4, help="chunks per clip (default 4)")
        parser.add_argument("--weights", default=None, help="weights file (default: the shipped ones)")
        parser.add_argument("--split", choices=["held-out", "train"], default="held-out")
        parser.add_argument("--threads", type=int, default=1, help="torch CPU threads (default 1)")
        parser.add_argument("--no-realtime", action="store_true", help="skip the chunk-step timing")
        parser.add_argument("--json", action="store_true", help="print JSON only")

    def handle(self, *args, **options):
        for flag in ("clips", "chunks", "threads"):
            if options[flag] < 1:
                raise CommandError(f"--{flag} must be at least 1")
        if options["chunks"] < 2:
            raise CommandError("--chunks must be at least 2 (motion is measured across frames)")
        torch.set_num_threads(options["threads"])
        try:
            model = build_model("demo", weights_path=options["weights"])
        except (OSError, ValueError) as exc:
            raise CommandError(f"--weights: {exc}") from exc
        with tqdm(total=options["clips"], desc="eval demo", unit="clip", disable=options["json"]) as bar:
            report = evaluate(
                model,
                clips=options["clips"],
                seed=options["seed"],
                chunks=options["chunks"],
                held_out=options["split"] == "held-out",
                progress=bar.update,
            )
        if not options["no_realtime"]:
            report["realtime"] = {"threads": options["threads"], **realtime_check(model)}
        if options["json"]:
            self.stdout.write(json.dumps(report))
            return
        self.stdout.write(json.dumps({k: v for k, v in report.items() if k != "examples"}, indent=2))
