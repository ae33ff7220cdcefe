"""The session WebSocket consumer against the real Redis channel layer (one consumer at a time)."""

from __future__ import annotations

import json

import pytest
import pytest_asyncio
from asgiref.sync import sync_to_async
from channels.layers import get_channel_layer
from channels.routing import URLRouter
from channels.testing import WebsocketCommunicator
from django.db import connections

from sessions import consumers
from sessions.routing import websocket_urlpatterns
from tests.factories import SessionFactory, UserFactory
from workers.streaming import chunk_message, decode_chunk_frame, group_name

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.asyncio]

application = URLRouter(websocket_urlpatterns)


@pytest_asyncio.fixture(autouse=True)
async def _close_thread_connections():
    # The ORM calls below run in asgiref's sync thread, which keeps its own connection open;
    # close it so the test database can be dropped at the end of the run.
    yield
    await sync_to_async(connections.close_all)()


async def connect(session, user):
    communicator = WebsocketCommunicator(application, f"/ws/sessions/{session.pk}/")
    communicator.scope["user"] = user
    connected, _ = await communicator.connect()
    assert connected
    return communicator


def a_chunk(session, index: int) -> dict:
    header = {
        "session": str(session.pk),
        "index": index,
        "generation_ms": 12.5,
        "worker": "w1",
        "batch_size": 1,
        "width": 64,
        "height": 64,
        "fps": 8,
        "mime": "image/jpeg",
        "generated_at": 0.0,
    }
    return chunk_message(header, [b"\xff\xd8frame-a", b"\xff\xd8frame-b"])


async def test_owner_gets_status_then_chunks_as_binary_frames():
    user = await sync_to_async(UserFactory)()
    session = await sync_to_async(SessionFactory)(owner=user)
    communicator = await connect(session, user)
    status = json.loads(await communicator.receive_from())
    assert status["type"] == "status" and status["status"] == "queued"
    await get_channel_layer().group_send(group_name(str(session.pk)), a_chunk(session, 0))
    header, frames = decode_chunk_frame(await communicator.receive_from())
    assert (
        header["index"] == 0
        and header["worker"] == "w1"
        and frames == [b"\xff\xd8frame-a", b"\xff\xd8frame-b"]
    )
    assert header["delivery_ms"] >= 0
    await communicator.disconnect()


async def test_malformed_messages_get_error_frames_and_the_socket_stays_open():
    user = await sync_to_async(UserFactory)()
    session = await sync_to_async(SessionFactory)(owner=user)
    communicator = await connect(session, user)
    await communicator.receive_from()  # status
    for bad, reason in [
        ("not json", "not valid JSON"),
        ('{"type": "dance"}', "'type' must be one of"),
        ('{"type": "prompt"}', "needs a 'text' string"),
        ('{"type": "prompt", "text": " "}', "empty"),
    ]:
        await communicator.send_to(text_data=bad)
        error = json.loads(await communicator.receive_from())
        assert error["type"] == "error" and reason in error["detail"], error
    await communicator.send_to(bytes_data=b"\x00\x01")
    assert json.loads(await communicator.receive_from())["code"] == "bad_message"
    # Still open and working: a valid prompt is accepted.
    await communicator.send_to(text_data=json.dumps({"type": "prompt", "text": "now snowing"}))
    accepted = json.loads(await communicator.receive_from())
    assert accepted == {"type": "prompt", "text": "now snowing", "from_chunk": 0}
    await communicator.disconnect()


async def test_input_the_database_cannot_store_is_an_error_frame_and_the_socket_stays_open():
    """A NUL byte (psycopg DataError), a lone surrogate (UnicodeEncodeError) and 100,000 nested "["
    (RecursionError) used to drop the socket without a close frame."""
    user = await sync_to_async(UserFactory)()
    session = await sync_to_async(SessionFactory)(owner=user)
    communicator = await connect(session, user)
    await communicator.receive_from()  # status
    for bad, code, reason in [
        (json.dumps({"type": "prompt", "text": "snow\x00fall"}), "rejected", "NUL"),
        ('{"type": "prompt", "text": "snow \\ud800 fall"}', "rejected", "lone surrogate"),
        ("[" * 10_000, "bad_message", "nested too deeply"),
        ("[" * 100_000, "bad_message", "at most"),
        (json.dumps({"type": "prompt", "text": "x" * 20_000}), "bad_message", "at most"),
        ('{"type": "pause", "extra": [[1]]}', "bad_message", "flat object"),
    ]:
        await communicator.send_to(text_data=bad)
        error = json.loads(await communicator.receive_from())
        assert error["type"] == "error" and error["code"] == code and reason in error["detail"], error
    await communicator.send_to(text_data=json.dumps({"type": "prompt", "text": "now snowing"}))
    accepted = json.loads(await communicator.receive_from())
    assert accepted == {"type": "prompt", "text": "now snowing", "from_chunk": 0}
    texts = await sync_to_async(lambda: list(session.prompts.values_list("text", flat=True)))()
    assert "now snowing" in texts and not any("\x00" in t for t in texts)
    await communicator.disconnect()


async def test_other_users_and_anonymous_are_refused_with_a_reason():
    owner, other = await sync_to_async(UserFactory)(), await sync_to_async(UserFactory)()
    session = await sync_to_async(SessionFactory)(owner=owner)
    from django.contrib.auth.models import AnonymousUser

    for user, code in [(other, "not_found"), (AnonymousUser(), "not_authenticated")]:
        communicator = WebsocketCommunicator(application, f"/ws/sessions/{session.pk}/")
        communicator.scope["user"] = user
        await communicator.connect()
        assert json.loads(await communicator.receive_from())["code"] == code
        closed = await communicator.receive_output()
        assert closed["type"] == "websocket.close" and closed["code"] in (4404, 4401)


async def test_a_slow_client_drops_the_oldest_chunks_not_the_worker(monkeypatch):
    monkeypatch.setattr(consumers, "MAX_PENDING_CHUNKS", 3)
    user = await sync_to_async(UserFactory)()
    session = await sync_to_async(SessionFactory)(owner=user)
    consumer = consumers.SessionConsumer()
    consumer.session_id = str(session.pk)
    consumer.outbox = __import__("collections").deque()
    consumer.pending_chunks = 0
    consumer.wakeup = __import__("asyncio").Event()
    # Nothing drains the outbox (a socket that does not read): the buffer stays bounded.
    for index in range(10):
        await consumer.session_chunk(a_chunk(session, index))
    kept = [payload[0]["index"] for kind, payload in consumer.outbox if kind == "chunk"]
    skipped = [json.loads(payload)["index"] for kind, payload in consumer.outbox if kind == "text"]
    assert kept == [7, 8, 9]
    assert skipped == [0, 1, 2, 3, 4, 5, 6]
    assert consumer.pending_chunks == 3
