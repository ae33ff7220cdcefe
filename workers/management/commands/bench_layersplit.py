"""``manage.py bench_layersplit``: does cooperative layer-split execution help while a worker loads?"""

from __future__ import annotations

from django.core.management.base import BaseCommand, CommandError

from contracts import bench
from contracts.cli import list_option
from workers.benchmarks.layersplit import format_layersplit, run_layersplit


class Command(BaseCommand):
    help = (
        "Chunk latency of sessions split between a loading worker (first L blocks) and an overloaded "
        "old worker, vs the whole step and vs waiting for the load (figures and JSON; docs/scaleout.md)."
    )

    def add_arguments(self, parser):
        parser.add_argument("--preset", default="small")
        parser.add_argument("--k", type=int, default=2, help="sessions the old worker keeps (default 2)")
        parser.add_argument("--m", type=int, default=2, help="sessions moved to the new worker (default 2)")
        parser.add_argument(
            "--splits",
            default=None,
            help="comma-separated L values (blocks on the new worker); default 1,N/2,N-1",
        )
        parser.add_argument(
            "--link-mbps", type=float, default=1000.0, help="paced weight link of the load timeline (Mbit/s)"
        )
        parser.add_argument("--threads", type=int, default=1, help="torch threads per process (default 1)")
        parser.add_argument(
            "--warm-chunks",
            type=int,
            default=2,
            help="chunks generated first to fill the KV ring (default 2)",
        )
        bench.add_repeats_argument(parser, default=3, help="measured chunks per cell (median reported)")
        bench.add_warmup_argument(parser, default=1, help="dropped chunks per cell")
        bench.add_report_arguments(parser)

    def handle(self, *args, **options):
        splits = list_option(options, "splits", int)
        splits = list(splits) if splits is not None else None
        write = bench.quiet_unless_text(options["json"], self.stdout.write)
        try:
            report = run_layersplit(
                options["preset"],
                k=options["k"],
                m=options["m"],
                splits=splits,
                link_mbps=options["link_mbps"],
                repeats=options["repeats"],
                warmup=options["warmup"],
                warm_chunks=options["warm_chunks"],
                threads=options["threads"],
                progress=write,
            )
        except ValueError as exc:
            raise CommandError(str(exc)) from exc
        bench.emit(
            report,
            json_mode=options["json"],
            out=options["out"],
            text=format_layersplit,
            write=self.stdout.write,
        )
