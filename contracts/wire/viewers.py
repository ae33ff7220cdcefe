"""Who is watching a session, on Redis (no Django): the registry the viewer rule reads.

A viewer is one WebSocket consumer connection, named by its channel name. It registers under its
session when it connects, refreshes every ``VIEWER_REFRESH_S`` while connected and leaves when it
disconnects. Each registration holds for ``VIEWER_TTL_S`` only: a consumer whose process died
(SIGKILL, a lost host) never says it left, and its entry lapses on its own within that time, so a
crashed web process cannot keep a session alive.

Keys, per session:

- ``ss:viewers:<session>``: a sorted set, member = channel name, score = the epoch second its
  registration lapses. Counting drops lapsed members first; the key itself expires with its
  newest registration, so a session nobody watches leaves no key behind.
- ``ss:viewers:seen:<session>``: the epoch second a viewer of the session was last seen (set on
  register, refresh and leave). The rule measures "no viewer for N seconds" from it. It outlives the
  viewers (``SEEN_TTL_S``) so an idle timeout can be measured after the last one left;
  ``viewers_forget`` deletes both once the session has ended.
"""

from __future__ import annotations

import time

import redis

VIEWER_TTL_S = 15.0
VIEWER_REFRESH_S = 5.0
# Longer than any sensible idle timeout; a session forgotten by nobody (a crash between its end and
# viewers_forget) leaves its key for a week at most.
SEEN_TTL_S = 7 * 24 * 3600


def _viewers_key(session_id: str) -> str:
    return f"ss:viewers:{session_id}"


def _seen_key(session_id: str) -> str:
    return f"ss:viewers:seen:{session_id}"


def viewer_register(
    client: redis.Redis,
    session_id: str,
    channel: str,
    *,
    ttl_s: float = VIEWER_TTL_S,
    now: float | None = None,
) -> None:
    """``channel`` watches ``session_id`` for the next ``ttl_s`` seconds (also the refresh)."""
    now = time.time() if now is None else now
    pipe = client.pipeline(transaction=True)
    pipe.zadd(_viewers_key(session_id), {channel: now + ttl_s})
    pipe.expire(_viewers_key(session_id), max(1, int(ttl_s) + 1))
    pipe.set(_seen_key(session_id), repr(now), ex=SEEN_TTL_S)
    pipe.execute()


viewer_refresh = viewer_register


def viewer_leave(client: redis.Redis, session_id: str, channel: str, *, now: float | None = None) -> None:
    """``channel`` stopped watching: it no longer counts, and the session was seen until now."""
    now = time.time() if now is None else now
    pipe = client.pipeline(transaction=True)
    pipe.zrem(_viewers_key(session_id), channel)
    pipe.set(_seen_key(session_id), repr(now), ex=SEEN_TTL_S)
    pipe.execute()


def viewer_count(client: redis.Redis, session_id: str, *, now: float | None = None) -> int:
    """Viewers of ``session_id`` whose registration has not lapsed."""
    now = time.time() if now is None else now
    key = _viewers_key(session_id)
    pipe = client.pipeline(transaction=True)
    pipe.zremrangebyscore(key, "-inf", now)
    pipe.zcard(key)
    return int(pipe.execute()[1])


def viewers_census(
    client: redis.Redis, session_ids: list[str], *, now: float | None = None
) -> dict[str, tuple[int, float | None]]:
    """{session: (viewers, last sighting)} for many sessions in one round trip (the periodic check)."""
    now = time.time() if now is None else now
    pipe = client.pipeline(transaction=False)
    for session_id in session_ids:
        pipe.zremrangebyscore(_viewers_key(session_id), "-inf", now)
        pipe.zcard(_viewers_key(session_id))
        pipe.get(_seen_key(session_id))
    replies = pipe.execute()
    census = {}
    for i, session_id in enumerate(session_ids):
        _, count, seen = replies[3 * i : 3 * i + 3]
        census[session_id] = (int(count), None if seen is None else float(seen))
    return census


def viewer_last_seen(client: redis.Redis, session_id: str) -> float | None:
    """The epoch second a viewer of ``session_id`` was last seen; ``None`` if never (or forgotten)."""
    raw = client.get(_seen_key(session_id))
    return None if raw is None else float(raw)


def viewers_forget(client: redis.Redis, session_id: str) -> None:
    """Drop everything known about ``session_id``'s viewers (it has ended)."""
    client.delete(_viewers_key(session_id), _seen_key(session_id))
