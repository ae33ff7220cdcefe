"""The media process (``manage.py runmedia``, ``sessions.webrtc.media_process``) for tests that
serve WebRTC viewers: started as the platform starts it, on the test's Redis, and stopped after."""

from __future__ import annotations

import contextlib
import os
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import redis
from django.conf import settings

from scheduling.supervision import media_argv
from sessions.webrtc.relay import registry_key


def live_media_processes(redis_url: str) -> set[bytes]:
    client = redis.Redis.from_url(redis_url)
    return set(client.zrangebyscore(registry_key(), time.time(), "+inf"))


@contextlib.contextmanager
def media_process(log_path: Path, *, env: dict[str, str] | None = None) -> Iterator[subprocess.Popen]:
    """A running media process, registered (its lease in Redis) before this yields."""
    env = {**os.environ, "REDIS_URL": settings.REDIS_URL, "PYTHONUNBUFFERED": "1", **(env or {})}
    env.pop("DJANGO_ALLOW_ASYNC_UNSAFE", None)
    before = live_media_processes(env["REDIS_URL"])
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with open(log_path, "wb") as log:
        process = subprocess.Popen(
            list(media_argv()), cwd=settings.BASE_DIR, env=env, stdout=log, stderr=subprocess.STDOUT
        )
        try:
            deadline = time.monotonic() + 60
            while not live_media_processes(env["REDIS_URL"]) - before:
                if process.poll() is not None:
                    raise RuntimeError(
                        f"runmedia exited with {process.returncode}:\n{log_path.read_text()[-4000:]}"
                    )
                if time.monotonic() > deadline:
                    raise RuntimeError(f"runmedia did not register in 60 s:\n{log_path.read_text()[-4000:]}")
                time.sleep(0.1)
            yield process
        finally:
            process.terminate()
            try:
                process.wait(timeout=15)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
