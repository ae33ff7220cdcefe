"""``manage.py simulate_stages``: one stage-level serving policy over a mixed trace (docs/stages.md)."""

from __future__ import annotations

import json

from django.core.management.base import BaseCommand, CommandError

from scheduling.sim.stages.cli import WORKLOADS, StagesCliError, format_result, run_simulate_stages
from scheduling.sim.stages.simulator import ABLATIONS, POLICIES


class Command(BaseCommand):
    help = "Research tool (lab): simulate TridentServe stage-level serving or a baseline; --json prints exactly one JSON object."

    def add_arguments(self, parser):
        parser.add_argument(
            "--trace", default=None, help="mixed trace (job lines + session lines), JSON Lines"
        )
        parser.add_argument(
            "--workload", default=None, help=" | ".join(WORKLOADS) + " (generated instead of --trace)"
        )
        parser.add_argument("--policy", default="tridentserve", help=" | ".join(POLICIES))
        parser.add_argument("--ablation", default=None, help=" | ".join(ABLATIONS) + " (tridentserve only)")
        parser.add_argument("--gpus", type=int, default=128)
        parser.add_argument("--gpu", default="l20", help="l20 | h100 | h200")
        parser.add_argument(
            "--model", default="wan-t2v", help="pipeline of a generated workload: wan-t2v | sd3-image"
        )
        parser.add_argument("--duration-s", type=float, default=1800.0, help="generated workload length")
        parser.add_argument(
            "--load", type=float, default=0.8, help="generated offered work / cluster capacity"
        )
        parser.add_argument("--seed", type=int, default=0)
        parser.add_argument("--tick-s", type=float, default=0.5, help="dispatch tick")
        parser.add_argument("--window-s", type=float, default=60.0, help="re-placement monitor window")
        parser.add_argument(
            "--threshold", type=float, default=1.5, help="fastest/slowest stage throughput ratio"
        )
        parser.add_argument("--write-trace", default=None, help="write the generated workload here")
        parser.add_argument("--json", action="store_true", help="print one JSON object")

    def handle(self, *args, **opts):
        try:
            result = run_simulate_stages(
                policy=opts["policy"],
                trace=opts["trace"],
                workload=opts["workload"],
                model=opts["model"],
                gpus=opts["gpus"],
                gpu=opts["gpu"],
                ablation=opts["ablation"],
                duration_s=opts["duration_s"],
                load=opts["load"],
                seed=opts["seed"],
                tick_s=opts["tick_s"],
                window_s=opts["window_s"],
                threshold=opts["threshold"],
                write_trace=opts["write_trace"],
            )
        except StagesCliError as exc:
            raise CommandError(str(exc)) from exc
        if opts["json"]:
            self.stdout.write(json.dumps(result, default=float))
        else:
            self.stdout.write(format_result(result))
