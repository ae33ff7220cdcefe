"""A real worker daemon driven step by step by a test: the tiny engine on the CPU, the test's Redis
command stream and the real ``DjangoReporter`` (its own thread: tests using it are transactional).

``stepped_daemon`` starts one for a worker row and cleans up after it (stop, shut down, drop its
command stream); ``steps_until`` steps it until a condition holds.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, TypeVar

import redis
import torch
from django.conf import settings

from contracts.wire.channel import stream_key
from gpu.models import GpuWorker
from workers.adapters.reporting import DjangoReporter
from workers.daemon import WorkerDaemon
from workers.runtime.engine import ChunkEngine

T = TypeVar("T")


@contextmanager
def stepped_daemon(
    worker: GpuWorker, *, max_batch: int, engine: ChunkEngine | None = None, **options: Any
) -> Iterator[WorkerDaemon]:
    """A started daemon named after ``worker`` (reachable as ``daemon.worker``); ``options`` go to
    ``WorkerDaemon`` (capacity, heartbeat, checkpoints...). ``engine``: the tiny monolithic one
    unless given (a stage worker's, issue 15)."""
    torch.set_num_threads(1)
    client = redis.Redis.from_url(settings.REDIS_URL)
    instance = WorkerDaemon(
        name=worker.name,
        engine=engine or ChunkEngine.from_preset("tiny", max_batch=max_batch),
        redis_client=client,
        reporter=DjangoReporter(worker.pk, worker.name),
        **options,
    )
    instance.start()
    instance.worker = worker  # type: ignore[attr-defined]
    try:
        yield instance
    finally:
        instance.stopping.set()
        instance.shutdown()
        client.delete(stream_key(worker.name))


def steps_until(daemon: WorkerDaemon, predicate: Callable[[], T], timeout: float = 60) -> T:
    """Step the daemon until ``predicate`` holds (the bound only turns a hang into a failure)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        daemon.step()
        value = predicate()
        if value:
            return value
    raise AssertionError("condition not reached")
