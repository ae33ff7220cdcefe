"""A chunk's trace starts on the worker's publisher and travels in its channel-layer message as a W3C
``traceparent`` (docs/observability.md, "Traces"); tracing off, the message carries none. Real Redis
and channel layer; the spans go to the SDK's in-memory exporter (the processes' OTLP export is
tests/e2e/test_tracing.py's)."""

from __future__ import annotations

import asyncio
import uuid

import pytest
import redis
from channels.layers import get_channel_layer
from django.conf import settings

from contracts import tracing
from contracts.wire.frames import group_name
from tests.workers.test_publisher_records import a_result
from workers.daemon.publisher import ChunkPublisher


def published_messages(count: int) -> list[dict]:
    """``count`` chunks through a real ``ChunkPublisher``, as a viewer's channel receives them."""
    client = redis.Redis.from_url(settings.REDIS_URL)
    session_id = str(uuid.uuid4())
    layer = get_channel_layer()
    publisher = ChunkPublisher("w-tracing", client)
    publisher.start()

    async def receive() -> list[dict]:
        channel = await layer.new_channel()
        await layer.group_add(group_name(session_id), channel)
        for index in range(count):
            publisher.submit(a_result(session_id, index), epoch=1)
        return [await asyncio.wait_for(layer.receive(channel), timeout=10) for _ in range(count)]

    try:
        return asyncio.run(receive())
    finally:
        publisher.stop()
        publisher.join(timeout=10)


@pytest.fixture
def traced_in_memory():
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    exporter = InMemorySpanExporter()
    tracing.tracing_start(
        service_name="test-worker", endpoint="unused", chunk_sample_rate=1.0, exporter=exporter
    )
    try:
        yield exporter
    finally:
        tracing.tracing_stop()


def test_tracing_off_a_chunk_message_carries_no_trace():
    assert not tracing.ON
    messages = published_messages(2)
    assert [m["header"]["index"] for m in messages] == [0, 1]
    assert all("traceparent" not in m for m in messages)


def test_a_sampled_chunk_carries_its_publish_span_as_traceparent(traced_in_memory):
    messages = published_messages(2)
    tracing.tracing_stop()  # exports what is buffered
    spans = traced_in_memory.get_finished_spans()
    publishes = {f"{s.context.span_id:016x}": s for s in spans if s.name == tracing.CHUNK_PUBLISH}
    roots = {s.context.span_id: s for s in spans if s.name == tracing.CHUNK}
    assert len(publishes) == len(roots) == 2
    for message in messages:
        version, trace_id, span_id, flags = message["traceparent"].split("-")
        assert version == "00" and int(flags, 16) & 1  # sampled: the web process continues it
        publish = publishes[span_id]
        assert f"{publish.context.trace_id:032x}" == trace_id
        root = roots[publish.parent.span_id]
        assert root.attributes["chunk.index"] == message["header"]["index"]
        assert root.attributes["chunk.batch_size"] == 2
    # One trace per chunk.
    assert len({s.context.trace_id for s in roots.values()}) == 2
