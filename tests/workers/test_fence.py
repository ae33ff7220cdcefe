"""The publish lease against real Redis: the Lua fence, and the publisher that consults it.

Issue 17, defects 1 and 2: a worker frozen past its heartbeat timeout woke up and kept publishing
under its old epoch; and it had marked chunk 17 delivered before sending it, so the new owner
resumed at 18 and 17 arrived ten seconds later from the old worker.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field

import pytest
import redis
from django.conf import settings

from contracts.wire.channel import (
    EPOCH_ENDED,
    LEASE_TTL_S,
    PublishFence,
    Verdict,
    delivered_key,
    epoch_key,
)
from contracts.wire.records import STREAM
from workers.daemon.publisher import ChunkPublisher
from workers.runtime.encoding import EncodedChunk


@pytest.fixture
def client():
    return redis.Redis.from_url(settings.REDIS_URL)


@pytest.fixture
def sid(client):
    session_id = str(uuid.uuid4())
    yield session_id
    client.delete(epoch_key(session_id), delivered_key(session_id))


@pytest.fixture
def fence(client):
    return PublishFence(client)


def delivered(client, sid) -> int | None:
    raw = client.get(delivered_key(sid))
    return None if raw is None else int(raw)


def test_the_first_publisher_takes_the_lease_and_renews_it(fence, client, sid):
    admission = fence.admit(sid, 1, 0)
    assert (admission.verdict, admission.lease, admission.delivered) == (Verdict.PUBLISH, 1, -1)
    assert int(client.get(epoch_key(sid))) == 1
    client.expire(epoch_key(sid), 5)
    fence.admit(sid, 1, 1)
    assert client.ttl(epoch_key(sid)) > LEASE_TTL_S - 10  # each publish renews it


def test_a_worker_older_than_the_lease_is_fenced_out(fence, client, sid):
    fence.admit(sid, 1, 0)
    fence.mark_delivered(sid, 1, 0)
    # The control plane declared the worker lost and committed the recovery at epoch 2.
    assert fence.raise_to(sid, 2) == 2
    admission = fence.admit(sid, 1, 1)
    assert (admission.verdict, admission.lease) == (Verdict.STALE, 2)
    assert not fence.holds(sid, 1) and fence.holds(sid, 2)
    # Its lease is not renewed, nor the delivered mark moved, by the stale attempt.
    assert int(client.get(epoch_key(sid))) == 2 and delivered(client, sid) == 0


def test_a_newer_owner_takes_the_lease_and_a_late_raise_never_lowers_it(fence, client, sid):
    fence.admit(sid, 1, 0)
    # The new owner got its (committed) command before the control plane's after-commit raise.
    assert fence.admit(sid, 4, 1).verdict is Verdict.PUBLISH
    assert fence.raise_to(sid, 3) == 4
    assert fence.admit(sid, 3, 2).verdict is Verdict.STALE
    assert fence.admit(sid, 4, 2).verdict is Verdict.PUBLISH


def test_an_index_already_delivered_is_not_published_again(fence, client, sid):
    for index in range(3):
        assert fence.admit(sid, 1, index).verdict is Verdict.PUBLISH
        assert fence.mark_delivered(sid, 1, index)
    admission = fence.admit(sid, 2, 2)  # a new owner regenerating the last delivered chunk
    assert (admission.verdict, admission.delivered) == (Verdict.PASSED, 2)
    assert fence.admit(sid, 2, 3).verdict is Verdict.PUBLISH


def test_the_mark_follows_the_send_and_only_while_the_lease_holds(fence, client, sid):
    """Defect 2: chunk 17 passed the fence, then its worker froze before the send. The resume
    point a takeover reads is still 16, so the new owner delivers 17 itself."""
    for index in range(17):
        fence.admit(sid, 1, index)
        fence.mark_delivered(sid, 1, index)
    assert fence.admit(sid, 1, 17).verdict is Verdict.PUBLISH
    assert delivered(client, sid) == 16  # admitted, not yet sent: not marked
    fence.raise_to(sid, 2)  # declared lost while frozen
    assert delivered(client, sid) + 1 == 17  # where the new owner resumes
    # The old worker wakes and sends 17; its mark is refused (the consumer drops its copy).
    assert not fence.mark_delivered(sid, 1, 17)
    assert delivered(client, sid) == 16
    # The new owner delivers 17, 18; a late, lower mark never moves it back.
    for index in (17, 18):
        assert fence.admit(sid, 3, index).verdict is Verdict.PUBLISH
        assert fence.mark_delivered(sid, 3, index)
    assert fence.mark_delivered(sid, 3, 17) and delivered(client, sid) == 18


def test_an_ended_session_fences_every_epoch(fence, sid):
    fence.admit(sid, 7, 0)
    fence.end(sid)
    assert fence.admit(sid, 7, 1).verdict is Verdict.STALE
    assert fence.admit(sid, 10_000, 1).lease == EPOCH_ENDED


# --- the publisher ----------------------------------------------------------------------------


@dataclass
class FakeResult:
    session_id: str
    chunk_index: int
    generation_ms: float = 1.0
    batch_size: int = 1
    width: int = 8
    height: int = 8
    fps: int = 8
    frame_count: int = 1

    def frames(self, timeout: float) -> list[bytes]:
        return [b"frame"]

    def encoding(self, timeout: float) -> EncodedChunk:
        return EncodedChunk(frames=self.frames(timeout), mime="image/jpeg", encode_ms=0.1)


@dataclass
class RecordingLayer:
    """A channel layer that notes, at the moment of each send, what Redis says was delivered."""

    client: redis.Redis
    sent: list[tuple[int, int, int | None]] = field(default_factory=list)  # index, epoch, mark

    async def group_send(self, group: str, message: dict) -> None:
        header = message["header"]
        self.sent.append((header["index"], header["epoch"], delivered(self.client, header["session"])))


class StreamRecords:
    """The chunk records the publisher appended to the record stream, for one session."""

    def __init__(self, client, sid: str) -> None:
        self.client, self.sid = client, sid

    @property
    def rows(self) -> list[dict]:
        rows = [json.loads(fields[b"row"]) for _, fields in self.client.xrange(STREAM)]
        return [{"chunk_index": row["index"]} for row in rows if row["session"] == self.sid]


def publish(client, monkeypatch, items: list[tuple[str, int, int]]):
    layer = RecordingLayer(client)
    monkeypatch.setattr("channels.layers.get_channel_layer", lambda: layer)
    reporter = StreamRecords(client, items[0][0])
    publisher = ChunkPublisher("w-test", client)
    for sid, index, epoch in items:
        publisher.submit(FakeResult(sid, index), epoch)
    publisher.start()
    publisher.stop()
    publisher.join(timeout=10)
    assert not publisher.is_alive()
    return publisher, layer, reporter


def test_the_publisher_marks_a_chunk_delivered_only_after_sending_it(client, sid, monkeypatch):
    publisher, layer, reporter = publish(client, monkeypatch, [(sid, i, 1) for i in range(3)])
    # At each send the mark still names the previous chunk; after the last, the last one.
    assert layer.sent == [(0, 1, None), (1, 1, 0), (2, 1, 1)]
    assert delivered(client, sid) == 2
    assert [r["chunk_index"] for r in reporter.rows] == [0, 1, 2]
    assert publisher.queued(sid) == 0


def test_a_fenced_publisher_sends_nothing_and_reports_the_session_superseded(client, sid, monkeypatch):
    PublishFence(client).raise_to(sid, 5)
    publisher, layer, reporter = publish(client, monkeypatch, [(sid, 0, 4), (sid, 1, 4)])
    assert layer.sent == [] and reporter.rows == [] and delivered(client, sid) is None
    assert publisher.superseded.get_nowait() == (sid, 5)
    assert publisher.superseded.empty()  # the second chunk was dropped without asking again
    assert publisher.queued(sid) == 0
