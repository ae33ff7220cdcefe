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
