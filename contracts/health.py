"""What a readiness check reports, and the checks of the two services every process depends on:
PostgreSQL answers ``SELECT 1``, Redis (channel layer, cache, worker command streams) answers
``PING`` within ``READINESS_TIMEOUT_S``. The web role's ``/readyz`` (``controlplane.health``), the
scheduler's own checks (``scheduling.health``) and ``manage.py probe`` all report ``Check``s.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import redis
from django.conf import settings
from django.db import connections

READINESS_TIMEOUT_S = 2.0


@dataclass(frozen=True)
class Check:
    """One dependency as a probe saw it."""

    name: str
    ok: bool
    latency_ms: float
    detail: str = ""


def _timed(name: str, attempt: Callable[[], None]) -> Check:
    began = time.perf_counter()
    try:
        attempt()
    except Exception as exc:  # any failure of a dependency means not ready; the detail says which
        return Check(
            name, False, round((time.perf_counter() - began) * 1000, 1), f"{type(exc).__name__}: {exc}"
        )
    return Check(name, True, round((time.perf_counter() - began) * 1000, 1))


def database_check(alias: str = "default") -> Check:
    def attempt() -> None:
        # Django's request_started handler has already dropped a connection that broke since the
        # last request (PostgreSQL restarted), so this reconnects when it has to.
        with connections[alias].cursor() as cursor:
            cursor.execute("SELECT 1")

    return _timed("postgresql", attempt)


def redis_check(url: str | None = None) -> Check:
    def attempt() -> None:
        client = redis.Redis.from_url(
            url or settings.REDIS_URL,
            socket_connect_timeout=READINESS_TIMEOUT_S,
            socket_timeout=READINESS_TIMEOUT_S,
        )
        try:
            client.ping()
        finally:
            client.close()

    return _timed("redis", attempt)


def readiness() -> list[Check]:
    return [database_check(), redis_check()]
