"""The durable chunk-record stream on Redis (no Django): the audit plane's write-ahead log.

A chunk's record is appended here (XADD) *before* the chunk is published to its clients, by the
worker's publisher; the control plane's ingester (``sessions.ingest``) drains the stream into
PostgreSQL. So a chunk that reached a client has a record even when its worker is killed the next
instant: the record is already in Redis, not in a batch buffered in the dying process, and the
publisher never waits on PostgreSQL.

The WebSocket consumers append the delivery latency they measured to the same stream, as a full
row built from the chunk's header plus ``delivery_ms``. The ingester upserts on (session, index),
so a delivery lands whichever of the two entries is ingested first: nothing waits for a record to
exist, and nothing is dropped because it came early.

Reading is at-least-once and ingesting is idempotent: the ingester reads through one consumer
group, acknowledges entries only after its PostgreSQL transaction committed, and re-reads its own
unacknowledged entries first after a crash; the insert is ON CONFLICT, the counters are GREATEST.
Acknowledged entries are trimmed (XTRIM MINID), so the stream holds only the backlog.
"""

from __future__ import annotations

import json
import logging
import math
import uuid
from dataclasses import dataclass
from typing import Any, TypedDict

import redis

logger = logging.getLogger("contracts.wire.records")

STREAM = "ss:records:chunks"
GROUP = "ingest"
CONSUMER = "ingester"  # one logical reader: runs are serialised by INGEST_LOCK
INGEST_LOCK = "ss:records:ingest-lock"
# A bound on Redis memory if the ingester stays down (≈ 200 bytes an entry: about 400 MB, hours of
# a busy cluster's chunks). Past it the oldest un-ingested records are trimmed: an audit gap, which
# is better than Redis (and with it the chunk data plane) running out of memory.
STREAM_MAXLEN = 2_000_000


class ChunkRow(TypedDict):
    """One chunk's record as it travels on the stream (the names of the chunk header's fields)."""

    session: str
    index: int
    worker: str
    batch_size: int
    generation_ms: float
    generated_at: float  # epoch seconds
    delivery_ms: float | None


def chunk_row(header: dict[str, Any], *, delivery_ms: float | None = None) -> ChunkRow:
    """The record of a chunk from its header (``contracts.wire.frames`` wire format)."""
    return ChunkRow(
        session=str(header["session"]),
        index=int(header["index"]),
        worker=str(header["worker"]),
        batch_size=int(header["batch_size"]),
        generation_ms=float(header["generation_ms"]),
        generated_at=float(header["generated_at"]),
        delivery_ms=None if delivery_ms is None else float(delivery_ms),
    )


def chunk_record_append(client: redis.Redis | redis.client.Pipeline, header: dict[str, Any]) -> None:
    """Append the record of a chunk about to be published (raises if Redis refuses it, so the caller
    does not publish a chunk that has no record). ``client`` may be a pipeline, to send it together
    with the publisher's other writes."""
    _append(client, chunk_row(header))


def chunk_deliveries_append(client: redis.Redis, rows: list[ChunkRow]) -> None:
    """Append measured deliveries (rows with ``delivery_ms``) in one round trip."""
    if not rows:
        return
    pipe = client.pipeline(transaction=False)
    for row in rows:
        _append(pipe, row)
    pipe.execute()


def _append(client: redis.Redis | redis.client.Pipeline, row: ChunkRow) -> None:
    client.xadd(STREAM, {"row": json.dumps(row)}, maxlen=STREAM_MAXLEN, approximate=True)


def row_parse(raw: bytes | str | None) -> ChunkRow | None:
    """A stream entry's row, or None when it can never be stored (it is then acknowledged and
    dropped with a log line, so one bad entry cannot block the stream behind it)."""
    try:
        data = json.loads(raw) if raw is not None else None
        row = ChunkRow(
            session=str(uuid.UUID(str(data["session"]))),
            index=int(data["index"]),
            worker=str(data["worker"]),
            batch_size=int(data["batch_size"]),
            generation_ms=float(data["generation_ms"]),
            generated_at=float(data["generated_at"]),
            delivery_ms=None if data.get("delivery_ms") is None else float(data["delivery_ms"]),
        )
    except (TypeError, ValueError, KeyError, AttributeError):
        return None
    numbers = [row["generation_ms"], row["generated_at"], row["delivery_ms"] or 0.0]
    # The ranges ChunkRecord's columns and constraints accept (integer index, smallint batch).
    if not (0 <= row["index"] < 2**31 and 1 <= row["batch_size"] < 2**15):
        return None
    if not all(math.isfinite(x) and x >= 0 for x in numbers):
        return None
    return row


@dataclass
class RecordEntry:
    entry_id: str
    row: ChunkRow | None  # None: malformed, acknowledged without being stored


class RecordReader:
    """The ingester's side of the stream: its own unacknowledged entries first, then new ones."""

    def __init__(self, client: redis.Redis) -> None:
        self.client = client
        try:
            # From id 0: a group created after records were appended still reads them all.
            self.client.xgroup_create(STREAM, GROUP, id="0", mkstream=True)
        except redis.ResponseError as exc:
            if "BUSYGROUP" not in str(exc):
                raise
        self._backlog = True

    def read(self, count: int) -> list[RecordEntry]:
        while True:
            start = "0" if self._backlog else ">"
            reply = self.client.xreadgroup(GROUP, CONSUMER, {STREAM: start}, count=count)
            entries = [
                RecordEntry(_text(entry_id), self._row(entry_id, fields))
                for _stream, batch in reply or []
                for entry_id, fields in batch
            ]
            if entries or not self._backlog:
                return entries
            self._backlog = False  # the crashed run's entries are done: read new ones

    def _row(self, entry_id: bytes | str, fields: dict | None) -> ChunkRow | None:
        # A pending entry trimmed from the stream comes back with no fields.
        raw = (fields or {}).get(b"row") or (fields or {}).get("row")
        row = row_parse(raw)
        if row is None:
            logger.warning("records.malformed entry=%s row=%r", _text(entry_id), raw)
        return row

    def ack(self, entries: list[RecordEntry]) -> None:
        """Acknowledge ``entries`` (after their rows committed) and trim everything before them."""
        if not entries:
            return
        ids = [e.entry_id for e in entries]
        self.client.xack(STREAM, GROUP, *ids)
        # Everything older than the last acknowledged id was read in stream order and acknowledged
        # (one reader, runs serialised), so only the backlog stays in Redis. Exact trimming: its cost
        # is the entries it removes, and a quiet stream is emptied too (approximate trimming only
        # drops whole nodes of 100 entries).
        ms, seq = max(_id_key(i) for i in ids)
        self.client.xtrim(STREAM, minid=f"{ms}-{seq + 1}", approximate=False)  # MINID keeps ids >= it

    def backlog(self) -> dict[str, int]:
        """Entries in the stream and entries read but not yet acknowledged (for operators)."""
        pending = self.client.xpending(STREAM, GROUP)
        return {"length": int(self.client.xlen(STREAM)), "pending": int(pending["pending"])}


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value


def _id_key(entry_id: str) -> tuple[int, int]:
    ms, _, seq = entry_id.partition("-")
    return int(ms), int(seq or 0)
