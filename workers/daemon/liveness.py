"""The worker's liveness: a heartbeat every ``interval_s`` on a thread beside the hot loop.

Each beat samples the device's telemetry (``gpu.telemetry``) and reports it through the
``Reporter`` with the sessions resident and parked here and the stage role's load, and renews the
worker's liveness key in Redis (``contracts.wire.channel.heartbeat_beat``): a PostgreSQL outage
leaves the rows' heartbeats stale, and the control plane must not take that for this worker's
death (``workers_check``).
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Callable
from typing import Any

import redis

from contracts.wire.channel import heartbeat_acknowledged, heartbeat_beat
from gpu.telemetry import sample
from workers.daemon.jobs import JobRunner
from workers.daemon.orphan import OrphanWatch
from workers.daemon.outage import REDIS_DOWN
from workers.daemon.streams import Streams
from workers.ports import Reporter
from workers.runtime.stages.host import StageHost

logger = logging.getLogger("workers.daemon")


class Heartbeat(threading.Thread):
    """Beats until ``stopping`` is set (the first beat one interval after `start`). ``ttl_s``: how
    long the Redis liveness key lives (None: no key, the PostgreSQL heartbeat alone)."""

    def __init__(
        self,
        *,
        name: str,
        reporter: Reporter,
        redis_client: redis.Redis,
        streams: Streams,
        jobs: JobRunner,
        stage: StageHost,
        stopping: threading.Event,
        interval_s: float = 1.0,
        ttl_s: float | None = None,
        telemetry: Callable[[], dict[str, Any]] = sample,
        orphan: OrphanWatch | None = None,
    ) -> None:
        super().__init__(name="heartbeat", daemon=True)
        self.worker_name = name
        self.reporter = reporter
        self.redis = redis_client
        self.streams = streams
        self.jobs = jobs
        self.stage = stage
        self.stopping = stopping
        self.interval_s = interval_s
        self.ttl_s = ttl_s
        self.telemetry = telemetry
        self.orphan = orphan

    def run(self) -> None:
        while not self.stopping.wait(self.interval_s):
            self.beat()

    def beat(self) -> None:
        try:
            resident, parked = self.streams.resident(), self.streams.parked()
            # job_devices: how many devices a video job's step can be split across here
            # (the dispatcher's SP degree for this worker, docs/jobs.md).
            telemetry = {**self.telemetry(), "job_devices": len(self.jobs.devices)}
            self.reporter.heartbeat(telemetry, resident, parked, self.stage.report())
        except Exception:
            logger.exception("heartbeat failed worker=%s", self.worker_name)
        # The same beat in Redis: a PostgreSQL outage leaves the rows' heartbeats stale, and
        # the control plane must not take that for this worker's death (``workers_check``).
        if self.ttl_s is not None:
            with contextlib.suppress(*REDIS_DOWN):  # the PostgreSQL heartbeat still tells it
                heartbeat_beat(self.redis, self.worker_name, self.ttl_s)
        # Whether the control plane still counts this worker alive (it bumps the counter each tick).
        if self.orphan is not None:
            with contextlib.suppress(*REDIS_DOWN):  # no answer is no acknowledgement
                self.orphan.acknowledgement(heartbeat_acknowledged(self.redis, self.worker_name))
