"""``manage.py simulate_regions``: one region policy on one topology in virtual time (docs/regions.md)."""

from __future__ import annotations

import json

from django.core.management.base import BaseCommand, CommandError

from scheduling.sim.regions.cli import RegionsCliError, format_result, run_simulate_regions
from scheduling.sim.regions.policies import POLICIES


class Command(BaseCommand):
    help = "Research tool (lab): simulate routing across GPU regions (TORTA and baselines); --json prints exactly one JSON object."

    def add_arguments(self, parser):
        parser.add_argument(
            "--topology", required=True, help="abilene | polska | gabriel | cost2 | a topology JSON file"
        )
        parser.add_argument("--trace", default=None, help="trace whose arrive events carry 'origin'")
        parser.add_argument("--policy", default="torta", help=" | ".join(POLICIES))
        parser.add_argument("--seed", type=int, default=0, help="seed of the generated demand")
        parser.add_argument(
            "--duration-s", type=float, default=None, help="generated demand length (default 6 h)"
        )
        parser.add_argument(
            "--mean-utilisation",
            type=float,
            default=None,
            help="generated mean load / all regions' capacity at their limits (default 0.45)",
        )
        parser.add_argument("--provisioning-delay-s", type=float, default=None, help="GPU request → ready")
        parser.add_argument("--slot-s", type=float, default=None, help="macro slot (default 45 s)")
        parser.add_argument(
            "--option",
            action="append",
            default=[],
            help="policy option key=value, repeatable (torta: sigma=0)",
        )
        parser.add_argument("--write-trace", default=None, help="write the generated demand here")
        parser.add_argument("--json", action="store_true", help="print one JSON object")

    def handle(self, *args, **opts):
        try:
            result = run_simulate_regions(
                topology=opts["topology"],
                policy=opts["policy"],
                trace=opts["trace"],
                seed=opts["seed"],
                options=opts["option"],
                duration_s=opts["duration_s"],
                mean_utilisation=opts["mean_utilisation"],
                provisioning_delay_s=opts["provisioning_delay_s"],
                slot_s=opts["slot_s"],
                write_trace=opts["write_trace"],
            )
        except RegionsCliError as exc:
            raise CommandError(str(exc)) from exc
        if opts["json"]:
            self.stdout.write(json.dumps(result, default=float))
        else:
            self.stdout.write(format_result(result))
