"""vLLM-Omni's ``WS /v1/realtime/video`` against the live platform (ASGI server, Celery, a demo
worker), driven by a ``websockets`` client written from vLLM-Omni's published protocol: start,
metadata + binary pairs whose concatenation PyAV decodes, a prompt interaction the demo model's
frames follow, stop, ping/pong, the error cases, and the session in the audit like any other."""

from __future__ import annotations

import asyncio
import io
import json
import time

import av
import httpx
import numpy as np
import pytest
import websockets

from tests.e2e.conftest import wait_for
from workers.runtime.models.demo_eval import measure_clip

pytestmark = [pytest.mark.e2e, pytest.mark.slow, pytest.mark.django_db]

FIRST = "a red circle moving right on a blue background"
SECOND = "a yellow triangle moving down on a black background"


def decode(media: bytes) -> np.ndarray:
    """Every frame of a fragmented MP4 byte stream, as RGB."""
    with av.open(io.BytesIO(media), format="mp4") as container:
        return np.stack([frame.to_ndarray(format="rgb24") for frame in container.decode(video=0)])


class Client:
    """One realtime socket: JSON control frames in order, each chunk's metadata with its bytes."""

    def __init__(self, ws) -> None:
        self.ws = ws
        self.chunks: list[tuple[dict, bytes]] = []
        self.texts: list[dict] = []

    async def send(self, message: dict) -> None:
        await self.ws.send(json.dumps(message))

    async def next_text(self, timeout: float = 60.0) -> dict:
        """The next control frame; a metadata frame's binary is collected on the way."""
        while True:
            message = await asyncio.wait_for(self.ws.recv(), timeout)
            assert isinstance(message, str), "a binary frame must follow its video.chunk_metadata"
            text = json.loads(message)
            if text["type"] != "video.chunk_metadata":
                self.texts.append(text)
                return text
            body = await asyncio.wait_for(self.ws.recv(), timeout)
            assert isinstance(body, bytes) and len(body) == text["byte_length"], text
            self.chunks.append((text, body))

    async def chunks_until(self, count: int, timeout: float = 90.0) -> None:
        deadline = time.monotonic() + timeout
        while len(self.chunks) < count:
            message = await asyncio.wait_for(self.ws.recv(), max(0.1, deadline - time.monotonic()))
            text = json.loads(message)
            if text["type"] == "video.chunk_metadata":
                body = await asyncio.wait_for(self.ws.recv(), 30)
                self.chunks.append((text, body))
            else:
                self.texts.append(text)

    @property
    def media(self) -> bytes:
        return b"".join(body for _, body in self.chunks)


def connect(platform, token: str | None):
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    return websockets.connect(
        f"{platform.ws_url}/v1/realtime/video", additional_headers=headers, max_size=None
    )


def test_a_fixed_length_video_arrives_as_one_fragmented_mp4_and_the_session_is_audited(demo_platform):
    platform, token = demo_platform

    async def run() -> tuple[dict, dict, Client]:
        async with connect(platform, token) as ws:
            client = Client(ws)
            await client.send(
                {"type": "session.start", "model": "demo", "prompt": FIRST, "num_frames": 10, "seed": 3}
            )
            start = await client.next_text()
            done = await client.next_text(timeout=120)
            return start, done, client

    start, done, client = asyncio.run(run())
    assert start["type"] == "video.start" and start["format"] == "m4s", start
    config = start["config"]
    per_chunk = config["frames_per_chunk"]
    chunks = -(-10 // per_chunk)
    assert (config["model"], config["num_frames"], config["transition_chunks"]) == (
        "demo",
        chunks * per_chunk,
        0,
    )
    assert done == {
        "type": "session.done",
        "request_id": start["request_id"],
        "chunks": chunks,
        "stopped": False,
    }
    metadata = [text for text, _ in client.chunks]
    assert [m["transport_chunk_index"] for m in metadata] == list(range(chunks))
    generation = [m["generation_chunk_index"] for m in metadata]
    assert generation == list(range(generation[0], generation[0] + chunks)), generation
    assert all(m["request_id"] == start["request_id"] and m["kind"] == "media" for m in metadata)
    # The binary frames, concatenated, are one fragmented MP4 (the first starts with the init segment)
    assert client.chunks[0][1][4:8] == b"ftyp"
    frames = decode(client.media)
    assert frames.shape == (chunks * per_chunk, config["height"], config["width"], 3)
    assert measure_clip(frames)["colour"] == "red"

    # The session was an ordinary one: ended, and its chunks recorded in the audit
    session_id = start["request_id"]
    with httpx.Client(base_url=platform.url, headers={"Authorization": f"Token {token}"}, timeout=30) as api:
        session = api.get(f"/api/sessions/{session_id}/").json()
        assert session["status"] == "terminated", session
        records = wait_for(
            lambda: len(api.get(f"/api/sessions/{session_id}/chunks/").json()["results"]) >= chunks and True,
            30,
            message="the session's chunk records",
        )
        assert records


def test_a_prompt_interaction_changes_the_frames_and_stop_ping_and_errors_behave(demo_platform):
    platform, token = demo_platform

    async def run() -> tuple[Client, dict, dict, list[dict]]:
        async with connect(platform, token) as ws:
            client = Client(ws)
            errors = []
            # Errors before a session: the socket stays usable
            for bad in (
                {"type": "session.interaction", "interaction": {"event": {"prompt": "x"}}},
                {"type": "session.begin"},
                {"type": "session.start", "model": "no-such-model", "prompt": FIRST},
                {"type": "session.start", "model": "demo", "prompt": FIRST, "width": "640"},
            ):
                await client.send(bad)
                errors.append(await client.next_text())
            await client.send({"type": "session.ping"})
            pong = await client.next_text()
            # As vLLM-Omni's example client asks: 640×384 at 16 fps, whatever the model
            await client.send(
                {
                    "type": "session.start",
                    "model": "demo",
                    "prompt": FIRST,
                    "seed": 5,
                    "width": 640,
                    "height": 384,
                    "fps": 16,
                }
            )
            start = await client.next_text()
            # A second start and a malformed interaction are refused; the session goes on
            await client.send({"type": "session.start", "model": "demo", "prompt": FIRST})
            errors.append(await client.next_text())
            await client.send({"type": "session.interaction", "interaction": {"event": {}}})
            errors.append(await client.next_text())
            await client.chunks_until(3)
            await client.send(
                {
                    "type": "session.interaction",
                    "interaction": {"event_id": "turn", "event": {"prompt": SECOND}},
                }
            )
            queued = await client.next_text()
            assert queued == {
                "type": "session.interaction.queued",
                "request_id": start["request_id"],
                "event_id": "turn",
            }
            deadline = time.monotonic() + 90
            while not any("turn" in text["started_event_ids"] for text, _ in client.chunks):
                assert time.monotonic() < deadline, "the interaction never started"
                await client.chunks_until(len(client.chunks) + 1)
            await client.chunks_until(len(client.chunks) + 2)
            await client.send({"type": "session.stop"})
            done = await client.next_text()
            return client, start, {"pong": pong, "done": done}, errors

    client, start, ends, errors = asyncio.run(run())
    assert all(error["type"] == "error" and error["message"] for error in errors), errors
    reasons = [error["message"] for error in errors]
    assert "no active session" in reasons[0]
    assert "unknown message type 'session.begin'" in reasons[1]
    assert "no-such-model" in reasons[2]
    assert "width must be an integer" in reasons[3]
    assert "already running" in reasons[4]
    assert "event.prompt" in reasons[5]
    assert ends["pong"] == {"type": "session.pong"}
    config = start["config"]
    assert (config["width"], config["height"], config["fps"]) == (128, 128, 8)
    assert config["adjusted"] == {"width": [640, 128], "height": [384, 128], "fps": [16, 8]}
    assert ends["done"]["stopped"] is True and ends["done"]["chunks"] == len(client.chunks)

    # Each chunk shows one prompt: the first before the event's chunk, the second from it on
    switch = next(i for i, (text, _) in enumerate(client.chunks) if "turn" in text["started_event_ids"])
    frames = decode(client.media)
    per_chunk = start["config"]["frames_per_chunk"]
    colours = [
        measure_clip(frames[i * per_chunk : (i + 1) * per_chunk])["colour"] for i in range(len(client.chunks))
    ]
    assert colours == ["red"] * switch + ["yellow"] * (len(colours) - switch), colours


def test_a_socket_without_a_token_is_refused_with_an_error(demo_platform):
    platform, _ = demo_platform

    async def run():
        async with connect(platform, None) as ws:
            message = json.loads(await asyncio.wait_for(ws.recv(), 30))
            with pytest.raises(websockets.ConnectionClosed) as closed:
                await asyncio.wait_for(ws.recv(), 30)
            return message, closed.value.rcvd.code

    message, code = asyncio.run(run())
    assert message["type"] == "error" and "Bearer" in message["message"]
    assert code == 4401
