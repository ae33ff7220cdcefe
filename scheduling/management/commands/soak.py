"""``manage.py soak``: many sessions streaming for a long time through the real platform."""

from __future__ import annotations

from django.core.management.base import BaseCommand, CommandError

from contracts import bench
from scheduling.benchmarks.platform import add_platform_arguments, platform_options
from scheduling.benchmarks.soak import format_soak, run_soak
from workers.benchmarks.live import BenchmarkFailed, ServiceUnavailable


class Command(BaseCommand):
    help = (
        "Benchmark (lab): soak the real platform: N sessions stream for M minutes with random idle periods; report process "
        "memory over time, chunks delivered, duplicates, skips and lost chunk records."
    )

    def add_arguments(self, parser):
        parser.add_argument("--sessions", type=int, default=100, help="concurrent sessions (default 100)")
        parser.add_argument("--minutes", type=float, default=30.0, help="how long they stream (default 30)")
        parser.add_argument("--max-workers", type=int, default=4, help="autoscaler's GPU bound (default 4)")
        parser.add_argument(
            "--active-fraction", type=float, default=0.3, help="share of time a user is active (default 0.3)"
        )
        parser.add_argument(
            "--mean-period", type=float, default=60.0, help="mean active+idle cycle in seconds (default 60)"
        )
        parser.add_argument("--sample", type=float, default=10.0, help="seconds between memory samples")
        parser.add_argument(
            "--leave-share",
            type=float,
            default=0.0,
            help="share of idle periods in which the viewer closes its socket instead of pausing (default 0)",
        )
        parser.add_argument(
            "--viewer-grace-s",
            type=float,
            default=None,
            help="the platform's SESSION_VIEWER_GRACE_S for the run (default: its setting)",
        )
        parser.add_argument(
            "--idle-timeout-s",
            type=float,
            default=None,
            help="the platform's SESSION_IDLE_TIMEOUT_S for the run (default: its setting)",
        )
        parser.add_argument(
            "--codec",
            choices=("jpeg", "h264"),
            default="jpeg",
            help="what every viewer reads: JPEG frames or H.264 fragments (docs/media.md; default jpeg)",
        )
        parser.add_argument(
            "--warmup-minutes",
            type=float,
            default=None,
            help="each process's memory samples in its first minutes are left out of its RSS slope (default a fifth of --minutes)",
        )
        parser.add_argument(
            "--trace-memory",
            default=None,
            metavar="DIR",
            help="run the web process under tracemalloc, a snapshot into DIR every minute"
            " (compare them with scripts/memory_trace_diff.py)",
        )
        parser.add_argument(
            "--trace-queues",
            default=None,
            metavar="DIR",
            help="the web process writes its RSS and the channel layer's in-process queues (channels,"
            " messages waiting) to DIR/queues.jsonl every 5 s",
        )
        bench.add_seed_argument(parser)
        add_platform_arguments(parser)
        bench.add_report_arguments(parser)

    def handle(self, *args, **options):
        checks = {
            "--sessions": options["sessions"] >= 1,
            "--minutes": options["minutes"] > 0,
            "--max-workers": options["max_workers"] >= 1,
            "--active-fraction": 0 < options["active_fraction"] < 1,
            "--mean-period": options["mean_period"] > 0,
            "--sample": options["sample"] > 0,
            "--warmup-minutes": options["warmup_minutes"] is None
            or 0 <= options["warmup_minutes"] < options["minutes"],
            "--leave-share": 0 <= options["leave_share"] <= 1,
            "--viewer-grace-s": options["viewer_grace_s"] is None or options["viewer_grace_s"] >= 0,
            "--idle-timeout-s": options["idle_timeout_s"] is None or options["idle_timeout_s"] >= 0,
            "--trace-queues (with --trace-memory: choose one)": not (
                options["trace_memory"] and options["trace_queues"]
            ),
        }
        for flag, ok in checks.items():
            if not ok:
                raise CommandError(f"{flag} is out of range (see --help)")
        try:
            report = run_soak(
                sessions=options["sessions"],
                minutes=options["minutes"],
                max_workers=options["max_workers"],
                active_fraction=options["active_fraction"],
                mean_period_s=options["mean_period"],
                sample_s=options["sample"],
                leave_share=options["leave_share"],
                viewer_grace_s=options["viewer_grace_s"],
                idle_timeout_s=options["idle_timeout_s"],
                codec=options["codec"],
                warmup_s=None if options["warmup_minutes"] is None else options["warmup_minutes"] * 60.0,
                trace_memory_dir=options["trace_memory"],
                trace_queues_dir=options["trace_queues"],
                seed=options["seed"],
                **platform_options(options),
                say=bench.quiet_unless_text(options["json"], self.stdout.write),
            )
        except (ServiceUnavailable, BenchmarkFailed) as exc:
            raise CommandError(str(exc)) from exc
        bench.emit(
            report, json_mode=options["json"], out=options["out"], text=format_soak, write=self.stdout.write
        )
