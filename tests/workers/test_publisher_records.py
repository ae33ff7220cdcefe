"""The publisher makes a chunk's record durable before any client can receive the chunk (issue 17,
defect 8: a chunk delivered 30 ms before a ``kill -9`` had no record, its batch died with the
process). Real Redis stream and channel layer; no database."""

from __future__ import annotations

import asyncio
import json
import uuid
from types import SimpleNamespace

import redis
from channels.layers import get_channel_layer
from django.conf import settings

from contracts.wire.frames import CHUNK_MESSAGE, group_name
from contracts.wire.records import STREAM, row_parse
from workers.daemon.publisher import ChunkPublisher
from workers.runtime.encoding import EncodedChunk


def a_result(session_id: str, index: int) -> SimpleNamespace:
    return SimpleNamespace(
        session_id=session_id,
        chunk_index=index,
        generation_ms=41.25,
        batch_size=2,
        width=64,
        height=64,
        fps=8,
        frame_count=1,
        frames=lambda timeout: [b"\xff\xd8frame"],
        encoding=lambda timeout: EncodedChunk(frames=[b"\xff\xd8frame"], mime="image/jpeg", encode_ms=0.1),
    )


def stream_rows(client: redis.Redis, session_id: str) -> list[dict]:
    rows = [row_parse(fields[b"row"]) for _id, fields in client.xrange(STREAM)]
    return [r for r in rows if r is not None and r["session"] == session_id]


def test_every_chunk_a_client_receives_already_has_its_record_on_the_stream():
    client = redis.Redis.from_url(settings.REDIS_URL)
    session_id = str(uuid.uuid4())
    layer = get_channel_layer()
    publisher = ChunkPublisher("w-records", client)
    publisher.start()

    async def receive_three() -> list[tuple[int, int]]:
        channel = await layer.new_channel()
        await layer.group_add(group_name(session_id), channel)
        for index in range(3):
            publisher.submit(a_result(session_id, index), epoch=1)
        seen = []
        for _ in range(3):
            message = await asyncio.wait_for(layer.receive(channel), timeout=10)
            assert message["type"] == CHUNK_MESSAGE
            # The moment the client has the chunk, the worker could die: its record is already durable.
            recorded = [r["index"] for r in stream_rows(client, session_id)]
            seen.append((message["header"]["index"], max(recorded)))
        return seen

    try:
        seen = asyncio.run(receive_three())
    finally:
        publisher.stop()
        publisher.join(timeout=10)
    assert all(recorded >= index for index, recorded in seen)
    rows = stream_rows(client, session_id)
    assert [r["index"] for r in rows] == [0, 1, 2]
    assert rows[0] | {"generated_at": 0} == {
        "session": session_id,
        "index": 0,
        "worker": "w-records",
        "batch_size": 2,
        "generation_ms": 41.25,
        "generated_at": 0,
        "delivery_ms": None,
    }
    ours = [i for i, f in client.xrange(STREAM) if json.loads(f[b"row"])["session"] == session_id]
    client.xdel(STREAM, *ours)
