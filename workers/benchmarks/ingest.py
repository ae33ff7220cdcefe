"""Chunk-record ingest rate into PostgreSQL through the workers' own path (docs/benchmarks-live.md).

Calls ``sessions.ingest.chunk_records_ingest`` with batches of ``batch`` rows spread over
``sessions`` sessions, as the ingester writes what it drained from the record stream, until
``records`` rows are in.
Everything it writes (a user, a released worker row, the sessions and their chunk records, all
named ``bench-ingest-<run>``) is deleted afterwards.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable
from typing import Any

import psutil
from django.contrib.auth import get_user_model
from django.db import connection

from contracts.bench import machine_load, summarize
from contracts.wire.records import ChunkRow
from gpu.models import GpuWorker
from sessions.ingest import chunk_records_ingest
from sessions.models import ChunkRecord, GenerationSession
from workers.benchmarks.live import bench_sessions, use_bench_database

TARGET_RECORDS_PER_S = 5000.0
WINDOWS = 10


def ingest_rows(
    *, session_ids: list[str], worker: str, records: int, batch: int, start: float
) -> list[list[ChunkRow]]:
    """Batches of rows in the order a worker produces them: round-robin over its sessions, each
    session's chunk indices increasing, ``generated_at`` advancing like wall time."""
    batches: list[list[ChunkRow]] = []
    current: list[ChunkRow] = []
    for n in range(records):
        session = session_ids[n % len(session_ids)]
        current.append(
            ChunkRow(
                session=session,
                index=n // len(session_ids),
                worker=worker,
                batch_size=min(len(session_ids), 4),
                generation_ms=80.0 + (n % 37),
                generated_at=start + n * 1e-4,
                delivery_ms=None,
            )
        )
        if len(current) == batch:
            batches.append(current)
            current = []
    if current:
        batches.append(current)
    return batches


def run_ingest(
    *, records: int, batch: int, sessions: int, database: str | None, say: Callable[[str], Any]
) -> dict[str, Any]:
    """The whole benchmark; raises ``ServiceUnavailable`` when PostgreSQL does not answer."""
    db = use_bench_database(database)
    say(f"database {db['NAME']}: {records} records, batches of {batch}, {sessions} sessions")

    run = uuid.uuid4().hex[:8]
    load_before = machine_load()
    try:
        worker, session_ids = _create_rows(run, sessions)
        batches = ingest_rows(
            session_ids=session_ids, worker=worker.name, records=records, batch=batch, start=time.time()
        )
        batch_ms: list[float] = []
        inserted = 0
        backend = _backend_process()
        backend_cpu = sum(backend.cpu_times()[:2]) if backend else None
        own_cpu = time.process_time()
        began = time.perf_counter()
        for rows in batches:
            t = time.perf_counter()
            inserted += chunk_records_ingest(rows=rows)
            batch_ms.append((time.perf_counter() - t) * 1000.0)
        elapsed = time.perf_counter() - began
        own_cpu = time.process_time() - own_cpu
        if backend is not None:
            backend_cpu = sum(backend.cpu_times()[:2]) - backend_cpu
        stored = ChunkRecord.objects.filter(session_id__in=session_ids).count()
    finally:
        _delete_rows(run)

    per_window = max(len(batch_ms) // WINDOWS, 1)
    window_rates = [
        round(
            sum(len(b) for b in batches[i : i + per_window]) / (sum(batch_ms[i : i + per_window]) / 1000.0),
            1,
        )
        for i in range(0, len(batch_ms), per_window)
    ]
    rate = inserted / elapsed if elapsed > 0 else 0.0
    return {
        "benchmark": "ingest",
        "database": db["NAME"],
        "records": records,
        "batch": batch,
        "sessions": sessions,
        "batches": len(batches),
        "inserted": inserted,
        "stored": stored,
        "elapsed_s": round(elapsed, 3),
        "records_per_s": round(rate, 1),
        "min_window_records_per_s": min(window_rates),
        "window_records_per_s": window_rates,
        "batch_ms": summarize(batch_ms),
        # Where the time goes: this process (Python, psycopg) and its PostgreSQL backend (same host).
        "client_cpu_s": round(own_cpu, 3),
        "backend_cpu_s": round(backend_cpu, 3) if backend_cpu is not None else None,
        "target_records_per_s": TARGET_RECORDS_PER_S,
        # Over the whole run; the slowest tenth is reported beside it.
        "target_met": rate >= TARGET_RECORDS_PER_S,
        "load_before": load_before,
        "load_after": machine_load(),
    }


def format_ingest(report: dict[str, Any]) -> str:
    b, elapsed, rate = report["batch_ms"], report["elapsed_s"], report["records_per_s"]
    return (
        f"inserted {report['inserted']} records ({report['stored']} stored) in {elapsed:.2f} s:"
        f" {rate:,.0f} records/s (slowest tenth: {report['min_window_records_per_s']:,.0f} records/s)\n"
        f"batch time ms: p50 {b['p50']:.2f}  p99 {b['p99']:.2f}  max {b['max']:.2f}\n"
        f"CPU s: this process {report['client_cpu_s']}, its PostgreSQL backend {report['backend_cpu_s']}"
        f" (wall {elapsed:.2f} s)\n"
        f"target >= {TARGET_RECORDS_PER_S:,.0f} records/s sustained: {'met' if report['target_met'] else 'MISSED'}\n"
        f"load average before {report['load_before']['loadavg']} after {report['load_after']['loadavg']}"
        f" on {report['load_before']['cpus']} CPUs"
    )


def _create_rows(run: str, n_sessions: int) -> tuple[GpuWorker, list[str]]:
    user = get_user_model().objects.create(username=f"bench-ingest-{run}", is_active=False)
    worker, sessions = bench_sessions(
        label=f"bench-ingest-{run}", owner=user, count=n_sessions, model_name="bench-ingest"
    )
    return worker, [str(s.pk) for s in sessions]


def _backend_process() -> psutil.Process | None:
    """This connection's PostgreSQL backend process when the server runs on this host, else None."""
    with connection.cursor() as cursor:
        cursor.execute("SELECT pg_backend_pid()")
        pid = cursor.fetchone()[0]
    try:
        process = psutil.Process(pid)
        process.cpu_times()
        return process
    except (psutil.Error, OSError):
        return None


def _delete_rows(run: str) -> None:
    """Everything labelled ``bench-ingest-<run>`` goes, whatever step the run stopped at."""
    label = f"bench-ingest-{run}"
    connection.close_if_unusable_or_obsolete()
    sessions = GenerationSession.objects.filter(owner__username=label)
    ChunkRecord.objects.filter(session__in=sessions).delete()
    sessions.delete()
    GpuWorker.objects.filter(name=label).delete()
    get_user_model().objects.filter(username=label).delete()
