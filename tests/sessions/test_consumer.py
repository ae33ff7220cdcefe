"""The session WebSocket consumer against the real Redis channel layer (one consumer at a time)."""

from __future__ import annotations

import json

import pytest
import redis
from asgiref.sync import sync_to_async
from channels.layers import get_channel_layer
from channels.testing import WebsocketCommunicator
from django.conf import settings

from contracts.wire.frames import chunk_message, decode_chunk_frame, group_name
from contracts.wire.records import INGEST_LOCK, STREAM
from sessions import consumers, services
from sessions.ingest import chunk_records_drain
from sessions.models import ChunkRecord
from tests.factories import SessionFactory, UserFactory
from tests.sessions.sockets import communicator_as, connect_as

pytestmark = [
    pytest.mark.django_db(transaction=True),
    pytest.mark.asyncio,
    pytest.mark.usefixtures("close_thread_connections"),
]


async def connect(session, user) -> WebsocketCommunicator:
    """A JPEG viewer (the socket's default is H.264: these tests send small fake JPEG chunks)."""
    return await connect_as(user, f"/ws/sessions/{session.pk}/?codec=jpeg")


def a_chunk(session, index: int, epoch: int = 1, worker: str = "w1") -> dict:
    header = {
        "session": str(session.pk),
        "index": index,
        "epoch": epoch,
        "generation_ms": 12.5,
        "worker": worker,
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


async def test_commands_for_a_terminated_session_are_rejected_with_the_reason():
    user = await sync_to_async(UserFactory)()
    session = await sync_to_async(SessionFactory)(owner=user)
    await sync_to_async(services.session_terminate)(session=session)
    communicator = await connect(session, user)
    assert json.loads(await communicator.receive_from())["status"] == "terminated"
    for command in ({"type": "pause"}, {"type": "resume"}, {"type": "prompt", "text": "too late"}):
        await communicator.send_to(text_data=json.dumps(command))
        error = json.loads(await communicator.receive_from())
        assert error == {
            "type": "error",
            "code": "rejected",
            "detail": "the session is terminated; start a new session",
        }, command
    await communicator.disconnect()


async def test_other_users_and_anonymous_are_refused_with_a_reason():
    owner, other = await sync_to_async(UserFactory)(), await sync_to_async(UserFactory)()
    session = await sync_to_async(SessionFactory)(owner=owner)
    from django.contrib.auth.models import AnonymousUser

    for user, code in [(other, "not_found"), (AnonymousUser(), "not_authenticated")]:
        communicator = communicator_as(user, f"/ws/sessions/{session.pk}/")
        await communicator.connect()
        assert json.loads(await communicator.receive_from())["code"] == code
        closed = await communicator.receive_output()
        assert closed["type"] == "websocket.close" and closed["code"] in (4404, 4401)


async def test_a_slow_client_drops_the_oldest_chunks_not_the_worker(monkeypatch):
    monkeypatch.setattr(consumers, "MAX_PENDING_CHUNKS", 3)
    user = await sync_to_async(UserFactory)()
    session = await sync_to_async(SessionFactory)(owner=user)
    consumer = consumers.SessionConsumer()
    consumer.session_id, consumer.codec = str(session.pk), "jpeg"
    consumer.outbox = __import__("collections").deque()
    consumer.pending_chunks = 0
    consumer.position = consumers.StreamPosition()
    consumer.wakeup = __import__("asyncio").Event()
    # Nothing drains the outbox (a socket that does not read): the buffer stays bounded.
    for index in range(10):
        await consumer.session_chunk(a_chunk(session, index))
    kept = [payload[0]["index"] for kind, payload in consumer.outbox if kind == "chunk"]
    skipped = [json.loads(payload)["index"] for kind, payload in consumer.outbox if kind == "text"]
    assert kept == [7, 8, 9]
    assert skipped == [0, 1, 2, 3, 4, 5, 6]
    assert consumer.pending_chunks == 3


async def test_a_stale_owner_and_repeated_indices_never_reach_the_client():
    """Issue 17, defect 1: a worker frozen past its heartbeat timeout woke up and went on under
    its old epoch while the new owner streamed the same indices (148 chunks for 102 indices)."""
    position = consumers.StreamPosition()
    # (index, epoch) as the channel layer delivered them: the old owner before the freeze, the
    # new owner resuming after the last delivered index, the old owner waking up, the new owner.
    arrivals = [(15, 1), (16, 1), (17, 3), (18, 3), (17, 1), (18, 1), (19, 1), (19, 3), (20, 3)]
    admitted = [(i, e) for i, e in arrivals if position.admit({"index": i, "epoch": e})]
    assert admitted == [(15, 1), (16, 1), (17, 3), (18, 3), (19, 3), (20, 3)]


async def test_a_copy_from_a_newer_owner_is_dropped_but_fences_the_older_one():
    """Defect 2's other order: the old owner's late chunk 17 arrives first, then the new owner's
    copy of 17. The copy is dropped, and from then on the old owner's chunks are stale."""
    position = consumers.StreamPosition()
    arrivals = [(16, 1), (17, 1), (17, 3), (18, 1), (18, 3)]
    admitted = [(i, e) for i, e in arrivals if position.admit({"index": i, "epoch": e})]
    assert admitted == [(16, 1), (17, 1), (18, 3)]


async def test_the_socket_receives_each_index_once_from_the_current_owner():
    user = await sync_to_async(UserFactory)()
    session = await sync_to_async(SessionFactory)(owner=user)
    communicator = await connect(session, user)
    await communicator.receive_from()  # status
    layer, group = get_channel_layer(), group_name(str(session.pk))
    for index, epoch, worker in [(0, 1, "old"), (1, 2, "new"), (1, 1, "old"), (2, 1, "old"), (2, 2, "new")]:
        await layer.group_send(group, a_chunk(session, index, epoch, worker))
    received = [decode_chunk_frame(await communicator.receive_from())[0] for _ in range(3)]
    assert [(h["index"], h["worker"]) for h in received] == [(0, "old"), (1, "new"), (2, "new")]
    assert await communicator.receive_nothing(timeout=0.3)
    await communicator.disconnect()


async def test_measured_deliveries_go_to_the_record_stream_and_land_without_a_record():
    """Issue 17, defect 8: a delivery measured before the chunk's record was written was dropped
    (an UPDATE that matched no row). Now it travels on the record stream as a full row."""
    client = redis.Redis.from_url(settings.REDIS_URL)
    client.delete(STREAM, INGEST_LOCK)
    user = await sync_to_async(UserFactory)()
    session = await sync_to_async(SessionFactory)(owner=user)
    communicator = await connect(session, user)
    await communicator.receive_from()  # status
    await get_channel_layer().group_send(group_name(str(session.pk)), a_chunk(session, 4))
    header, _ = decode_chunk_frame(await communicator.receive_from())
    await communicator.disconnect()  # flushes the measured deliveries
    # No worker record was ever written for chunk 4: the ingester stores it from the delivery.
    await sync_to_async(chunk_records_drain)(client=client)
    record = await sync_to_async(ChunkRecord.objects.get)(session=session, chunk_index=4)
    assert record.delivery_ms == pytest.approx(header["delivery_ms"])
    assert (record.generation_ms, record.batch_size) == (12.5, 1)
    client.delete(STREAM, INGEST_LOCK)


# --- the codec a viewer reads (docs/media.md) ------------------------------------------------------


def an_h264_chunk(session, index: int, encoder) -> dict:
    """Chunk ``index`` as the worker publishes it for H.264 viewers: JPEG frames only if asked."""
    import numpy as np

    frames = np.full((4, 64, 64, 3), 40 * index % 255, np.uint8)
    fragment = encoder.encode(frames, fps=8, chunk_index=index)
    message = a_chunk(session, index)
    message["frames"] = []
    message["media"] = {
        "init": fragment.init,
        "fragment": fragment.data,
        "mime": fragment.mime,
        "encoder": "libx264",
    }
    return message


async def test_an_h264_viewer_gets_the_init_segment_once_then_fragments_that_decode_and_asks_for_the_codec():
    from contracts.wire.codecs import codecs_wanted_many
    from workers.runtime.media import FragmentEncoder, decode_fragments

    user = await sync_to_async(UserFactory)()
    session = await sync_to_async(SessionFactory)(owner=user)
    communicator = await connect_as(user, f"/ws/sessions/{session.pk}/?codec=h264")
    await communicator.receive_from()  # status
    client = redis.Redis.from_url(settings.REDIS_URL)
    # The worker will read that this session has an H.264 viewer
    assert codecs_wanted_many(client, [str(session.pk)])[str(session.pk)] == {"h264"}
    layer, encoder = get_channel_layer(), FragmentEncoder()
    # A chunk made before the codec reached the worker has no fragment: not sent to this viewer
    await layer.group_send(group_name(str(session.pk)), a_chunk(session, 0))
    for index in (1, 2, 3):
        await layer.group_send(group_name(str(session.pk)), an_h264_chunk(session, index, encoder))
    received = [decode_chunk_frame(await communicator.receive_from()) for _ in range(3)]
    headers = [header for header, _ in received]
    assert [(h["index"], h["codec"], h["init"]) for h in headers] == [
        (1, "h264", True),
        (2, "h264", False),
        (3, "h264", False),
    ]
    assert headers[0]["mime"].startswith('video/mp4; codecs="avc1.')
    init, first = received[0][1]
    frames, pts = decode_fragments(init, [first, received[1][1][0], received[2][1][0]])
    assert frames.shape == (12, 64, 64, 3) and pts == list(range(4, 16))
    await communicator.disconnect()
    client.delete(f"ss:codecs:{session.pk}")


@pytest.mark.parametrize("query", ["", "?codec=vp9"])
async def test_no_codec_means_h264_and_an_unknown_one_is_an_error_frame_naming_the_accepted_ones(query):
    from contracts.wire.codecs import codecs_wanted_many
    from workers.runtime.media import FragmentEncoder

    user = await sync_to_async(UserFactory)()
    session = await sync_to_async(SessionFactory)(owner=user)
    communicator = await connect_as(user, f"/ws/sessions/{session.pk}/{query}")
    assert json.loads(await communicator.receive_from())["type"] == "status"
    if query:
        error = json.loads(await communicator.receive_from())
        assert error["code"] == "bad_codec" and "'vp9'" in error["detail"]
        assert "h264, jpeg" in error["detail"] and "(sending h264)" in error["detail"]
    # The socket stays open on the default: it asks the worker for H.264 and is sent fragments only
    client = redis.Redis.from_url(settings.REDIS_URL)
    assert codecs_wanted_many(client, [str(session.pk)])[str(session.pk)] == {"h264"}
    layer = get_channel_layer()
    await layer.group_send(group_name(str(session.pk)), a_chunk(session, 0))  # JPEG only: not for it
    await layer.group_send(group_name(str(session.pk)), an_h264_chunk(session, 1, FragmentEncoder()))
    header, payloads = decode_chunk_frame(await communicator.receive_from())
    assert (header["index"], header["codec"], header["init"], len(payloads)) == (1, "h264", True, 2)
    assert await communicator.receive_nothing(timeout=0.2)
    await communicator.disconnect()
    client.delete(f"ss:codecs:{session.pk}")


async def test_a_jpeg_viewer_beside_an_h264_one_asks_for_jpeg_and_gets_no_chunk_without_frames():
    from contracts.wire.codecs import codec_want, codecs_wanted_many
    from workers.runtime.media import FragmentEncoder

    # Given a session whose H.264 viewer just left (its lease lingers for a reconnect), as when a
    # page falls back from H.264 to JPEG
    user = await sync_to_async(UserFactory)()
    session = await sync_to_async(SessionFactory)(owner=user)
    client = redis.Redis.from_url(settings.REDIS_URL)
    codec_want(client, str(session.pk), "h264", "the-page-before")

    # When the page reconnects as a JPEG viewer
    communicator = await connect_as(user, f"/ws/sessions/{session.pk}/?codec=jpeg")
    assert json.loads(await communicator.receive_from())["type"] == "status"

    # Then the worker reads that JPEG is wanted too, not only the lingering H.264
    assert codecs_wanted_many(client, [str(session.pk)])[str(session.pk)] == {"h264", "jpeg"}
    # and a chunk encoded before that reached the worker (H.264 only) is not sent as an empty chunk
    layer = get_channel_layer()
    await layer.group_send(group_name(str(session.pk)), an_h264_chunk(session, 0, FragmentEncoder()))
    await layer.group_send(group_name(str(session.pk)), a_chunk(session, 1))
    header, frames = decode_chunk_frame(await communicator.receive_from())
    assert (header["index"], header["mime"], len(frames)) == (1, "image/jpeg", 2)
    # once its stream has begun, a chunk it cannot show is reported as skipped
    await layer.group_send(group_name(str(session.pk)), an_h264_chunk(session, 2, FragmentEncoder()))
    assert json.loads(await communicator.receive_from()) == {"type": "skipped", "index": 2}
    await communicator.disconnect()
    client.delete(f"ss:codecs:{session.pk}")


# --- payloads beside the message (contracts.wire.frames, sessions.payloads) ------------------------


def a_large_chunk(session, index: int, *, store) -> dict:
    from contracts.wire.frames import PAYLOAD_INLINE_MAX_BYTES, chunk_message_offloaded

    message = a_chunk(session, index)
    frames = [b"\xff\xd8" + bytes([index]) * PAYLOAD_INLINE_MAX_BYTES, b"\xff\xd8second"]
    return chunk_message_offloaded(message["header"], frames, store=store)


async def test_a_large_chunk_is_read_from_its_key_and_an_expired_one_is_skipped():
    from contracts.wire.frames import PAYLOAD_TTL_S

    user = await sync_to_async(UserFactory)()
    session = await sync_to_async(SessionFactory)(owner=user)
    communicator = await connect(session, user)
    await communicator.receive_from()  # status
    client = redis.Redis.from_url(settings.REDIS_URL)

    def store(payloads):
        for key, blob in payloads.items():
            client.set(key, blob, ex=PAYLOAD_TTL_S)

    # Given chunk 0 whose payload waits in Redis, and chunk 1 whose key is gone (expired)
    first = a_large_chunk(session, 0, store=store)
    second = a_large_chunk(session, 1, store=store)
    assert first["frames"] == [] and "frames_ref" in first
    client.delete(second["frames_ref"]["key"])
    layer = get_channel_layer()
    await layer.group_send(group_name(str(session.pk)), first)
    await layer.group_send(group_name(str(session.pk)), second)

    # Then the viewer gets chunk 0's frames as they were, and is told chunk 1 was skipped
    header, frames = decode_chunk_frame(await communicator.receive_from())
    assert header["index"] == 0 and frames[1] == b"\xff\xd8second" and len(frames[0]) > 16_000
    assert json.loads(await communicator.receive_from()) == {"type": "skipped", "index": 1}
    await communicator.disconnect()
    client.delete(first["frames_ref"]["key"])


async def test_an_h264_viewer_whose_first_fragment_expired_gets_the_init_segment_with_the_next():
    from contracts.wire.frames import PAYLOAD_INLINE_MAX_BYTES

    user = await sync_to_async(UserFactory)()
    session = await sync_to_async(SessionFactory)(owner=user)
    communicator = await connect_as(user, f"/ws/sessions/{session.pk}/?codec=h264")
    await communicator.receive_from()  # status
    client = redis.Redis.from_url(settings.REDIS_URL)
    layer = get_channel_layer()
    # Given chunk 1's fragment referenced but expired, chunk 2's inline
    expired = a_chunk(session, 1)
    expired["frames"] = []
    expired["media"] = {
        "init": b"init-segment",
        "mime": "video/mp4",
        "encoder": "libx264",
        "fragment_ref": {
            "key": f"chunk-payload:{session.pk}:1:1:h264",
            "sizes": [PAYLOAD_INLINE_MAX_BYTES + 1],
        },
    }
    inline = a_chunk(session, 2)
    inline["frames"] = []
    inline["media"] = {
        "init": b"init-segment",
        "fragment": b"moof2",
        "mime": "video/mp4",
        "encoder": "libx264",
    }
    await layer.group_send(group_name(str(session.pk)), expired)
    await layer.group_send(group_name(str(session.pk)), inline)

    # Then chunk 1 is skipped, and chunk 2 carries the init segment the viewer never received
    assert json.loads(await communicator.receive_from()) == {"type": "skipped", "index": 1}
    header, payloads = decode_chunk_frame(await communicator.receive_from())
    assert (header["index"], header["init"], payloads) == (2, True, [b"init-segment", b"moof2"])
    await communicator.disconnect()
    client.delete(f"ss:codecs:{session.pk}")
