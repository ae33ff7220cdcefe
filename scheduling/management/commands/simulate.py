"""``manage.py simulate``: replay a trace through one policy in virtual time (docs/scheduling.md)."""

from __future__ import annotations

import json

from django.core.management.base import BaseCommand, CommandError

from scheduling.sim.cli import (
    CliError,
    add_boot_arguments,
    add_forecast_arguments,
    forecast_options,
    format_simulate,
    run_simulate,
)


class Command(BaseCommand):
    help = "Research tool (lab): simulate a scheduling policy on a session trace; --json prints exactly one JSON object."

    def add_arguments(self, parser):
        parser.add_argument("--trace", required=True, help="JSON Lines trace (docs/traces.md)")
        parser.add_argument(
            "--policy", default="turboserve", help="built-in name or package.module:ClassName"
        )
        parser.add_argument(
            "--profile", default="h20-1.3b", help="built-in profile, JSON file, or a comma list"
        )
        parser.add_argument(
            "--max-gpus", type=int, default=16, help="M_max; also the fixed budget of static policies"
        )
        parser.add_argument("--min-gpus", type=int, default=1, help="M_min: warm minimum pool")
        parser.add_argument(
            "--initial-gpus", type=int, default=None, help="pool at t=0 (default min(8, max))"
        )
        parser.add_argument("--budget", type=int, default=None, help="fixed budget for static policies")
        parser.add_argument(
            "--slo-ms", type=float, default=None, help="per-chunk latency SLO (default: profile's)"
        )
        parser.add_argument("--tick-s", type=float, default=5.0, help="periodic tick interval")
        add_boot_arguments(parser)
        add_forecast_arguments(parser)
        parser.add_argument("--json", action="store_true", help="print one JSON object")
        parser.add_argument("--plot", default=None, help="write a timeline PNG here")
        parser.add_argument("--progress", action="store_true", help="show a progress bar")
        parser.add_argument(
            "--job-policy",
            default="genserve",
            help="policy for one-shot jobs in the trace: genserve, fcfs, edf, fcfs-preempt or an ablation "
            "(genserve-no-preempt, genserve-no-dp, genserve-no-sp)",
        )
        parser.add_argument(
            "--job-profile",
            action="append",
            default=[],
            help="job cost profile JSON (profile_model one-shot output), repeatable; default: built-ins",
        )
        parser.add_argument("--job-round-steps", type=int, default=5, help="Δ: a round every Δ video steps")
        parser.add_argument(
            "--stream-period-ms",
            default=None,
            help="pace each GPU's steps at one chunk period (ms, or 'slo' for the SLO) so one-shot jobs step "
            "beside the streams in the slack they leave (contracts.coserve); default: steps back to back",
        )
        parser.add_argument(
            "--viewer-grace-s",
            type=float,
            default=None,
            help="the platform's viewer rule: a session whose trace marks its viewer gone (viewer_leave) "
            "goes idle after this many seconds (default: off; docs/traces.md)",
        )
        parser.add_argument(
            "--idle-timeout-s",
            type=float,
            default=None,
            help="with the viewer rule: an idle session with its viewer gone departs after this many seconds",
        )
        parser.add_argument(
            "--tenant-weight",
            action="append",
            default=[],
            help="fair share: a tenant's weight, name=weight, repeatable (docs/tenants.md)",
        )
        parser.add_argument(
            "--option",
            action="append",
            default=[],
            help="policy option key=value (JSON value), repeatable: --option headroom=false --option cooldown_s=0",
        )

    def handle(self, *args, **opts):
        try:
            forecast = forecast_options(
                opts["forecast"], opts["forecast_slot_s"], opts["forecast_sigma"], opts["forecast_season_s"]
            )
            result = run_simulate(
                trace=opts["trace"],
                policy=opts["policy"],
                profile=opts["profile"],
                max_gpus=opts["max_gpus"],
                min_gpus=opts["min_gpus"],
                initial_gpus=opts["initial_gpus"],
                budget=opts["budget"],
                slo_ms=opts["slo_ms"],
                tick_s=opts["tick_s"],
                plot=opts["plot"],
                progress=opts["progress"],
                options=opts["option"],
                provisioning_delay_s=opts["provisioning_delay_s"],
                scale_out=opts["scale_out"],
                forecast=forecast,
                job_policy=opts["job_policy"],
                job_profiles=opts["job_profile"],
                job_round_steps=opts["job_round_steps"],
                viewer_grace_s=opts["viewer_grace_s"],
                idle_timeout_s=opts["idle_timeout_s"],
                stream_period=opts["stream_period_ms"],
                tenant_weights=opts["tenant_weight"],
            )
        except CliError as exc:
            raise CommandError(str(exc)) from exc
        if opts["json"]:
            self.stdout.write(json.dumps(result))
        else:
            self.stdout.write(format_simulate(result))
