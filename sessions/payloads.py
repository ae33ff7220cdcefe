"""Chunk payloads that travel beside their channel-layer message (``contracts.wire.frames``:
``chunk_message_offloaded``), read by the socket that is about to send them.

Read at send time, not on arrival: a chunk that a slow socket's outbox drops is never read, so a web
process behind its sockets pulls no bytes it will not send. One client per event loop (uvicorn runs
one; tests run one per test) with a bounded, blocking pool: 200 sockets draining at once share a few
connections instead of opening 200.
"""

from __future__ import annotations

import asyncio
import logging
import weakref

import redis
import redis.asyncio as aioredis
from django.conf import settings

from contracts.wire.frames import payload_split

logger = logging.getLogger(__name__)

POOL_CONNECTIONS = 16
_clients: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, aioredis.Redis] = weakref.WeakKeyDictionary()


def _client() -> aioredis.Redis:
    loop = asyncio.get_running_loop()
    client = _clients.get(loop)
    if client is None:
        pool = aioredis.BlockingConnectionPool.from_url(
            settings.REDIS_URL, max_connections=POOL_CONNECTIONS, timeout=5
        )
        client = _clients[loop] = aioredis.Redis(connection_pool=pool)
    return client


async def payload_read(ref: dict) -> list[bytes] | None:
    """The payloads ``ref`` (``{"key", "sizes"}``) points at, or ``None`` when they cannot be read
    (the key expired: the socket was more than ``PAYLOAD_TTL_S`` behind; or Redis is away). The
    caller tells its viewer the chunk was skipped."""
    try:
        blob = await _client().get(ref["key"])
    except (redis.RedisError, OSError) as exc:
        logger.warning("chunk payload unreadable key=%s: %s", ref["key"], exc)
        return None
    if blob is None:
        logger.warning("chunk payload expired key=%s", ref["key"])
        return None
    return payload_split(blob, ref["sizes"])
