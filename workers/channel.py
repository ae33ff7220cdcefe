"""Durable per-worker command channels on Redis streams (no Django).

The control plane appends commands to ``ss:cmd:<worker>``; the worker reads them through the
consumer group ``daemon``, applies them at a chunk boundary and acknowledges each stream entry
(XACK) after it has answered the command. A worker process that restarts under the same name reads
its unacknowledged entries again first, so a command is never lost between delivery and answer;
answers are idempotent because each command carries a unique id the worker remembers.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass
from typing import Any

import redis

GROUP = "daemon"
STREAM_MAXLEN = 10_000


def stream_key(worker_name: str) -> str:
    return f"ss:cmd:{worker_name}"


def delivered_key(session_id: str) -> str:
    """The last chunk index published for a session (written before each publish)."""
    return f"ss:delivered:{session_id}"


def heartbeat_key(worker_name: str) -> str:
    return f"ss:hb:{worker_name}"


def new_command(kind: str, **fields: Any) -> dict[str, Any]:
    return {"id": str(uuid.uuid4()), "kind": kind, **fields}


def send_command(client: redis.Redis, worker_name: str, command: dict[str, Any]) -> str:
    entry = client.xadd(
        stream_key(worker_name), {"json": json.dumps(command)}, maxlen=STREAM_MAXLEN, approximate=True
    )
    return entry.decode() if isinstance(entry, bytes) else entry


@dataclass
class ReceivedCommand:
    entry_id: str
    command: dict[str, Any]


class CommandReader:
    """The worker's side of its channel."""

    def __init__(self, client: redis.Redis, worker_name: str) -> None:
        self.client = client
        self.key = stream_key(worker_name)
        self.consumer = worker_name
        try:
            self.client.xgroup_create(self.key, GROUP, id="0", mkstream=True)
        except redis.ResponseError as exc:
            if "BUSYGROUP" not in str(exc):
                raise
        self._backlog = True  # first read our own unacknowledged entries (after a restart)

    def read(self, block_ms: int | None, count: int = 100) -> list[ReceivedCommand]:
        start = "0" if self._backlog else ">"
        reply = self.client.xreadgroup(
            GROUP, self.consumer, {self.key: start}, count=count, block=None if self._backlog else block_ms
        )
        out: list[ReceivedCommand] = []
        for _stream, entries in reply or []:
            for entry_id, fields in entries:
                raw = fields.get(b"json") or fields.get("json")
                entry = entry_id.decode() if isinstance(entry_id, bytes) else entry_id
                try:
                    command = json.loads(raw)
                except (TypeError, json.JSONDecodeError):
                    command = {"id": entry, "kind": "malformed"}
                out.append(ReceivedCommand(entry, command))
        if self._backlog and not out:
            self._backlog = False
        return out

    def ack(self, entry_id: str) -> None:
        self.client.xack(self.key, GROUP, entry_id)
