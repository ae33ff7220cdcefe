"""``manage.py bench_job_abandon``: from a stream command's arrival to the device being free, with a
job step in flight run to its end or abandoned at a block boundary (docs/jobs.md)."""

from __future__ import annotations

import redis
import torch
from django.conf import settings
from django.core.management.base import BaseCommand, CommandError

from contracts import bench
from workers.benchmarks.job_abandon import format_abandon_bench, run_abandon_bench
from workers.benchmarks.jobs import parse_resolution
from workers.runtime.models import UnknownPresetError


class Command(BaseCommand):
    help = "Stream command → device free while a job step runs: step run to its end vs abandoned (p50/p99)."

    def add_arguments(self, parser):
        parser.add_argument(
            "--jobs",
            default="tiny:video:128x128x16,demo:video:128x128x16",
            help="comma-separated PRESET:KIND:WxH[xFRAMES] jobs whose step is in flight",
        )
        parser.add_argument("--repeats", type=int, default=40, help="measured repeats per mode")
        parser.add_argument("--threads", type=int, default=1, help="torch CPU threads (default 1)")
        bench.add_seed_argument(parser)
        bench.add_report_arguments(parser)

    def handle(self, *args, **options):
        torch.set_num_threads(options["threads"])
        if options["repeats"] < 1:
            raise CommandError("--repeats must be at least 1")
        jobs = []
        for spec in (s.strip() for s in options["jobs"].split(",") if s.strip()):
            try:
                preset, kind, size = spec.split(":")
                parts = size.lower().split("x")
                frames = int(parts[2]) if len(parts) == 3 else 1
                width, height = parse_resolution("x".join(parts[:2]))
            except ValueError as exc:
                raise CommandError(f"--jobs: {spec!r} is not PRESET:KIND:WxH[xFRAMES] ({exc})") from exc
            jobs.append((preset, (kind, width, height, frames)))
        if not jobs:
            raise CommandError("--jobs: nothing to measure")
        client = redis.Redis.from_url(settings.REDIS_URL)
        try:
            report = run_abandon_bench(jobs, client=client, repeats=options["repeats"], seed=options["seed"])
        except (UnknownPresetError, NotImplementedError, ValueError) as exc:
            raise CommandError(f"--jobs: {exc}") from exc
        finally:
            client.close()
        bench.emit(
            report,
            json_mode=options["json"],
            out=options["out"],
            text=format_abandon_bench,
            write=self.stdout.write,
        )
