"""The chunk-record ingester: the durable record stream (``contracts.wire.records``) into PostgreSQL.

Workers append each chunk's record to a Redis stream before publishing the chunk; consumers append
the delivery latencies they measure. ``chunk_records_drain`` (beat, ``sessions.tasks``) reads the
stream in batches and writes each batch with ``chunk_records_ingest``; it acknowledges a batch only
after its transaction committed. A run that dies between the two leaves its entries pending, and
the next run reads them again first: ingesting is idempotent, so each chunk is recorded once.

One batch is one transaction: COPY into a temporary table, one INSERT … ON CONFLICT per chunk
(a record's first write wins; a delivery latency fills an empty ``delivery_ms`` whichever entry
comes first), and each session's progress counters raised to what was recorded.
"""

from __future__ import annotations

import functools
import logging
import time
from datetime import UTC, datetime

import redis
from django.conf import settings
from django.db import connection, transaction

from contracts.wire.records import INGEST_LOCK, ChunkRow, RecordReader

logger = logging.getLogger("sessions.ingest")

DRAIN_BATCH = 2000
# Runs share the scheduler's queue: a short budget keeps a large backlog from delaying its ticks
# (the next run, a second later, goes on where this one stopped).
DRAIN_BUDGET_S = 5.0
# How long the ingest lock outlives its budget: one batch's write past the deadline. The lock is the
# only thing left of a run that Redis's own outage interrupted (its release fails; with an AOF the
# key survives the restart), so this margin is how long ingesting stalls after a Redis restart: it
# was 60 s, and the audit then lagged the stream by a minute after every blip.
INGEST_LOCK_MARGIN_S = 15.0


@functools.cache
def records_client() -> redis.Redis:
    """One client (one connection pool) per process for the record stream; redis-py renews the
    pool's connections in a forked child."""
    return redis.Redis.from_url(settings.REDIS_URL)


@transaction.atomic
def chunk_records_ingest(*, rows: list[ChunkRow]) -> int:
    """Write ``rows`` (records and measured deliveries); returns the number of new records.

    Rows of sessions that no longer exist are skipped; ``worker`` names a ``GpuWorker`` (a name with
    no row leaves ``worker_id`` empty, as for a deleted worker).
    """
    if not rows:
        return 0
    with connection.cursor() as cursor:
        cursor.execute(
            "CREATE TEMP TABLE IF NOT EXISTS chunk_ingest ("
            " session_id uuid, chunk_index integer, worker_name text, batch_size smallint,"
            " generation_ms double precision, created_at timestamptz, delivery_ms double precision)"
            " ON COMMIT DELETE ROWS"
        )
        raw = cursor.cursor  # psycopg 3 cursor: COPY support
        with raw.copy(
            "COPY chunk_ingest (session_id, chunk_index, worker_name, batch_size, generation_ms,"
            " created_at, delivery_ms) FROM STDIN"
        ) as copy:
            for row in rows:
                copy.write_row(
                    (
                        row["session"],
                        row["index"],
                        row["worker"],
                        row["batch_size"],
                        row["generation_ms"],
                        datetime.fromtimestamp(row["generated_at"], tz=UTC),
                        row["delivery_ms"],
                    )
                )
        # One row per chunk (a record and its delivery may share a batch: ON CONFLICT DO UPDATE may
        # touch a row once per statement). The first client to receive it gives its delivery latency.
        # ``xmax = 0`` holds for rows this statement inserted, not for those it updated.
        cursor.execute(
            "INSERT INTO streams_chunkrecord"
            " (session_id, chunk_index, worker_id, batch_size, generation_ms, created_at, delivery_ms)"
            " SELECT i.session_id, i.chunk_index, w.id, i.batch_size, i.generation_ms, i.created_at,"
            " i.delivery_ms"
            " FROM (SELECT session_id, chunk_index, MIN(worker_name) AS worker_name,"
            "  MIN(batch_size) AS batch_size, MIN(generation_ms) AS generation_ms,"
            "  MIN(created_at) AS created_at, MIN(delivery_ms) AS delivery_ms"
            "  FROM chunk_ingest GROUP BY session_id, chunk_index) i"
            " JOIN streams_generationsession s ON s.id = i.session_id"
            " LEFT JOIN gpu_gpuworker w ON w.name = i.worker_name"
            " ON CONFLICT (session_id, chunk_index) DO UPDATE SET delivery_ms = EXCLUDED.delivery_ms"
            " WHERE streams_chunkrecord.delivery_ms IS NULL AND EXCLUDED.delivery_ms IS NOT NULL"
            " RETURNING (xmax = 0)"
        )
        inserted = sum(1 for (is_new,) in cursor.fetchall() if is_new)
        # Lock the sessions in primary-key order (as the scheduler does) before updating them.
        cursor.execute(
            "SELECT s.id FROM streams_generationsession s WHERE s.id IN (SELECT DISTINCT session_id FROM chunk_ingest)"
            " ORDER BY s.id FOR NO KEY UPDATE"
        )
        # Counters agree with records, terminated sessions included: a session's last records often
        # arrive after it ended. GREATEST makes a re-ingested batch change nothing.
        cursor.execute(
            "UPDATE streams_generationsession s SET"
            " chunks_generated = GREATEST(s.chunks_generated, m.last + 1),"
            " delivered_index = GREATEST(s.delivered_index, m.last)"
            " FROM (SELECT session_id, MAX(chunk_index) AS last FROM chunk_ingest GROUP BY session_id) m"
            " WHERE s.id = m.session_id"
        )
    return inserted


def chunk_records_drain(
    *, client: redis.Redis, batch: int = DRAIN_BATCH, budget_s: float = DRAIN_BUDGET_S
) -> int:
    """Ingest the record stream's backlog, for at most ``budget_s``; returns the new records.

    Runs are serialised by a Redis lock (a run that finds it held returns 0 at once): one reader at
    a time keeps "everything before the last acknowledged id is acknowledged" true, which is what
    lets the stream be trimmed. The lock expires on its own if its holder is killed.
    """
    lock = client.lock(INGEST_LOCK, timeout=budget_s + INGEST_LOCK_MARGIN_S)
    if not lock.acquire(blocking=False):
        return 0
    try:
        reader = RecordReader(client)
        deadline = time.monotonic() + budget_s
        inserted = 0
        while time.monotonic() < deadline:
            entries = reader.read(count=batch)
            if not entries:
                break
            inserted += chunk_records_ingest(rows=[e.row for e in entries if e.row is not None])
            # After the commit: a crash before this line leaves the entries pending, re-read first
            # by the next run and ingested again without effect.
            reader.ack(entries)
        return inserted
    finally:
        try:
            lock.release()
        except redis.exceptions.LockError:
            logger.warning("records.ingest_lock_expired budget_s=%s", budget_s)
