"""One beat per broker (``scheduling.supervision.BeatLock``): a second beat started on the same
broker refuses to run, naming the first; real ``celery beat`` processes on the test broker."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import redis
from django.conf import settings

from scheduling.supervision import BEAT_LOCK_KEY, BEAT_REFUSED_EXIT, BeatLock, BeatLockHeld, beat_argv

ROOT = Path(settings.BASE_DIR)


@pytest.fixture
def broker():
    client = redis.Redis.from_url(settings.CELERY_BROKER_URL)
    client.delete(BEAT_LOCK_KEY)
    yield client
    client.delete(BEAT_LOCK_KEY)


def start_beat(tmp_path: Path, name: str) -> tuple[subprocess.Popen, Path]:
    db = settings.DATABASES["default"]
    env = {
        **os.environ,
        "DATABASE_URL": f"postgres://{db['USER']}@{db['HOST']}:{db['PORT']}/{db['NAME']}",
        "REDIS_URL": settings.REDIS_URL,
        "CELERY_BROKER_URL": settings.CELERY_BROKER_URL,
        "PYTHONUNBUFFERED": "1",
    }
    log = tmp_path / f"{name}.log"
    with open(log, "wb") as out:
        process = subprocess.Popen(
            beat_argv(schedule=tmp_path / f"{name}-schedule"),
            cwd=ROOT,
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    return process, log


def stop(process: subprocess.Popen) -> None:
    if process.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGTERM)
        try:
            process.wait(timeout=20)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()


@pytest.mark.django_db(transaction=True)  # beat reads its schedule from the test database
def test_a_second_beat_on_the_same_broker_exits_non_zero_naming_the_first(tmp_path, broker):
    first, first_log = start_beat(tmp_path, "first")
    second = None
    try:
        # Given a beat running and holding the broker's lease
        holder = f"{socket.gethostname()}:{first.pid}"
        deadline = time.monotonic() + 60
        while broker.get(BEAT_LOCK_KEY) != holder.encode():
            assert first.poll() is None and time.monotonic() < deadline, first_log.read_text()[-3000:]
            time.sleep(0.2)
        # When a second beat starts on the same broker
        second, second_log = start_beat(tmp_path, "second")
        code = second.wait(timeout=60)
        # Then it exits non-zero with a line naming the first, which runs on, still the holder
        text = second_log.read_text()
        assert code == BEAT_REFUSED_EXIT, text[-3000:]
        assert f"beat.refused: another beat runs holder={holder}" in text
        assert first.poll() is None
        assert broker.get(BEAT_LOCK_KEY) == holder.encode()
    finally:
        if second is not None:
            stop(second)
        stop(first)
    # and the first gives the lease back when it stops
    assert broker.get(BEAT_LOCK_KEY) is None


def test_the_lease_is_renewed_taken_over_from_a_dead_holder_here_and_refused_to_a_live_one(broker):
    # a lease held by a live process elsewhere is refused, naming it
    broker.set(BEAT_LOCK_KEY, "elsewhere:1234", px=5000)
    lock = BeatLock(broker, lease_s=2)
    with pytest.raises(BeatLockHeld) as refused:
        lock.acquire()
    assert refused.value.holder == "elsewhere:1234"
    # one held by a process of this host that is gone is taken over at once
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    broker.set(BEAT_LOCK_KEY, f"{socket.gethostname()}:{dead.pid}", px=5000)
    lock.acquire()
    assert broker.get(BEAT_LOCK_KEY) == lock.holder.encode()
    # renewing extends our own lease only
    assert lock.renew() and broker.pttl(BEAT_LOCK_KEY) > 1000
    broker.set(BEAT_LOCK_KEY, "elsewhere:1", px=5000)
    assert not lock.renew()
    lock.release()  # not ours: left alone
    assert broker.get(BEAT_LOCK_KEY) == b"elsewhere:1"
