"""The platform serving `demo` as `make run` does: the video follows the prompt, and a new prompt typed
mid-stream changes it from the chunk the server names (real processes: ASGI server, Celery, a worker)."""

from __future__ import annotations

import asyncio
import io
import json
import time

import httpx
import numpy as np
import pytest
import websockets
from PIL import Image

from contracts.wire.frames import decode_chunk_frame
from workers.runtime.models.demo_eval import measure_clip

pytestmark = [pytest.mark.e2e, pytest.mark.slow, pytest.mark.django_db]

FIRST = "a red circle moving right on a blue background"
SECOND = "a yellow triangle moving down on a black background"


async def watch(url: str, *, before: int, after: int, timeout: float) -> tuple[list, dict]:
    """Every chunk received (index, frames), and the server's acknowledgement of the new prompt typed
    after `before` chunks; stops once `after` chunks show the new prompt's colour."""
    chunks, ack = [], {}
    deadline = time.monotonic() + timeout
    async with websockets.connect(url, max_size=None) as ws:
        while time.monotonic() < deadline:
            message = await asyncio.wait_for(ws.recv(), timeout=max(0.1, deadline - time.monotonic()))
            if isinstance(message, str):
                text = json.loads(message)
                if text.get("type") == "prompt":
                    ack = text
                continue
            header, frames = decode_chunk_frame(message)
            rgb = np.stack([np.asarray(Image.open(io.BytesIO(f))) for f in frames])
            chunks.append((header["index"], rgb))
            if len(chunks) == before:
                await ws.send(json.dumps({"type": "prompt", "text": SECOND}))
            if sum(measure_clip(c)["colour"] == "yellow" for _, c in chunks) >= after:
                break
    return chunks, ack


def test_demo_is_served_by_default_and_follows_a_prompt_typed_mid_stream(demo_platform):
    platform, token = demo_platform
    with httpx.Client(
        base_url=platform.url, headers={"Authorization": f"Token {token}"}, timeout=30
    ) as client:
        response = client.post("/api/sessions/", json={"prompt": FIRST, "seed": 5})  # no model: the default
        assert response.status_code == 201, response.text
        body = response.json()
    assert (body["model"], body["resolution"]) == ("demo", "128x128")
    url = (
        f"{platform.ws_url}/ws/sessions/{body['id']}/?token={token}&codec=jpeg"  # reads its frames as images
    )
    chunks, ack = asyncio.run(watch(url, before=3, after=3, timeout=120))
    indices = [i for i, _ in chunks]
    assert indices == list(range(indices[0], indices[0] + len(indices))), platform.logs()
    # Each chunk shows one prompt: the first up to the switch, the new one from it on (the worker
    # applies it at the acknowledged chunk, or at its next one when it is already past it)
    colours = [measure_clip(rgb)["colour"] for _, rgb in chunks]
    switch = colours.index("yellow")
    assert colours == ["red"] * switch + ["yellow"] * (len(colours) - switch), colours
    assert switch >= 3 and indices[switch] >= ack["from_chunk"]
    # JPEG blurs edges a little; the measurement reads colour, shape and motion all the same
    assert measure_clip(np.concatenate([rgb for _, rgb in chunks[:switch]])) == {
        "background": "blue", "colour": "red", "shape": "circle", "direction": "right", "speed": "slow"
    }  # fmt: skip
    assert measure_clip(np.concatenate([rgb for _, rgb in chunks[switch:]])) == {
        "background": "black", "colour": "yellow", "shape": "triangle", "direction": "down", "speed": "slow"
    }  # fmt: skip
