"""Batched ingest of chunk records (the audit plane's hottest write path).

One call per batch: COPY the rows into a temporary table, insert them with ON CONFLICT DO NOTHING
(a chunk index is recorded once, even if a batch is retried), and advance each session's progress
counters in the same transaction.
"""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

from django.db import connection, transaction


@transaction.atomic
def chunk_records_ingest(*, rows: list[dict[str, Any]], worker_id: int | None) -> int:
    """Write ``rows`` ({session_id, chunk_index, batch_size, generation_ms, created_at: epoch s});
    returns the number of new records."""
    if not rows:
        return 0
    with connection.cursor() as cursor:
        cursor.execute(
            "CREATE TEMP TABLE IF NOT EXISTS chunk_ingest ("
            " session_id uuid, chunk_index integer, worker_id bigint, batch_size smallint,"
            " generation_ms double precision, created_at timestamptz) ON COMMIT DELETE ROWS"
        )
        raw = cursor.cursor  # psycopg 3 cursor: COPY support
        with raw.copy(
            "COPY chunk_ingest (session_id, chunk_index, worker_id, batch_size, generation_ms, created_at) FROM STDIN"
        ) as copy:
            for row in rows:
                copy.write_row(
                    (
                        row["session_id"],
                        row["chunk_index"],
                        worker_id,
                        row["batch_size"],
                        row["generation_ms"],
                        datetime.fromtimestamp(row["created_at"], tz=UTC),
                    )
                )
        cursor.execute(
            "INSERT INTO streams_chunkrecord (session_id, chunk_index, worker_id, batch_size, generation_ms, created_at)"
            " SELECT i.session_id, i.chunk_index, i.worker_id, i.batch_size, i.generation_ms, i.created_at"
            " FROM chunk_ingest i JOIN streams_generationsession s ON s.id = i.session_id"
            " ON CONFLICT (session_id, chunk_index) DO NOTHING"
        )
        inserted = cursor.rowcount
        # Lock the sessions in primary-key order (as the scheduler does) before updating them.
        cursor.execute(
            "SELECT s.id FROM streams_generationsession s WHERE s.id IN (SELECT DISTINCT session_id FROM chunk_ingest)"
            " ORDER BY s.id FOR NO KEY UPDATE"
        )
        cursor.execute(
            "UPDATE streams_generationsession s SET"
            " chunks_generated = GREATEST(s.chunks_generated, m.last + 1),"
            " delivered_index = GREATEST(s.delivered_index, m.last)"
            " FROM (SELECT session_id, MAX(chunk_index) AS last FROM chunk_ingest GROUP BY session_id) m"
            " WHERE s.id = m.session_id AND s.status <> 'terminated'"
        )
    return inserted
