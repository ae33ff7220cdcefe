"""vLLM-Omni's realtime video messages, read and written (sessions/realtime/protocol.py): no
sockets, no database."""

from __future__ import annotations

import json

import pytest

from sessions.realtime import protocol
from sessions.realtime.protocol import EventLedger, Interaction, Ping, ProtocolError, Start, Stop


def test_a_start_as_the_example_client_sends_it():
    message = protocol.parse(
        json.dumps(
            {
                "type": "session.start",
                "model": "demo",
                "prompt": "a red circle moving left",
                "format": "m4s",
                "width": 128,
                "height": 128,
                "fps": 8,
                "num_frames": 20,
                "seed": 42,
                "num_inference_steps": 4,
                "extra_params": {"pyramid_num_inference_steps_list": [1, 1, 1]},
            }
        )
    )
    assert message == Start(
        model="demo",
        prompt="a red circle moving left",
        width=128,
        height=128,
        fps=8,
        num_frames=20,
        seed=42,
        ignored=("extra_params", "num_inference_steps"),
    )
    assert message.resolution == "128x128"


def test_an_interaction_a_stop_and_a_ping():
    text = {"type": "session.interaction", "interaction": {"event_id": "e1", "event": {"prompt": "blue"}}}
    assert protocol.parse(json.dumps(text)) == Interaction(prompt="blue", event_id="e1")
    text["interaction"]["transition_chunks"] = 3
    assert protocol.parse(json.dumps(text)).transition_chunks == 3
    assert protocol.parse('{"type": "session.stop"}') == Stop()
    assert protocol.parse('{"type": "session.ping"}') == Ping()


@pytest.mark.parametrize(
    ("text", "reason"),
    [
        (None, "JSON text frames"),
        ("{", "invalid JSON"),
        ("[" * 100_000, "at most"),
        ("[1]", "JSON object"),
        ('{"type": "session.begin"}', "unknown message type 'session.begin'"),
        ('{"type": "session.start", "model": "demo"}', "non-empty 'prompt'"),
        ('{"type": "session.start", "prompt": "x", "format": "mp4"}', "unsupported format 'mp4'"),
        ('{"type": "session.start", "prompt": "x", "width": 128}', "both width and height"),
        ('{"type": "session.start", "prompt": "x", "num_frames": 0}', "num_frames must be at least 1"),
        ('{"type": "session.start", "prompt": "x", "seed": "7"}', "seed must be an integer"),
        ('{"type": "session.start", "prompt": "x", "fps": true}', "fps must be an integer"),
        ('{"type": "session.interaction"}', "'interaction' object"),
        ('{"type": "session.interaction", "interaction": {"event": {}}}', "event.prompt"),
        (
            '{"type": "session.interaction", "interaction": {"event": {"prompt": "x"}, "event_id": 5}}',
            "event_id must be a string",
        ),
        (
            '{"type": "session.interaction", "interaction": {"event": {"prompt": "x"}, "transition_chunks": -1}}',
            "transition_chunks must be at least 0",
        ),
    ],
)
def test_a_malformed_message_is_refused_with_its_reason(text, reason):
    with pytest.raises(ProtocolError, match=reason):
        protocol.parse(text)


def test_num_frames_is_rounded_up_to_whole_chunks():
    assert protocol.chunks_for(None, 4) is None
    assert [protocol.chunks_for(n, 4) for n in (1, 4, 5, 8, 9)] == [1, 1, 2, 2, 3]


def test_an_event_is_reported_in_the_chunk_it_applies_from_and_only_there():
    ledger = EventLedger()
    ledger.queue("a", from_chunk=3)
    ledger.queue("b", from_chunk=5)
    assert [ledger.at(index) for index in range(2, 7)] == [[], ["a"], [], ["b"], []]
    # A chunk index skipped by the stream (a slow client's dropped chunk) still reports the event.
    ledger.queue("c", from_chunk=8)
    assert ledger.at(9) == ["c"]


def test_server_frames_carry_the_documented_fields():
    metadata = json.loads(
        protocol.chunk_metadata(
            "r", transport_index=0, generation_index=4, num_frames=4, byte_length=99, events=["e"]
        )
    )
    assert metadata == {
        "type": "video.chunk_metadata",
        "request_id": "r",
        "kind": "media",
        "transport_chunk_index": 0,
        "generation_chunk_index": 4,
        "num_frames": 4,
        "byte_length": 99,
        "started_event_ids": ["e"],
        "active_event_ids": ["e"],
        "completed_event_ids": ["e"],
    }
    assert json.loads(protocol.done("r", chunks=3, stopped=True)) == {
        "type": "session.done",
        "request_id": "r",
        "chunks": 3,
        "stopped": True,
    }
    assert json.loads(protocol.video_start("r", {"fps": 8}))["format"] == "m4s"
    assert json.loads(protocol.error("bad")) == {"type": "error", "message": "bad"}
