"""The daemon's heartbeat (``workers.daemon.liveness``) with fakes for the parts it reads: what a beat
reports, its timing, the Redis liveness key, and a failing report that does not stop the beats."""

from __future__ import annotations

import itertools
import queue
import threading
import time
import uuid
from typing import Any

import pytest
import redis
from django.conf import settings

from contracts.wire.channel import heartbeat_key, heartbeats_alive
from workers.daemon.liveness import Heartbeat
from workers.ports import Reporter


class Beats(Reporter):
    def __init__(self, *, fail: bool = False) -> None:
        self.beats: queue.Queue[tuple[float, dict, list, list, dict | None]] = queue.Queue()
        self.fail = fail

    def heartbeat(
        self, telemetry: dict, resident: list[str], parked: list[str], stage: dict | None = None
    ) -> None:
        self.beats.put((time.monotonic(), telemetry, resident, parked, stage))
        if self.fail:
            raise RuntimeError("PostgreSQL is down")


class Streams:
    def resident(self) -> list[str]:
        return ["a", "b"]

    def parked(self) -> list[str]:
        return ["c"]


class Jobs:
    devices = ["cpu", "cpu"]


class Stage:
    def report(self) -> dict[str, Any]:
        return {"stage_role": "DC", "encode_round_trip_ms_p50": 1.5}


@pytest.fixture
def client():
    return redis.Redis.from_url(settings.REDIS_URL)


def heartbeat(reporter: Reporter, client: redis.Redis, **kwargs: Any) -> Heartbeat:
    return Heartbeat(
        name=f"hb-{uuid.uuid4().hex[:8]}",
        reporter=reporter,
        redis_client=client,
        streams=Streams(),  # type: ignore[arg-type]
        jobs=Jobs(),  # type: ignore[arg-type]
        stage=Stage(),  # type: ignore[arg-type]
        stopping=threading.Event(),
        telemetry=lambda: {"gpu_util": 0.5},
        **kwargs,
    )


def test_a_beat_reports_telemetry_job_devices_sessions_and_the_stage_role(client):
    reporter = Beats()
    beat = heartbeat(reporter, client)
    beat.beat()
    _, telemetry, resident, parked, stage = reporter.beats.get_nowait()
    assert telemetry == {"gpu_util": 0.5, "job_devices": 2}
    assert (resident, parked) == (["a", "b"], ["c"])
    assert stage == {"stage_role": "DC", "encode_round_trip_ms_p50": 1.5}
    # Without a TTL there is no Redis liveness key
    assert not client.exists(heartbeat_key(beat.worker_name))


def test_beats_come_every_interval_from_one_interval_after_start_until_stopped(client):
    reporter = Beats()
    beat = heartbeat(reporter, client, interval_s=0.05)
    started = time.monotonic()
    beat.start()
    try:
        times = [reporter.beats.get(timeout=10)[0] for _ in range(3)]
    finally:
        beat.stopping.set()
        beat.join(timeout=10)
    assert not beat.is_alive()
    assert times[0] - started >= 0.05
    assert all(later - earlier >= 0.04 for earlier, later in itertools.pairwise(times))


def test_the_redis_liveness_key_is_renewed_even_when_the_report_fails(client):
    # Given a PostgreSQL outage: the report raises
    reporter = Beats(fail=True)
    beat = heartbeat(reporter, client, ttl_s=5.0)
    try:
        # When the worker beats
        beat.beat()
        # Then the control plane still sees it alive through Redis, for about the TTL
        assert heartbeats_alive(client, [beat.worker_name]) == {beat.worker_name}
        assert 0 < client.pttl(heartbeat_key(beat.worker_name)) <= 5000
    finally:
        client.delete(heartbeat_key(beat.worker_name))
