"""`/ws/console/`: pushes a cluster snapshot to staff every ``CONSOLE_PUSH_INTERVAL_S`` seconds.

A poll on the server side rather than a fan-out of every event: the console wants a consistent
picture at a steady rate (charts are sampled time series), the snapshot is a handful of indexed
queries, and a slow browser only ever holds one pending snapshot (we send the next one after the
previous send returned). Anonymous or non-staff connections are closed with code 4403.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging

from channels.db import database_sync_to_async
from channels.generic.websocket import AsyncJsonWebsocketConsumer
from django.conf import settings
from django.core.serializers.json import DjangoJSONEncoder

from scheduling.console import shared_snapshot

logger = logging.getLogger(__name__)

FORBIDDEN = 4403


def push_interval_s() -> float:
    return float(settings.STREAMSERVE.get("CONSOLE_PUSH_INTERVAL_S", 1.0))


class ConsoleConsumer(AsyncJsonWebsocketConsumer):
    async def connect(self):
        user = self.scope.get("user")
        if user is None or not user.is_authenticated or not user.is_staff:
            await self.close(code=FORBIDDEN)
            return
        await self.accept()
        self._pusher = asyncio.create_task(self._push_loop())

    async def disconnect(self, code):
        pusher = getattr(self, "_pusher", None)
        if pusher is not None:
            pusher.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await pusher

    async def receive_json(self, content, **kwargs):
        # The console sends nothing but an occasional {"type": "refresh"}; actions go through HTTP
        # so that they carry the CSRF check and land in the audit trail with a plain request.
        if isinstance(content, dict) and content.get("type") == "refresh":
            await self._push_once(fresh=True)
        else:
            await self.send_json(
                {"type": "error", "code": "bad_message", "detail": "only refresh is accepted"}
            )

    @classmethod
    async def encode_json(cls, content):
        return json.dumps(content, cls=DjangoJSONEncoder)

    async def _push_once(self, *, fresh: bool = False):
        # Periodic pushes share one snapshot per interval among all open consoles (the cache);
        # a refresh after an operator's action computes a new one.
        snapshot = await database_sync_to_async(shared_snapshot)(max_age_s=push_interval_s(), fresh=fresh)
        await self.send_json({"type": "snapshot", "snapshot": snapshot})

    async def _push_loop(self):
        interval = push_interval_s()
        while True:
            try:
                await self._push_once()
            except asyncio.CancelledError:
                raise
            except Exception:  # a failed read must not end the operator's live view
                logger.exception("console snapshot failed")
                await self.send_json(
                    {
                        "type": "error",
                        "code": "snapshot_failed",
                        "detail": "the cluster snapshot failed; retrying",
                    }
                )
            await asyncio.sleep(interval)
