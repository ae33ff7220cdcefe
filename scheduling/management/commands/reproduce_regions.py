"""``manage.py reproduce_regions``: the regions results section (docs/results/regions.md + regions.json)."""

from __future__ import annotations

import datetime
import json
import time
from pathlib import Path

from django.core.management.base import BaseCommand, CommandError

from contracts.cli import list_option
from scheduling.benchmarks.regions import run_bench_solve
from scheduling.reproduce.torta import ABLATIONS, REPORT_POLICIES, VARIANTS, run_regions_report, write_report
from scheduling.sim.regions.cli import RegionsCliError
from scheduling.sim.regions.topology import BUILTIN_SHAPES


class Command(BaseCommand):
    help = "Research tool (lab): reproduce TORTA over every built-in topology × region policy (+ TORTA ablations, + the macro-solve benchmark)."

    def add_arguments(self, parser):
        parser.add_argument("--out", default="docs/results")
        parser.add_argument("--seed", type=int, default=0)
        parser.add_argument("--duration-s", type=float, default=6 * 3600.0)
        parser.add_argument("--topologies", default=",".join(BUILTIN_SHAPES))
        parser.add_argument("--policies", default=",".join(REPORT_POLICIES))
        parser.add_argument("--ablation-topology", default="abilene")
        parser.add_argument("--no-ablations", action="store_true")
        parser.add_argument("--progress", action="store_true")
        parser.add_argument(
            "--render-only",
            action="store_true",
            help="re-render regions.md from OUT/regions.json, run nothing",
        )

    def handle(self, *args, **opts):
        if opts["render_only"]:
            source = Path(opts["out"]) / "regions.json"
            if not source.exists():
                raise CommandError(f"--render-only: no {source}")
            report = json.loads(source.read_text(encoding="utf-8"))
            json_path, md_path = write_report(report, opts["out"], bench=report.get("bench"))
            self.stdout.write(f"wrote {md_path} and {json_path}")
            return
        started = time.perf_counter()
        topologies = list(list_option(opts, "topologies"))
        policies = list(list_option(opts, "policies"))
        try:
            report = run_regions_report(
                topologies=topologies,
                policies=policies,
                seed=opts["seed"],
                duration_s=opts["duration_s"],
                ablations=() if opts["no_ablations"] else ABLATIONS,
                ablation_topology=opts["ablation_topology"],
                variants=VARIANTS,
                progress=opts["progress"],
            )
            bench = run_bench_solve(regions=32, method="emd", repeats=500, seed=opts["seed"])
        except RegionsCliError as exc:
            raise CommandError(str(exc)) from exc
        now = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC")
        report["generated_at"] = f"{now}, {time.perf_counter() - started:.0f} s wall"
        json_path, md_path = write_report(report, opts["out"], bench=bench)
        self.stdout.write(f"wrote {md_path} and {json_path}")
