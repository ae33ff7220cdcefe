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
from django.core.management import call_command
from PIL import Image
from rest_framework.authtoken.models import Token

from tests.e2e.conftest import Platform
from tests.factories import UserFactory
from workers.runtime.models.demo_eval import measure_clip
from workers.streaming import decode_chunk_frame

pytestmark = [pytest.mark.e2e, pytest.mark.slow, pytest.mark.django_db]

FIRST = "a red circle moving right on a blue background"
SECOND = "a yellow triangle moving down on a black background"


@pytest.fixture(scope="module")
def demo_platform(django_db_setup, django_db_blocker, tmp_path_factory):
    from scheduling.models import SchedulerConfig
    from scheduling.services import beat_schedule_install

    with django_db_blocker.unblock():
        call_command("flush", "--noinput", verbosity=0)
        beat_schedule_install(tick_s=1)
        SchedulerConfig.objects.update_or_create(pk=1, defaults={"min_gpus": 1, "max_gpus": 1})
        platform = Platform(tmp_path_factory.mktemp("demo-platform"))
        platform.env.pop("SERVED_MODELS", None)  # the deployment default, as under `make run`
        platform.start()
        try:
            token = Token.objects.create(user=UserFactory()).key
            yield platform, token
        finally:
            platform.stop()
            call_command("flush", "--noinput", verbosity=0)


async def watch(url: str, *, before: int, after: int, timeout: float) -> tuple[list, list, dict]:
    """Chunks before the prompt change, the server's acknowledgement, chunks from its chunk on."""
    early, late, ack = [], [], {}
    deadline = time.monotonic() + timeout
    async with websockets.connect(url, max_size=None) as ws:
        while time.monotonic() < deadline and len(late) < after:
            message = await asyncio.wait_for(ws.recv(), timeout=max(0.1, deadline - time.monotonic()))
            if isinstance(message, str):
                text = json.loads(message)
                if text.get("type") == "prompt":
                    ack = text
                continue
            header, frames = decode_chunk_frame(message)
            rgb = np.stack([np.asarray(Image.open(io.BytesIO(f))) for f in frames])
            if not ack:
                early.append((header["index"], rgb))
                if len(early) == before:
                    await ws.send(json.dumps({"type": "prompt", "text": SECOND}))
            elif header["index"] >= ack["from_chunk"]:
                late.append((header["index"], rgb))
    return early, late, ack


def test_demo_is_served_by_default_and_follows_a_prompt_typed_mid_stream(demo_platform):
    platform, token = demo_platform
    with httpx.Client(
        base_url=platform.url, headers={"Authorization": f"Token {token}"}, timeout=30
    ) as client:
        response = client.post("/api/sessions/", json={"prompt": FIRST, "seed": 5})  # no model: the default
        assert response.status_code == 201, response.text
        body = response.json()
    assert (body["model"], body["resolution"]) == ("demo", "128x128")
    url = f"{platform.ws_url}/ws/sessions/{body['id']}/?token={token}"
    early, late, ack = asyncio.run(watch(url, before=3, after=3, timeout=120))
    assert len(early) == 3 and len(late) == 3, platform.logs()
    # JPEG blurs edges a little; the measurement reads colour, shape and motion all the same
    assert measure_clip(np.concatenate([rgb for _, rgb in early])) == {
        "background": "blue", "colour": "red", "shape": "circle", "direction": "right", "speed": "slow"
    }  # fmt: skip
    assert [i for i, _ in late] == list(range(ack["from_chunk"], ack["from_chunk"] + 3))
    assert measure_clip(np.concatenate([rgb for _, rgb in late])) == {
        "background": "black", "colour": "yellow", "shape": "triangle", "direction": "down", "speed": "slow"
    }  # fmt: skip
