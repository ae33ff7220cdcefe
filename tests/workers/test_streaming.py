"""The chunk wire format: one group per session, namespaced message types, a binary frame per chunk."""

from __future__ import annotations

import pytest

from contracts.wire.frames import (
    CHUNK_MESSAGE,
    STATUS_MESSAGE,
    chunk_message,
    decode_chunk_frame,
    encode_chunk_frame,
    group_name,
    status_message,
)


def test_messages_name_the_session_group_and_the_consumer_handlers():
    assert group_name("1234") == "session.1234"
    assert chunk_message({"index": 3}, [b"a"]) == {
        "type": CHUNK_MESSAGE,
        "header": {"index": 3},
        "frames": [b"a"],
    }
    assert status_message({"status": "queued"}) == {"type": STATUS_MESSAGE, "status": "queued"}
    # Channels dispatches `a.b` to the consumer method `a_b`.
    assert (CHUNK_MESSAGE, STATUS_MESSAGE) == ("session.chunk", "session.status")


def test_a_chunk_frame_round_trips_its_header_and_frames():
    header, frames = decode_chunk_frame(encode_chunk_frame({"index": 7}, [b"\xff\xd8one", b"", b"three"]))
    assert header == {"index": 7, "type": "chunk", "frames": [5, 0, 5]}
    assert frames == [b"\xff\xd8one", b"", b"three"]


def test_a_truncated_frame_is_refused():
    wire = encode_chunk_frame({"index": 1}, [b"abcdef"])
    with pytest.raises(ValueError, match="does not match"):
        decode_chunk_frame(wire[:-1])
    with pytest.raises(ValueError, match="shorter"):
        decode_chunk_frame(wire[:2])


# --- large payloads beside the message (contracts.wire.frames.chunk_message_offloaded) ----------


def test_a_small_chunk_stays_inline_and_stores_nothing():
    from contracts.wire.frames import chunk_message_offloaded

    stored = []
    header = {"session": "s", "epoch": 2, "index": 5}
    message = chunk_message_offloaded(header, [b"\xff\xd8tiny"], store=stored.append)
    assert message == chunk_message(header, [b"\xff\xd8tiny"]) and stored == []


def test_a_large_chunk_travels_by_reference_per_codec_and_splits_back():
    from contracts.wire.frames import (
        PAYLOAD_INLINE_MAX_BYTES,
        chunk_has_jpeg,
        chunk_message_offloaded,
        payload_split,
    )

    stored = []
    header = {"session": "s", "epoch": 2, "index": 5}
    frames = [bytes([i]) * (PAYLOAD_INLINE_MAX_BYTES // 2 + 1) for i in range(3)]
    fragment = b"\x00" * (PAYLOAD_INLINE_MAX_BYTES + 1)
    media = {"init": b"moov", "fragment": fragment, "mime": "video/mp4", "encoder": "libx264"}
    message = chunk_message_offloaded(header, frames, media=media, store=stored.append)
    # One store call, before sending, one key per codec: the message holds only references
    assert len(stored) == 1 and sorted(stored[0]) == ["chunk-payload:s:2:5:h264", "chunk-payload:s:2:5:jpeg"]
    assert message["frames"] == [] and chunk_has_jpeg(message)
    assert "fragment" not in message["media"] and message["media"]["init"] == b"moov"
    ref = message["frames_ref"]
    assert payload_split(stored[0][ref["key"]], ref["sizes"]) == frames
    assert stored[0][message["media"]["fragment_ref"]["key"]] == fragment
    with pytest.raises(ValueError, match="reference says"):
        payload_split(b"short", ref["sizes"])
