"""``manage.py simulate_compare``: TurboServe §7.1 protocol on one trace (docs/scheduling.md)."""

from __future__ import annotations

import json

from django.core.management.base import BaseCommand, CommandError

from contracts.cli import list_option
from scheduling.sim.cli import (
    CliError,
    add_boot_arguments,
    add_forecast_arguments,
    forecast_options,
    format_compare,
    run_compare,
)
from scheduling.sim.compare import DEFAULT_POLICIES


class Command(BaseCommand):
    help = "Research tool (lab): cost at matched latency and worst latency at matched cost for every policy on one trace."

    def add_arguments(self, parser):
        parser.add_argument("--trace", required=True)
        parser.add_argument("--profile", default="h20-1.3b")
        parser.add_argument("--max-gpus", type=int, default=16)
        parser.add_argument("--min-gpus", type=int, default=1)
        parser.add_argument("--initial-gpus", type=int, default=None)
        parser.add_argument("--slo-ms", type=float, default=None)
        parser.add_argument(
            "--policies", default=",".join(DEFAULT_POLICIES), help="comma list; turboserve is the reference"
        )
        parser.add_argument(
            "--capacity",
            choices=("slo", "profile"),
            default="slo",
            help="K per GPU: derived from the SLO (default; the load whose chunk plus one stall meets it) "
            "or the profile's own",
        )
        add_boot_arguments(parser)
        add_forecast_arguments(parser)
        parser.add_argument("--json", action="store_true")
        parser.add_argument("--plot", default=None, help="write a comparison PNG here")
        parser.add_argument("--no-progress", action="store_true")

    def handle(self, *args, **opts):
        policies = list(list_option(opts, "policies"))
        try:
            forecast = forecast_options(
                opts["forecast"], opts["forecast_slot_s"], opts["forecast_sigma"], opts["forecast_season_s"]
            )
            out = run_compare(
                trace=opts["trace"],
                profile=opts["profile"],
                max_gpus=opts["max_gpus"],
                min_gpus=opts["min_gpus"],
                initial_gpus=opts["initial_gpus"],
                slo_ms=opts["slo_ms"],
                policies=policies,
                plot=opts["plot"],
                capacity=opts["capacity"],
                provisioning_delay_s=opts["provisioning_delay_s"],
                scale_out=opts["scale_out"],
                forecast=forecast,
                progress=not opts["no_progress"] and not opts["json"],
            )
        except CliError as exc:
            raise CommandError(str(exc)) from exc
        self.stdout.write(json.dumps(out) if opts["json"] else format_compare(out))
