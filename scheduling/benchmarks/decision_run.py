"""Live decision-run benchmark: ``manage.py bench_decision_run``.

For each cluster size M: M ready workers of the default GPU type in the first served model's pool,
≈ 1.4·K·M sessions of which ≈ 0.7·K·M execute on them (least-loaded first) and the rest are idle
and suspended — synthetic PostgreSQL rows, bulk-inserted inside one transaction that is rolled back
at the end, so nothing is left behind. Then ``runs`` times: one suspended session turns active and
the whole live run (``scheduling.live.run.scheduler_run``: the pool's rows locked and read, the
snapshot, the policy, the apply, the decision record, the commands' rows) is timed and its database
queries counted (``CaptureQueriesContext``). The commands' Redis sends run on commit, which never
comes here: they are not in the figure.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import Any

import numpy as np
from django.conf import settings
from django.contrib.auth import get_user_model
from django.db import connection, transaction
from django.test.utils import CaptureQueriesContext
from django.utils import timezone

from gpu.models import GpuWorker
from scheduling.benchmarks.scheduler import parse_gpu_sizes
from scheduling.live.run import scheduler_run
from scheduling.live.worker_profiles import default_gpu_type, gpu_profiles
from scheduling.sim.cli import CliError
from sessions.models import GenerationSession

Status = GenerationSession.Status
Activity = GenerationSession.Activity


def _rows(m: int, preset: str, tag: str) -> list[GenerationSession]:
    """M ready workers and their sessions; returns the suspended (idle) sessions."""
    gpu_type = default_gpu_type()
    k = gpu_profiles()[gpu_type].capacity
    now = timezone.now()
    owner = get_user_model().objects.create(username=f"bench-{tag}")
    workers = GpuWorker.objects.bulk_create(
        GpuWorker(
            name=f"bench-{tag}-{i:05d}",
            gpu_type=gpu_type,
            capacity=max(1, int(k)),
            model_preset=preset,
            status=GpuWorker.Status.READY,
            requested_at=now - timedelta(minutes=10),
            ready_at=now - timedelta(minutes=9),
            last_heartbeat=now,
        )
        for i in range(m)
    )
    n_sessions = max(2, int(1.4 * k * m))
    n_active = int(0.7 * k * m)
    sessions = []
    for i in range(n_sessions):
        active = i < n_active
        sessions.append(
            GenerationSession(
                owner=owner,
                model_name=preset,
                width=64,
                height=64,
                fps=8,
                frames_per_chunk=4,
                seed=i,
                status=Status.EXECUTING if active else Status.SUSPENDED,
                activity=Activity.ACTIVE if active else Activity.IDLE,
                worker=workers[i % m] if active else None,
                last_active_at=now - timedelta(seconds=60),
            )
        )
    GenerationSession.objects.bulk_create(sessions, batch_size=5000)
    return sessions[n_active:]


def bench_decision_run(
    sizes: Sequence[int], *, runs: int = 50, seed: int = 0, progress: Callable[[int], None] | None = None
) -> dict[str, Any]:
    preset = settings.STREAMSERVE["SERVED_MODELS"][0]
    rng = np.random.default_rng(seed)
    rows = []
    for m in sizes:
        tag = uuid.uuid4().hex[:8]
        with transaction.atomic():
            idle = _rows(m, preset, tag)
            scheduler_run(trigger="tick")  # the policy's state row exists from here on
            times: list[float] = []
            queries: list[int] = []
            for _ in range(runs):
                session = idle.pop(int(rng.integers(len(idle))))
                GenerationSession.objects.filter(pk=session.pk).update(
                    activity=Activity.ACTIVE, last_active_at=timezone.now()
                )
                with CaptureQueriesContext(connection) as captured:
                    t0 = time.perf_counter()
                    scheduler_run(trigger="active", session_id=str(session.pk))
                    times.append((time.perf_counter() - t0) * 1000.0)
                queries.append(len(captured.captured_queries))
            sessions = GenerationSession.objects.filter(owner__username=f"bench-{tag}").count()
            transaction.set_rollback(True)
        arr = np.asarray(times)
        rows.append(
            {
                "gpus": m,
                "sessions": sessions,
                "runs": runs,
                "p50_ms": round(float(np.percentile(arr, 50)), 2),
                "p99_ms": round(float(np.percentile(arr, 99)), 2),
                "max_ms": round(float(arr.max()), 2),
                "queries_min": int(min(queries)),
                "queries_max": int(max(queries)),
            }
        )
        if progress:
            progress(1)
    return {"preset": preset, "gpu_type": default_gpu_type(), "sizes": rows}


def run_bench(*, gpus: str = "1024,10000", runs: int = 50, seed: int = 0) -> dict[str, Any]:
    """The command's flags, checked (a bad one raises :class:`CliError` naming it), then the bench."""
    sizes = parse_gpu_sizes(gpus)
    if runs < 1:
        raise CliError("runs", "must be >= 1")
    return bench_decision_run(sizes, runs=runs, seed=seed)


def format_bench(report: dict[str, Any]) -> str:
    lines = [f"live decision run, pool {report['preset']} ({report['gpu_type']}), rows rolled back after"]
    lines.append(
        f"  {'GPUs':>6} {'sessions':>9} {'runs':>5} {'p50 ms':>9} {'p99 ms':>9} {'max ms':>9} {'queries':>9}"
    )
    for r in report["sizes"]:
        q = f"{r['queries_min']}-{r['queries_max']}"
        lines.append(
            f"  {r['gpus']:>6} {r['sessions']:>9} {r['runs']:>5} {r['p50_ms']:>9.2f} {r['p99_ms']:>9.2f}"
            f" {r['max_ms']:>9.2f} {q:>9}"
        )
    if report.get("tracing") is not None:
        lines.append(f"  tracing on: spans {report['tracing']['spans_received']}")
    return "\n".join(lines)
