"""``manage.py bench_decision_run``: the whole live decision run on synthetic rows at several sizes."""

from __future__ import annotations

from django.core.management.base import BaseCommand, CommandError

from contracts import bench
from scheduling.benchmarks.decision_run import format_bench, run_bench
from scheduling.sim.cli import CliError


class Command(BaseCommand):
    help = (
        "Benchmark (lab): the live decision run (rows → snapshot → policy → apply → commands) p50/p99 "
        "and queries per run, on synthetic workers and sessions inserted in a transaction rolled back after."
    )

    def add_arguments(self, parser):
        parser.add_argument("--gpus", default="1024,10000", help="comma list of cluster sizes")
        parser.add_argument("--runs", type=int, default=50, help="timed runs per size")
        parser.add_argument(
            "--tracing",
            choices=("off", "on"),
            default="off",
            help="OpenTelemetry traces on (docs/observability.md), as in a Celery process, exported to an"
            " OTLP receiver in this process: each run is a traced decision; off (default) as deployed",
        )
        bench.add_seed_argument(parser)
        bench.add_report_arguments(parser)

    def handle(self, *args, **opts):
        sink = _tracing_on() if opts["tracing"] == "on" else None
        try:
            report = run_bench(gpus=opts["gpus"], runs=opts["runs"], seed=opts["seed"])
        except CliError as exc:
            raise CommandError(str(exc)) from exc
        finally:
            if sink is not None:
                # Only when tracing is on: off, no OpenTelemetry module is imported (docs/observability.md).
                from contracts import tracing

                tracing.tracing_stop()  # exports what is buffered
                sink.stop()
        report["tracing"] = None if sink is None else {"spans_received": sink.names()}
        bench.emit(
            report, json_mode=opts["json"], out=opts["out"], text=format_bench, write=self.stdout.write
        )


def _tracing_on():
    """Tracing as a Celery worker process starts it, exporting to a receiver in this process."""
    from django.conf import settings

    # Only when tracing is on: off, no OpenTelemetry module is imported (docs/observability.md).
    from contracts.otlp_sink import OtlpSink
    from controlplane.tracing import tracing_configure

    sink = OtlpSink()
    settings.TRACING = {**settings.TRACING, "ENABLED": True, "ENDPOINT": sink.endpoint}
    tracing_configure("celery")
    return sink
