"""The chunk-record ingester against real Redis and PostgreSQL (issue 17, defect 8).

Records travel on a durable Redis stream that the ingester drains; these tests check that a record
appended by a worker that is then killed is ingested exactly once (also when the ingester runs twice
or dies between its commit and its acknowledgement), that a delivery latency measured before its
record is ingested still lands, and that session counters agree with the records.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
import redis
from django.conf import settings
from django.utils import timezone

from contracts.wire.records import (
    GROUP,
    INGEST_LOCK,
    STREAM,
    RecordReader,
    chunk_record_append,
    chunk_row,
)
from sessions import ingest, services, tasks
from sessions.ingest import chunk_records_drain, chunk_records_ingest
from sessions.models import ChunkRecord, GenerationSession
from tests.factories import GpuWorkerFactory, SessionFactory

# The ingester commits its own transactions (COPY into a temp table that empties on commit).
pytestmark = pytest.mark.django_db(transaction=True)

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def client():
    client = redis.Redis.from_url(settings.REDIS_URL)
    client.delete(STREAM, INGEST_LOCK)
    yield client
    client.delete(STREAM, INGEST_LOCK)


def header(session, index: int, *, worker: str = "w1", generation_ms: float = 40.0) -> dict:
    return {
        "session": str(session.pk),
        "index": index,
        "epoch": 1,
        "generation_ms": generation_ms,
        "worker": worker,
        "batch_size": 2,
        "width": 64,
        "height": 64,
        "fps": 8,
        "mime": "image/jpeg",
        "generated_at": time.time(),
    }


def indices(session) -> list[int]:
    return list(ChunkRecord.objects.filter(session=session).values_list("chunk_index", flat=True))


def pending(client) -> int:
    return int(client.xpending(STREAM, GROUP)["pending"])


def test_records_of_a_killed_worker_are_ingested_once_even_when_the_ingester_runs_twice(client):
    # Given a worker process that appends five records, then is killed before anything else
    worker = GpuWorkerFactory(name=f"w-{uuid.uuid4().hex[:8]}")
    session = SessionFactory(status="executing", worker=worker)
    heads = [header(session, i, worker=worker.name) for i in range(5)]
    script = (
        "import json, os, signal, sys, redis\n"
        "from contracts.wire.records import chunk_record_append\n"
        "client = redis.Redis.from_url(sys.argv[1])\n"
        "for h in json.loads(sys.argv[2]):\n"
        "    chunk_record_append(client, h)\n"
        "os.kill(os.getpid(), signal.SIGKILL)\n"
    )
    process = subprocess.run(
        [sys.executable, "-c", script, settings.REDIS_URL, json.dumps(heads)], cwd=ROOT, check=False
    )
    assert process.returncode == -signal.SIGKILL
    # When the ingester runs, and runs again
    assert chunk_records_drain(client=client) == 5
    assert chunk_records_drain(client=client) == 0
    # Then each chunk has exactly one record, with its worker, and the stream holds nothing pending
    assert indices(session) == [0, 1, 2, 3, 4]
    assert set(ChunkRecord.objects.filter(session=session).values_list("worker_id", flat=True)) == {worker.pk}
    assert pending(client) == 0


def test_an_ingester_killed_between_commit_and_ack_is_harmless(client, monkeypatch):
    session = SessionFactory()
    for i in range(3):
        chunk_record_append(client, header(session, i))

    def die(self, entries):
        raise SystemExit("killed after the commit, before the XACK")

    # Given a run that commits its batch and dies before acknowledging it
    monkeypatch.setattr(RecordReader, "ack", die)
    with pytest.raises(SystemExit):
        chunk_records_drain(client=client)
    assert indices(session) == [0, 1, 2] and pending(client) == 3
    monkeypatch.undo()
    # When the next run starts (more records arrived meanwhile)
    chunk_record_append(client, header(session, 3))
    inserted = chunk_records_drain(client=client)
    # Then it re-reads the unacknowledged batch without duplicating it, and ingests the new one
    assert inserted == 1
    assert indices(session) == [0, 1, 2, 3]
    assert pending(client) == 0
    assert client.xlen(STREAM) == 0  # acknowledged entries are trimmed


def test_an_ingester_killed_before_commit_loses_nothing(client, monkeypatch):
    session = SessionFactory()
    for i in range(3):
        chunk_record_append(client, header(session, i))

    def fail(*, rows):
        raise ConnectionError("PostgreSQL went away")

    monkeypatch.setattr(ingest, "chunk_records_ingest", fail)
    with pytest.raises(ConnectionError):
        chunk_records_drain(client=client)
    assert indices(session) == [] and pending(client) == 3
    monkeypatch.undo()
    assert chunk_records_drain(client=client) == 3
    assert indices(session) == [0, 1, 2]


def test_a_delivery_measured_before_its_record_is_ingested_still_lands(client):
    session = SessionFactory()
    # Given the consumer's measurement reaches the stream, and is ingested, before the worker's record
    services.chunk_deliveries_record(deliveries=[chunk_row(header(session, 0), delivery_ms=17.5)])
    chunk_records_drain(client=client)
    chunk_record_append(client, header(session, 0))
    chunk_records_drain(client=client)
    # And, for chunk 1, the record and its delivery are in one batch
    chunk_record_append(client, header(session, 1))
    services.chunk_deliveries_record(deliveries=[chunk_row(header(session, 1), delivery_ms=9.0)])
    # And, for chunk 2, the delivery comes after the record was ingested
    chunk_record_append(client, header(session, 2))
    chunk_records_drain(client=client)
    services.chunk_deliveries_record(deliveries=[chunk_row(header(session, 2), delivery_ms=30.0)])
    chunk_records_drain(client=client)
    # Then every record has its delivery latency, once
    rows = list(ChunkRecord.objects.filter(session=session).values_list("chunk_index", "delivery_ms"))
    assert rows == [(0, 17.5), (1, 9.0), (2, 30.0)]


def test_the_first_measured_delivery_is_kept(client):
    session = SessionFactory()
    chunk_record_append(client, header(session, 0))
    services.chunk_deliveries_record(deliveries=[chunk_row(header(session, 0), delivery_ms=12.0)])
    chunk_records_drain(client=client)
    # A second tab receiving the same chunk later does not overwrite it
    services.chunk_deliveries_record(deliveries=[chunk_row(header(session, 0), delivery_ms=95.0)])
    chunk_records_drain(client=client)
    assert ChunkRecord.objects.get(session=session).delivery_ms == 12.0


def test_counters_agree_with_records_also_for_a_terminated_session(client):
    # Given a session that ended while its last records were still on their way
    session = SessionFactory(
        status="terminated", terminated_at=timezone.now(), chunks_generated=3, delivered_index=2
    )
    rows = [chunk_row(header(session, i)) for i in range(5)]
    # When they are ingested
    assert chunk_records_ingest(rows=rows) == 5
    # Then its counters match its highest recorded index
    session = GenerationSession.objects.get(pk=session.pk)
    assert (session.chunks_generated, session.delivered_index) == (5, 4)
    # And an older batch ingested again never lowers them
    chunk_records_ingest(rows=rows[:2])
    session = GenerationSession.objects.get(pk=session.pk)
    assert (session.chunks_generated, session.delivered_index) == (5, 4)


def test_malformed_entries_are_skipped_without_blocking_the_stream(client):
    session = SessionFactory()
    client.xadd(STREAM, {"row": "not json"})
    client.xadd(STREAM, {"row": json.dumps({**chunk_row(header(session, 9)), "generation_ms": -1})})
    client.xadd(STREAM, {"other": "field"})
    chunk_record_append(client, header(session, 0))
    chunk_record_append(client, {**header(session, 1), "session": str(uuid.uuid4())})  # no such session
    assert chunk_records_drain(client=client) == 1
    assert indices(session) == [0]
    assert pending(client) == 0


def test_a_second_ingester_run_waits_for_the_first(client):
    session = SessionFactory()
    chunk_record_append(client, header(session, 0))
    held = client.lock(INGEST_LOCK, timeout=30)
    assert held.acquire(blocking=False)
    assert chunk_records_drain(client=client) == 0
    held.release()
    assert chunk_records_drain(client=client) == 1


def test_the_periodic_task_drains_the_stream(client):
    session = SessionFactory()
    chunk_record_append(client, header(session, 0))
    assert tasks.chunk_records_drain.apply().get() == 1
    assert indices(session) == [0]
    assert "chunk records ingest" in settings.PERIODIC_TASKS


def test_a_killed_ingester_lock_expires(client):
    # A run killed while holding the lock (no release) blocks others only until the lock times out.
    session = SessionFactory()
    chunk_record_append(client, header(session, 0))
    client.set(INGEST_LOCK, "dead-run", px=200)
    assert chunk_records_drain(client=client) == 0
    time.sleep(0.3)
    assert chunk_records_drain(client=client) == 1
