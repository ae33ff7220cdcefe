"""The chaos suite with H.264 viewers (issue 25): the fragment stream a client receives across a
fault decodes with PyAV into exactly the chunks' frames.

Each session's client asks for ``?codec=h264`` and keeps every fragment; after the fault
(``ClientView.assert_h264_decodes``): no decoder error, each frame's presentation time is its
chunk's index × frames per chunk + k (indices contiguous, no frame twice, none missing), and the
usual chaos judgements — one stream, every chunk recorded, one owner at a time. Every chunk is one
closed GOP that refers to nothing before it, so the stream survives a suspend and resume, a move
between two real workers and a worker's ``kill -9`` with no encoder state moved.

One platform for the module (two CPU workers), bounded in time; run under the heavy lock.
"""

from __future__ import annotations

import asyncio
import os
import signal

import pytest

from gpu.models import GpuWorker
from sessions.models import GenerationSession
from tests.e2e.chaos import until
from tests.e2e.chaos_run import (
    api,
    assert_recorded,
    gpu_bounds,
    records_of,
    running_platform,
    session_create,
    stream_through,
    workers_ready,
)
from tests.e2e.conftest import wait_for

pytestmark = [pytest.mark.e2e, pytest.mark.slow]


@pytest.fixture(scope="module")
def h264_platform(django_db_setup, django_db_blocker, tmp_path_factory):
    with running_platform(django_db_blocker, tmp_path_factory.mktemp("chaos-h264"), min_gpus=2) as platform:
        yield platform


def executing_session(platform, seed: int) -> tuple[str, GpuWorker]:
    gpu_bounds(platform, 2, 2)
    wait_for(lambda: workers_ready(2), 90, message="two workers")
    sid = session_create(platform, platform.tokens["user"], seed)
    wait_for(lambda: GenerationSession.objects.get(pk=sid).status == "executing", 60, message="placement")
    return sid, GenerationSession.objects.select_related("worker").get(pk=sid).worker


def session_field(platform, sid: str, name: str):
    with api(platform, platform.tokens["user"]) as client:
        return client.get(f"/api/sessions/{sid}/").json()[name]


def judge(platform, sid: str, views, probe) -> list[str]:
    view = views[sid]
    view.assert_one_stream()
    view.assert_h264_decodes()
    probe.assert_one_owner()
    assert_recorded(views, records_of)
    with api(platform, platform.tokens["user"]) as client:
        client.post(f"/api/sessions/{sid}/terminate/")
    return view.workers()


@pytest.mark.django_db
def test_an_h264_stream_suspended_and_resumed_decodes_as_one(h264_platform):
    platform = h264_platform
    # Given an H.264 viewer of a streaming session
    sid, _ = executing_session(platform, 51)

    async def suspend_and_resume(views):
        (view,) = views.values()
        # When its owner pauses it (the worker suspends it: state parked), then resumes it
        with api(platform, platform.tokens["user"]) as client:
            assert client.post(f"/api/sessions/{sid}/pause/").status_code in (200, 202)
        deadline_status = asyncio.get_running_loop().time() + 60
        while await asyncio.to_thread(session_field, platform, sid, "status") != "suspended":
            assert asyncio.get_running_loop().time() < deadline_status, "the session was not suspended"
            await asyncio.sleep(0.5)
        before = len(view.headers)
        await asyncio.sleep(1.0)
        with api(platform, platform.tokens["user"]) as client:
            assert client.post(f"/api/sessions/{sid}/resume/").status_code in (200, 202)
        await until(lambda: len(view.headers) >= before + 3, 90, "three chunks after the resume")

    views, probe = asyncio.run(
        stream_through(
            platform,
            platform.tokens["user"],
            [sid],
            suspend_and_resume,
            redis_url=platform.env["REDIS_URL"],
            codec="h264",
        )
    )

    # Then the client's fragments decode into exactly its chunks' frames, across the pause
    judge(platform, sid, views, probe)


@pytest.mark.django_db
def test_an_h264_stream_migrated_between_two_workers_decodes_as_one(h264_platform):
    platform = h264_platform
    # Given an H.264 viewer of a session streaming on one of two workers
    sid, source = executing_session(platform, 52)
    target = GpuWorker.objects.filter(status="ready").exclude(pk=source.pk).get()

    async def migrate(views):
        (view,) = views.values()
        # When an operator moves it to the other worker
        with api(platform, platform.tokens["staff"]) as staff:
            response = staff.post(f"/api/sessions/{sid}/migrate/", json={"target": target.name})
        assert response.status_code == 202, response.text
        await until(
            lambda: sum(h["worker"] == target.name for h in view.headers) >= 3,
            60,
            "three chunks from the target",
        )

    views, probe = asyncio.run(
        stream_through(
            platform,
            platform.tokens["user"],
            [sid],
            migrate,
            redis_url=platform.env["REDIS_URL"],
            codec="h264",
        )
    )

    # Then one stream that moved once decodes into exactly its chunks' frames
    workers = judge(platform, sid, views, probe)
    switch = workers.index(target.name)
    assert set(workers[:switch]) == {source.name} and set(workers[switch:]) == {target.name}, workers


@pytest.mark.django_db
def test_an_h264_stream_recovered_after_kill_9_of_its_worker_decodes_as_one(h264_platform):
    platform = h264_platform
    # Given an H.264 viewer of a session streaming on one of two workers
    sid, victim = executing_session(platform, 53)
    pid = int(victim.external_id.split("@")[0])

    async def kill_9(views):
        (view,) = views.values()
        # When its worker is killed with SIGKILL (no goodbye: failure detection, recovery elsewhere)
        os.kill(pid, signal.SIGKILL)
        await until(
            lambda: sum(h["worker"] != victim.name for h in view.headers) >= 3,
            120,
            "three chunks from the worker that recovered it",
        )

    views, probe = asyncio.run(
        stream_through(
            platform,
            platform.tokens["user"],
            [sid],
            kill_9,
            redis_url=platform.env["REDIS_URL"],
            codec="h264",
        )
    )

    # Then the recovered stream continues the same one: it decodes into exactly its chunks' frames
    workers = judge(platform, sid, views, probe)
    switch = next(i for i, name in enumerate(workers) if name != victim.name)
    assert set(workers[:switch]) == {victim.name} and victim.name not in workers[switch:], workers
