"""Redis unreachable (restarted, failed over, a network blip): the daemon waits for it rather than
exiting or dropping a chunk. Every Redis write it retries is idempotent (see ``ChunkPublisher``)."""

from __future__ import annotations

import redis

REDIS_DOWN = (redis.exceptions.ConnectionError, redis.exceptions.TimeoutError)
REDIS_RETRY_S = (0.1, 0.2, 0.5, 1.0)  # backoff between attempts, the last one repeated


def retry_delay(attempt: int) -> float:
    """Seconds to wait before the next attempt, after ``attempt`` failed ones (counted from 0)."""
    return REDIS_RETRY_S[min(attempt, len(REDIS_RETRY_S) - 1)]
