"""The deployed ASGI application plus a probe of the channel layer's in-process queues, for ``soak
--trace-queues DIR``: whether the web process's memory growth is messages waiting in
``channels_redis``'s pub/sub layer.

That layer (``RedisPubSubChannelLayer``) gives each consumer's channel an unbounded
``asyncio.Queue`` in the web process: a message published to a session's group is put, once per
consumer of that group here, into each one's queue, and stays there until the consumer's receive
loop takes it (Channels dispatches one message at a time per consumer). Every ``EVERY_S`` the probe
writes one line to ``$BENCH_LAYER_QUEUES_DIR/queues.jsonl``: the process's RSS, how many channels
and groups the layer holds, and how many messages wait in their queues (total, the longest, and
the bytes of those messages as they were received), so a run shows whether the queues grow with
the RSS or stay near empty. Only the benchmark's uvicorn imports this module.
"""

from __future__ import annotations

import asyncio
import json
import os
import time
from pathlib import Path

import psutil
from channels.layers import get_channel_layer

from controlplane.asgi import application as deployed

__all__ = ["application"]

EVERY_S = 5.0
_writer: asyncio.Task | None = None


def queue_figures() -> dict:
    """The layer's channels and groups in this process and what waits in their queues."""
    layer = get_channel_layer()
    inner = layer._get_layer() if hasattr(layer, "_get_layer") else layer  # pubsub: per-loop layer
    channels = getattr(inner, "channels", {}) or {}
    sizes = [queue.qsize() for queue in channels.values() if hasattr(queue, "qsize")]
    # The bytes waiting: the raw (still serialized) messages in each queue.
    waiting = sum(
        len(item)
        for queue in channels.values()
        for item in getattr(queue, "_queue", ())
        if isinstance(item, bytes)
    )
    return {
        "channels": len(channels),
        "groups": len(getattr(inner, "groups", {}) or {}),
        "queued": sum(sizes),
        "queued_max": max(sizes, default=0),
        "queued_mb": waiting / 2**20,
    }


async def _probe(folder: Path) -> None:
    began, process = time.monotonic(), psutil.Process()
    while True:
        await asyncio.sleep(EVERY_S)
        line = {
            "at_s": round(time.monotonic() - began, 1),
            "rss_mb": process.memory_info().rss / 2**20,
            **queue_figures(),
        }
        with (folder / "queues.jsonl").open("a", encoding="utf-8") as out:
            out.write(json.dumps(line) + "\n")


async def application(scope, receive, send):
    global _writer
    folder = os.environ.get("BENCH_LAYER_QUEUES_DIR")
    if _writer is None and folder:
        _writer = asyncio.get_running_loop().create_task(_probe(Path(folder)))
    await deployed(scope, receive, send)
