"""Where a session's state and history are, as the commands to its workers need them."""

from __future__ import annotations

from pathlib import Path

from django.conf import settings

from contracts.wire.channel import delivered_key
from contracts.wire.checkpoints import checkpoint_path
from scheduling.live.outbox import redis_client
from sessions.models import GenerationSession


def checkpoint_file(session_id: str) -> Path:
    return checkpoint_path(settings.STREAMSERVE["CHECKPOINT_DIR"], session_id)


def prompt_history(session: GenerationSession) -> list[list]:
    return [[p.from_chunk, p.text] for p in session.prompts.order_by("from_chunk", "id")]


def delivered_index(session: GenerationSession) -> int:
    """The last chunk index handed to the channel layer: where a new owner resumes after a
    takeover. The publisher marks it in Redis after each send, while it holds the session's lease
    (``contracts.wire.channel.PublishFence``), so it is never ahead of delivery; the row, which the
    reporter updates in batches from the same sent chunks, may lag behind it."""
    raw = redis_client().get(delivered_key(str(session.pk)))
    return max(session.delivered_index, int(raw) if raw is not None else -1)
