"""Liveness and readiness of the web role: ``/healthz`` and ``/readyz``.

A middleware, first in ``MIDDLEWARE``, answers both paths before anything else runs, because a
probe must not depend on what it does not check: the kubelet sends ``Host: <pod IP>:<port>``,
which ``ALLOWED_HOSTS`` rightly refuses (``CommonMiddleware`` would answer 400), and the session
and authentication middleware would query PostgreSQL even for the liveness probe.

- ``/healthz`` (liveness): the process answers HTTP. It checks no dependency on purpose: a
  restart does not bring PostgreSQL back, and restarting every web Pod when the database blips
  turns a partial outage into a full one.
- ``/readyz`` (readiness): PostgreSQL answers ``SELECT 1`` and Redis (channel layer, cache,
  worker command streams) answers ``PING``, Redis within ``READINESS_TIMEOUT_S`` (PostgreSQL within the
  connection's own ``connect_timeout``; the probe's ``timeoutSeconds`` bounds the rest). 200 with the
  checks, or 503 naming the failed ones, so the Service stops routing to a Pod that cannot serve.

Like ``wsauth``, the module knows nothing of the apps.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import asdict, dataclass

import redis
from django.conf import settings
from django.db import connections
from django.http import HttpRequest, HttpResponse, JsonResponse

READINESS_TIMEOUT_S = 2.0
LIVENESS_PATH = "/healthz"
READINESS_PATH = "/readyz"


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


def readiness_response() -> JsonResponse:
    checks = readiness()
    ready = all(check.ok for check in checks)
    return JsonResponse(
        {"status": "ready" if ready else "not ready", "checks": [asdict(check) for check in checks]},
        status=200 if ready else 503,
    )


class HealthMiddleware:
    """Answers ``GET``/``HEAD`` of the probe paths; every other request passes through."""

    def __init__(self, get_response: Callable[[HttpRequest], HttpResponse]) -> None:
        self.get_response = get_response

    def __call__(self, request: HttpRequest) -> HttpResponse:
        if request.method in ("GET", "HEAD"):
            if request.path == LIVENESS_PATH:
                return JsonResponse({"status": "alive"})
            if request.path == READINESS_PATH:
                return readiness_response()
        return self.get_response(request)
