"""The consumer fix ``bench_delivery`` compares: ``--asgi-app sessions.benchmarks.fixed_dispatch:application``.

The deployed ASGI application with ``SessionConsumer.dispatch`` handling ``session.chunk`` directly.
Channels' ``AsyncConsumer.dispatch`` awaits ``aclose_old_connections()`` (``close_old_connections``
through ``sync_to_async`` on the process's single thread-sensitive executor) before *every* handler,
so each chunk queues behind the consumers' database work; the chunk handler touches no database.
Only the benchmark's uvicorn imports this module (importing it patches the consumer class).
"""

from __future__ import annotations

from contracts.wire.frames import CHUNK_MESSAGE
from controlplane.asgi import application
from sessions.consumers import SessionConsumer

__all__ = ["application"]

_deployed_dispatch = SessionConsumer.dispatch


async def _dispatch(self: SessionConsumer, message: dict) -> None:
    if message.get("type") == CHUNK_MESSAGE:
        await self.session_chunk(message)
        return
    await _deployed_dispatch(self, message)


SessionConsumer.dispatch = _dispatch
