"""``manage.py bench_coserve_live``: one-shot jobs beside N live streams on a real worker process,
each job's completion time against its compute time and the streams' chunk lateness with and without
jobs (docs/jobs.md "Jobs beside streams", issue 32); ``--simulate`` replays each run's mix in the
simulator, beside the live figures (``workers.benchmarks.coserve_sim``)."""

from __future__ import annotations

from django.conf import settings
from django.core.management.base import BaseCommand, CommandError

from contracts import bench
from contracts.cli import list_option
from workers.benchmarks.coserve import DEFAULT_MIX, format_coserve_bench, parse_job, run_coserve_bench


class Command(BaseCommand):
    help = "Jobs beside N live streams on a worker process: completion vs compute, chunk lateness p50/p99."

    def add_arguments(self, parser):
        parser.add_argument("--preset", default="tiny", help="the worker's model preset (default tiny)")
        parser.add_argument(
            "--streams",
            default="1,2,4",
            help="comma-separated stream counts (default 1,2,4); 0: the jobs alone, the overhead --simulate adds",
        )
        parser.add_argument(
            "--jobs",
            default=",".join(DEFAULT_MIX),
            help="comma-separated KIND:WxH[xFRAMES]:STEPS, run in turn",
        )
        parser.add_argument("--seconds", type=float, default=5.0, help="streams alone, measured (default 5)")
        parser.add_argument("--warmup", type=float, default=3.0, help="seconds before measuring (default 3)")
        parser.add_argument(
            "--starved-after-chunks",
            default="4",
            help="the worker's starvation guard: chunk periods without a completed job step before one step "
            "may take part of the streams' reserve (default 4; 'off': no guard)",
        )
        parser.add_argument(
            "--cold",
            action="store_true",
            help="no unmeasured warm-up job of each kind first: the worker meets each job shape unmeasured",
        )
        parser.add_argument(
            "--simulate",
            action="store_true",
            help="also replay each run's mix in the simulator (contracts.coserve, measured step and chunk "
            "times) and print simulated completion beside the live one; include 0 in --streams for the "
            "per-job overhead outside the device loop",
        )
        parser.add_argument(
            "--simulate-phases", type=int, default=8, help="submit phases per simulated job (default 8)"
        )
        bench.add_report_arguments(parser)

    def handle(self, *args, **options):
        counts = list(list_option(options, "streams", int, minimum=0))
        try:
            mix = [parse_job(s.strip()) for s in options["jobs"].split(",") if s.strip()]
        except ValueError as exc:
            raise CommandError(f"--jobs: {exc}") from exc
        starved = options["starved_after_chunks"]
        try:
            starved_after = None if starved == "off" else float(starved)
        except ValueError:
            raise CommandError(
                f"--starved-after-chunks: a number of chunk periods or 'off', got {starved!r}"
            ) from None
        if options["simulate_phases"] < 1:
            raise CommandError("--simulate-phases must be >= 1")
        report = run_coserve_bench(
            settings.REDIS_URL,
            preset=options["preset"],
            stream_counts=counts,
            mix=mix,
            seconds=options["seconds"],
            warmup_s=options["warmup"],
            starved_after_chunks=starved_after,
            warm_up_jobs=not options["cold"],
        )
        if options["simulate"]:
            # The lab's simulator, imported only when asked for (it loads numpy and the job solver).
            from workers.benchmarks.coserve_sim import add_simulation

            report = add_simulation(report, phases=options["simulate_phases"])
        bench.emit(
            report,
            json_mode=options["json"],
            out=options["out"],
            text=format_coserve_bench,
            write=self.stdout.write,
        )
