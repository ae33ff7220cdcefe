"""Which codecs a session's viewers want, so its worker encodes each chunk only in those.

A viewer (a session socket, a realtime client) announces the codec it reads while it is connected:
``codec_want`` every ``CODEC_REFRESH_S`` with a lease of ``CODEC_TTL_S``; ``codec_leave`` when it
goes shortens the lease to ``CODEC_LINGER_S``, so a reload or a reconnect finds its codec still
encoded. The worker reads every session of a batch in one pipelined round trip
(``codecs_wanted_many``) before it encodes the batch.

One sorted set per session (``ss:codecs:<session>``), members ``<codec>|<viewer>`` scored by the
lease's end (epoch seconds): expired members are ignored on read and trimmed on write, and the key
itself expires a little after its longest lease, so a session nobody watches leaves nothing behind.

A session nobody has asked anything of is encoded in both (``DEFAULT_CODECS``): H.264, the session
socket's default, and JPEG, so that whichever a viewer reads, its first chunks are there before its
lease has reached the worker (a session nobody watches goes idle and ends, so this lasts seconds).
"""

from __future__ import annotations

import time
from collections.abc import Iterable

import redis

H264 = "h264"
JPEG = "jpeg"
CODECS = (H264, JPEG)
DEFAULT_CODECS = frozenset({H264, JPEG})
CODEC_TTL_S = 15.0
CODEC_REFRESH_S = 5.0
CODEC_LINGER_S = 10.0


def codecs_key(session_id: str) -> str:
    return f"ss:codecs:{session_id}"


def codec_want(
    client: redis.Redis, session_id: str, codec: str, viewer: str, *, ttl_s: float = CODEC_TTL_S
) -> None:
    """``viewer`` reads ``codec`` for the next ``ttl_s`` seconds (call again to keep it)."""
    if codec not in CODECS:
        raise ValueError(f"unknown codec {codec!r}; expected one of {', '.join(CODECS)}")
    now = time.time()
    key = codecs_key(session_id)
    with client.pipeline(transaction=False) as pipe:
        pipe.zremrangebyscore(key, "-inf", now)
        pipe.zadd(key, {f"{codec}|{viewer}": now + ttl_s})
        pipe.expire(key, int(ttl_s) + 5)
        pipe.execute()


def codec_leave(client: redis.Redis, session_id: str, codec: str, viewer: str) -> None:
    """The viewer went: its codec stays wanted for ``CODEC_LINGER_S`` more (a reload comes back)."""
    codec_want(client, session_id, codec, viewer, ttl_s=CODEC_LINGER_S)


def codecs_wanted_many(client: redis.Redis, session_ids: Iterable[str]) -> dict[str, frozenset[str]]:
    """Each session's wanted codecs (``DEFAULT_CODECS`` when no viewer has a live lease), in one
    round trip."""
    ids = list(session_ids)
    if not ids:
        return {}
    now = time.time()
    with client.pipeline(transaction=False) as pipe:
        for session_id in ids:
            pipe.zrangebyscore(codecs_key(session_id), now, "+inf")
        replies = pipe.execute()
    wanted = {}
    for session_id, members in zip(ids, replies, strict=True):
        codecs = frozenset(member.decode().split("|", 1)[0] for member in members)
        wanted[session_id] = codecs or DEFAULT_CODECS
    return wanted
