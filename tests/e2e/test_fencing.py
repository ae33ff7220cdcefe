"""Fencing with real processes (issue 17, defects 1 and 2): a worker frozen past its heartbeat
timeout is declared lost and its session restarts on another worker; when the frozen worker is
woken it must not publish under its old epoch, and the client sees every index once, in order.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import time

import httpx
import psutil
import pytest
import websockets
from rest_framework.authtoken.models import Token

from contracts.wire.frames import decode_chunk_frame
from gpu.models import GpuWorker
from sessions.models import GenerationSession, SessionEvent
from tests.e2e.conftest import wait_for
from tests.factories import StaffFactory, UserFactory

pytestmark = [pytest.mark.e2e, pytest.mark.slow, pytest.mark.django_db]


@pytest.fixture(scope="module")
def tokens(platform, django_db_blocker):
    with django_db_blocker.unblock():
        return {
            "user": Token.objects.create(user=UserFactory()).key,
            "staff": Token.objects.create(user=StaffFactory()).key,
        }


def api(platform, token):
    return httpx.Client(base_url=platform.url, headers={"Authorization": f"Token {token}"}, timeout=30)


async def watch_through_a_freeze(url: str, pid: int, frozen_worker: str) -> tuple[list[dict], list[dict]]:
    """Stream the session; after 3 chunks freeze its worker; once 3 chunks came from another
    worker, wake the frozen one and keep listening while it would catch up under its old epoch."""
    headers: list[dict] = []
    texts: list[dict] = []

    async def until(predicate, timeout: float, what: str) -> None:
        deadline = time.monotonic() + timeout
        while not predicate():
            assert time.monotonic() < deadline, f"timed out waiting for {what}: {headers} {texts}"
            await asyncio.sleep(0.1)

    async with websockets.connect(url, max_size=None) as ws:

        async def read() -> None:
            async for message in ws:
                if isinstance(message, bytes):
                    headers.append(decode_chunk_frame(message)[0])
                else:
                    texts.append(json.loads(message))

        reader = asyncio.create_task(read())
        try:
            await until(lambda: len(headers) >= 3, 60, "the first chunks")
            os.kill(pid, signal.SIGSTOP)
            try:
                await until(
                    lambda: sum(h["worker"] != frozen_worker for h in headers) >= 3,
                    45,
                    "the session to stream from another worker",
                )
            finally:
                os.kill(pid, signal.SIGCONT)
            # Unfenced, the woken worker catches up at once (its chunks are overdue) and keeps going.
            await asyncio.sleep(5)
        finally:
            reader.cancel()
    return headers, texts


def stop_process_group(pid: int) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pid, signal.SIGTERM)
        with contextlib.suppress(psutil.NoSuchProcess, psutil.TimeoutExpired):
            psutil.Process(pid).wait(timeout=15)
        os.killpg(pid, signal.SIGKILL)


def test_a_frozen_worker_woken_after_the_takeover_publishes_nothing(platform, tokens, live_db):
    with api(platform, tokens["staff"]) as staff:
        assert staff.patch("/api/scheduler/config/", json={"min_gpus": 2}).status_code == 200
    wait_for(lambda: GpuWorker.objects.filter(status="ready").count() >= 2, 90, message="two workers")
    with api(platform, tokens["user"]) as client:
        response = client.post("/api/sessions/", json={"prompt": "a fox in snow", "model": "tiny", "seed": 3})
        assert response.status_code == 201, response.text
        sid = response.json()["id"]
    wait_for(lambda: GenerationSession.objects.get(pk=sid).status == "executing", 60, message="placement")
    worker = GenerationSession.objects.select_related("worker").get(pk=sid).worker
    pid = int(worker.external_id.split("@")[0])
    url = f"{platform.ws_url}/ws/sessions/{sid}/?token={tokens['user']}"

    try:
        headers, texts = asyncio.run(watch_through_a_freeze(url, pid, worker.name))

        assert GpuWorker.objects.get(pk=worker.pk).status == "failed"
        assert SessionEvent.objects.filter(session_id=sid, kind="restart").exists()
        indices = [h["index"] for h in headers]
        # No index twice, none skipped (the restart resumes after the last index actually delivered).
        assert indices == list(range(indices[0], indices[0] + len(indices))), (indices, texts)
        assert not [t for t in texts if t.get("type") == "skipped"]
        # One owner at a time: once the new owner streams, nothing more from the frozen one.
        owners = [h["worker"] for h in headers]
        takeover = next(i for i, name in enumerate(owners) if name != worker.name)
        assert set(owners[takeover:]) == {owners[takeover]} != {worker.name}, owners
        assert [h["epoch"] for h in headers] == sorted(h["epoch"] for h in headers)
        # What the client saw above is the guarantee. The woken worker's own reaction (its log's
        # chunk.fenced / session.superseded) is covered by tests/workers/test_fence.py and
        # tests/workers/test_daemon.py, where the timing is under the test's control.
        with api(platform, tokens["user"]) as client:
            client.post(f"/api/sessions/{sid}/terminate/")
    finally:
        # Declared lost, it is no longer the platform's to release (the provisioner's leftover
        # sweep would stop it only after a grace period longer than this module lives).
        stop_process_group(pid)
