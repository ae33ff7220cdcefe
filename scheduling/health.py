"""Health of the roles that serve no HTTP: the Celery worker, beat and GPU workers.

Each check returns a ``contracts.health.Check``; ``manage.py probe`` turns one into an exit
status for an exec probe (Kubernetes) or a supervisor's check.

- **Celery worker**: a broadcast ``ping`` addressed to the node (``-n scheduler@<host>``) and
  answered by its main process over the broker. It proves the process consumes broker messages,
  which is what the scheduler needs of it; an idle worker answers too.
- **beat**: beat records the time of every task it publishes in Redis (``BEAT_HEARTBEAT_KEY``),
  from ``before_task_publish`` in the beat process only. The scheduler tick is published every
  ``PERIODIC_TASKS["scheduler tick"]`` seconds, so a stale key means beat stopped scheduling,
  whether or not any worker consumes what it sends (a worker outage must not restart beat).
- **GPU worker**: ``GpuWorker.last_heartbeat``, which the worker's reporter writes every
  ``HEARTBEAT_INTERVAL_S``, younger than ``HEARTBEAT_TIMEOUT_S`` (the scheduler's own rule for a
  lost worker), and the row live.
- **host cache**: ``HostCache.last_heartbeat``, written at each of its steps, and the row live.
"""

from __future__ import annotations

import contextlib
import functools
import socket
import time
from typing import Any

import redis
from celery import current_app as celery_app
from celery.signals import before_task_publish
from django.conf import settings
from django.utils import timezone

from contracts.health import Check
from gpu.models import GpuWorker, HostCache

BEAT_HEARTBEAT_KEY = "streamserve:health:beat"
# Twice the longest default period (60 s): beat publishes something at least that often.
BEAT_MAX_AGE_S = 120.0
CELERY_PING_TIMEOUT_S = 5.0


def default_celery_node() -> str:
    """The node name ``runplatform`` and ``deploy/celery.yaml`` give the scheduler's worker."""
    return f"scheduler@{socket.gethostname()}"


def celery_check(node: str | None = None, *, timeout_s: float = CELERY_PING_TIMEOUT_S) -> Check:
    node = node or default_celery_node()
    began = time.perf_counter()
    try:
        replies = celery_app.control.ping(destination=[node], timeout=timeout_s)
    except Exception as exc:  # broker unreachable: the worker cannot be reached either
        return Check("celery", False, _ms(began), f"{node}: {type(exc).__name__}: {exc}")
    answered = any(node in reply for reply in replies)
    detail = "" if answered else f"{node} did not answer a ping within {timeout_s:.0f}s"
    return Check("celery", answered, _ms(began), detail)


def _redis() -> redis.Redis:
    return _redis_at(settings.REDIS_URL)


@functools.cache
def _redis_at(url: str) -> redis.Redis:
    # One pooled client per URL: beat writes the heartbeat every tick.
    return redis.Redis.from_url(url, socket_connect_timeout=2.0, socket_timeout=2.0)


def _beat_published(**_: Any) -> None:
    """``before_task_publish`` in the beat process: beat is scheduling."""
    # On a Redis error the publish itself fails on the same Redis and beat logs that; the key
    # goes stale, which is the truth.
    with contextlib.suppress(redis.RedisError):
        _redis().set(BEAT_HEARTBEAT_KEY, repr(time.time()), ex=int(BEAT_MAX_AGE_S * 10))


def beat_started(**_: Any) -> None:
    """``beat_init`` (connected in ``SchedulingConfig.ready``): from now on this process is beat.

    Only beat records the heartbeat: the web and Celery processes publish tasks too.
    """
    before_task_publish.connect(_beat_published, weak=False, dispatch_uid="scheduling.health.beat_publish")


def beat_check(*, max_age_s: float = BEAT_MAX_AGE_S) -> Check:
    began = time.perf_counter()
    try:
        raw = _redis().get(BEAT_HEARTBEAT_KEY)
    except redis.RedisError as exc:
        return Check("beat", False, _ms(began), f"redis: {type(exc).__name__}: {exc}")
    if raw is None:
        return Check("beat", False, _ms(began), "beat has published no task yet")
    age = time.time() - float(raw)
    if age > max_age_s:
        return Check("beat", False, _ms(began), f"last publish {age:.0f}s ago (limit {max_age_s:.0f}s)")
    return Check("beat", True, _ms(began), f"last publish {age:.1f}s ago")


def gpu_worker_check(name: str, *, max_age_s: float | None = None, serving: bool = False) -> Check:
    """``serving``: also the worker takes sessions (``ready``), not booting nor draining: a Pod's
    readiness, which a PodDisruptionBudget counts and ``kubectl wait --for=condition=Ready`` waits for."""
    began = time.perf_counter()
    limit = max_age_s if max_age_s is not None else settings.STREAMSERVE["HEARTBEAT_TIMEOUT_S"]
    worker = GpuWorker.objects.filter(name=name).only("status", "last_heartbeat").first()
    if worker is None:
        return Check("worker", False, _ms(began), f"no worker named {name!r}")
    if worker.status not in GpuWorker.LIVE_STATUSES:
        return Check("worker", False, _ms(began), f"{name} is {worker.status}")
    if serving and worker.status != GpuWorker.Status.READY:
        return Check("worker", False, _ms(began), f"{name} is {worker.status}, not serving")
    if worker.last_heartbeat is None:
        return Check("worker", False, _ms(began), f"{name} has not heartbeated yet ({worker.status})")
    age = (timezone.now() - worker.last_heartbeat).total_seconds()
    if age > limit:
        return Check(
            "worker", False, _ms(began), f"{name}: last heartbeat {age:.1f}s ago (limit {limit:.1f}s)"
        )
    return Check("worker", True, _ms(began), f"{name}: last heartbeat {age:.1f}s ago")


def host_cache_check(name: str, *, max_age_s: float | None = None) -> Check:
    """The host cache's row is live (the pool counts it: its copies are sources) and its heartbeat,
    written at each step, younger than ``max_age_s`` (default ``HEARTBEAT_TIMEOUT_S``)."""
    began = time.perf_counter()
    limit = max_age_s if max_age_s is not None else settings.STREAMSERVE["HEARTBEAT_TIMEOUT_S"]
    cache = HostCache.objects.filter(name=name).only("status", "last_heartbeat").first()
    if cache is None:
        return Check("hostcache", False, _ms(began), f"no host cache named {name!r}")
    if cache.status != HostCache.Status.LIVE:
        return Check("hostcache", False, _ms(began), f"{name} is {cache.status}")
    age = (timezone.now() - cache.last_heartbeat).total_seconds()
    if age > limit:
        return Check(
            "hostcache", False, _ms(began), f"{name}: last heartbeat {age:.1f}s ago (limit {limit:.1f}s)"
        )
    return Check("hostcache", True, _ms(began), f"{name}: last heartbeat {age:.1f}s ago")


def _ms(began: float) -> float:
    return round((time.perf_counter() - began) * 1000, 1)
