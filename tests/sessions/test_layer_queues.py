"""The soak's probe of the channel layer's in-process queues (``soak --trace-queues``): it counts
the messages that wait in a consumer channel's queue until the channel is read."""

from __future__ import annotations

import asyncio

import pytest
from channels.layers import get_channel_layer

from sessions.benchmarks.layer_queues import queue_figures

pytestmark = pytest.mark.asyncio


async def test_messages_waiting_in_a_channel_are_counted_until_read():
    # Given a channel of this process's layer, subscribed but not being read
    layer = get_channel_layer()
    channel = await layer.new_channel()
    before = queue_figures()

    # When three messages are sent to it
    for index in range(3):
        await layer.send(channel, {"type": "session.chunk", "index": index, "payload": "x" * 1000})
    for _ in range(50):
        if queue_figures()["queued"] - before["queued"] >= 3:
            break
        await asyncio.sleep(0.05)

    # Then the probe counts them (and their bytes) as waiting
    waiting = queue_figures()
    assert waiting["queued"] - before["queued"] == 3
    assert waiting["queued_max"] >= 3 and waiting["queued_mb"] * 2**20 >= 3000
    assert waiting["channels"] >= 1

    # and once read, they wait no more
    for _ in range(3):
        await layer.receive(channel)
    assert queue_figures()["queued"] == before["queued"]
