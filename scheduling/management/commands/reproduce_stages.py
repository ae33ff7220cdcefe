"""``manage.py reproduce_stages``: TridentServe against its baselines and ablations, the streams'
encoder-pool gain and the dispatcher's time, written to ``docs/results/stages.{md,json}``.

The ``wan-1.3b`` preset's numbers come from the worker runtime here, in the command layer:
``scheduling.core`` may not import ``workers`` (import-linter contract ``core-pure``).
"""

from __future__ import annotations

from django.core.management.base import BaseCommand, CommandError

from scheduling.reproduce.tridentserve import run_reproduce
from scheduling.sim.stages.cli import StagesCliError
from scheduling.sim.stages.encoder_pool import stream_model
from workers.runtime.stages.memory import stream_figures


class Command(BaseCommand):
    help = "Research tool (lab): reproduce TridentServe's comparisons in simulation; writes stages.md and stages.json."

    def add_arguments(self, parser):
        parser.add_argument("--out", default="docs/results", help="output directory")
        parser.add_argument("--gpus", type=int, default=128)
        parser.add_argument("--duration-s", type=float, default=1800.0)
        parser.add_argument("--load", type=float, default=0.8)
        parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
        parser.add_argument("--image-gpus", type=int, default=32, help="cluster of the image-pipeline runs")
        parser.add_argument("--image-duration-s", type=float, default=600.0)

    def handle(self, *args, **opts):
        # The preset's exact figures (read-only use of the runtime), as `manage.py stage_memory` takes them.
        stream = stream_model(**stream_figures("wan-1.3b", encoder="umt5-xxl"))
        try:
            report = run_reproduce(
                out_dir=opts["out"],
                stream=stream,
                gpus=opts["gpus"],
                duration_s=opts["duration_s"],
                load=opts["load"],
                seeds=opts["seeds"],
                image_gpus=opts["image_gpus"],
                image_duration_s=opts["image_duration_s"],
                progress=lambda r: self.stderr.write(
                    f"{r['workload']} seed {r['seed']} {r['policy']}: SLO {r['slo_attainment']:.1%}, "
                    f"mean {r['mean_latency_s']:.1f} s, OOM {r['oom_events']}"
                ),
            )
        except StagesCliError as exc:
            raise CommandError(str(exc)) from exc
        self.stdout.write(f"wrote {opts['out']}/stages.md and stages.json ({len(report['runs'])} runs)")
