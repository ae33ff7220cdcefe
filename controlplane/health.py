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

from collections.abc import Callable
from dataclasses import asdict

from django.http import HttpRequest, HttpResponse, JsonResponse

from contracts.health import readiness

LIVENESS_PATH = "/healthz"
READINESS_PATH = "/readyz"


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
