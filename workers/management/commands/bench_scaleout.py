"""``manage.py bench_scaleout``: new workers ready from disk, host cache, a peer chain, sequential unicast."""

from __future__ import annotations

from django.core.management.base import BaseCommand, CommandError

from contracts import bench
from contracts.cli import list_option
from workers.benchmarks.scaleout import SOURCES, format_scaleout, run_scaleout
from workers.runtime.models import UnknownPresetError


class Command(BaseCommand):
    help = "Time to ready of new worker processes by weights source (figures and JSON; docs/scaleout.md)."

    def add_arguments(self, parser):
        parser.add_argument("--preset", default="small")
        parser.add_argument("--targets", default="1,2,3", help="comma-separated target counts")
        parser.add_argument(
            "--link-mbps", type=float, default=None, help="pace every node's links to this rate (Mbit/s)"
        )
        parser.add_argument("--sources", default=",".join(SOURCES), help=f"subset of {','.join(SOURCES)}")
        parser.add_argument("--device", default="cpu")
        parser.add_argument(
            "--piece-kib", type=int, default=1024, help="piece size: the unit verified and forwarded (KiB)"
        )
        parser.add_argument(
            "--workdir", default=None, help="where the safetensors file goes (default: a temp dir)"
        )
        bench.add_repeats_argument(parser, default=3, help="measured rounds per cell (median reported)")
        bench.add_warmup_argument(parser, default=1, help="dropped rounds per cell")
        bench.add_report_arguments(parser)

    def handle(self, *args, **options):
        targets = list_option(options, "targets", int, minimum=1)
        sources = list_option(options, "sources", choices=SOURCES)
        write = bench.quiet_unless_text(options["json"], self.stdout.write)
        try:
            report = run_scaleout(
                options["preset"],
                targets=targets,
                link_mbps=options["link_mbps"],
                repeats=options["repeats"],
                warmup=options["warmup"],
                device=options["device"],
                sources=sources,
                piece_bytes=options["piece_kib"] * 1024,
                workdir=options["workdir"],
                progress=write,
            )
        except (UnknownPresetError, ValueError) as exc:
            raise CommandError(str(exc)) from exc
        bench.emit(
            report,
            json_mode=options["json"],
            out=options["out"],
            text=format_scaleout,
            write=self.stdout.write,
        )
