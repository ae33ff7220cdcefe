"""``manage.py profile_volatility``: regenerate the volatility → (λ, ρ̂) table (Appendix A)."""

from __future__ import annotations

import json

from django.core.management.base import BaseCommand, CommandError

from scheduling.core.detector import DEFAULT_TABLE_PATH
from scheduling.sim.cli import CliError, run_profile_volatility


class Command(BaseCommand):
    help = "Research tool (lab): grid-search (λ, ρ̂) per volatility level by replaying trace segments; write the table JSON."

    def add_arguments(self, parser):
        parser.add_argument("--out", default=str(DEFAULT_TABLE_PATH), help="where to write the table")
        parser.add_argument("--profile", default="paper-k5")
        parser.add_argument("--max-gpus", type=int, default=16)
        parser.add_argument("--slo-ms", type=float, default=None)
        parser.add_argument("--seed", type=int, default=0)
        parser.add_argument("--levels", type=int, default=10, help="Table 5 segments 1..N (without --trace)")
        parser.add_argument(
            "--trace", action="append", default=[], help="cut segments from these traces instead"
        )
        parser.add_argument("--segment-s", type=float, default=60.0)
        parser.add_argument("--json", action="store_true")

    def handle(self, *args, **opts):
        try:
            data = run_profile_volatility(
                out=opts["out"],
                profile=opts["profile"],
                max_gpus=opts["max_gpus"],
                slo_ms=opts["slo_ms"],
                seed=opts["seed"],
                levels=opts["levels"],
                traces=opts["trace"],
                segment_s=opts["segment_s"],
                progress=not opts["json"],
            )
        except CliError as exc:
            raise CommandError(str(exc)) from exc
        if opts["json"]:
            self.stdout.write(json.dumps(data))
            return
        for row in data["profiled_segments"]:
            self.stdout.write(
                f"level {row['level']:>2}  σ={row['volatility']:<8} ρ̂={row['rho_hat_monotone']:<5} "
                f"λ={row['lambda']:<4} valid={row['valid']} worst={row['worst_ms']} ms cost=${row['cost_usd']}"
            )
        self.stdout.write(f"wrote {opts['out']}")
