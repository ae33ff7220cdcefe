"""The chaos suite (issue 17), part 1: faults on the live platform, judged by what a real client saw.

Each test streams sessions to real WebSocket clients on the whole platform (uvicorn, Celery worker
and beat, local CPU workers), injects one fault mid-stream and asserts, per session:

- the client saw no chunk index twice and none skipped (``ClientView.assert_one_stream``);
- every chunk the client received has its record in PostgreSQL once the ingester drained;
- the owner probe (``tests/e2e/chaos.py``), sampling every 150 ms during the fault, never saw two
  workers able to publish the session, nor a fenced-out worker publishing.

Here, on one platform for the module: a worker's SIGTERM (graceful hand-back) and 8 concurrent
migrations into one worker. Redis and PostgreSQL restarts, each on a platform of its own, are in
``test_chaos_restarts.py`` (a separate module, so that no two platforms share the test database).
Bounded in time; run under the heavy lock (they start many processes).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import os
import signal

import httpx
import pytest

from gpu.models import GpuWorker
from scheduling.models import Migration
from sessions.models import GenerationSession, SessionEvent
from tests.e2e.chaos import (
    until,
)
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
def chaos_platform(django_db_setup, django_db_blocker, tmp_path_factory):
    with running_platform(django_db_blocker, tmp_path_factory.mktemp("chaos")) as platform:
        yield platform


@pytest.mark.django_db
def test_eight_concurrent_migrations_into_one_worker(chaos_platform):
    platform = chaos_platform
    # Given eight sessions streaming from one worker (the only one: K = 8 holds them all)
    gpu_bounds(platform, 1, 1)
    (source,) = wait_for(lambda: workers_ready(1), 90, message="a worker")
    sids = [session_create(platform, platform.tokens["user"], seed) for seed in range(8)]
    wait_for(
        lambda: GenerationSession.objects.filter(pk__in=sids, status="executing", worker=source).count() == 8,
        60,
        message="eight sessions executing on one worker",
    )
    # and a second worker, empty
    gpu_bounds(platform, 2, 2)
    target = wait_for(
        lambda: GpuWorker.objects.filter(status="ready").exclude(pk=source.pk).first(), 90, message="a target"
    )

    async def eight_migrations(views):
        # When an operator moves all eight into the target at once
        def migrate(sid: str) -> httpx.Response:
            with api(platform, platform.tokens["staff"]) as staff:
                return staff.post(f"/api/sessions/{sid}/migrate/", json={"target": target.name})

        with concurrent.futures.ThreadPoolExecutor(8) as pool:
            responses = await asyncio.gather(
                *(asyncio.get_running_loop().run_in_executor(pool, migrate, sid) for sid in sids)
            )
        assert [r.status_code for r in responses] == [202] * 8, [r.text for r in responses]
        await until(
            lambda: all(sum(h["worker"] == target.name for h in v.headers) >= 3 for v in views.values()),
            60,
            "three chunks of every session from the target",
        )

    views, probe = asyncio.run(
        stream_through(
            platform, platform.tokens["user"], sids, eight_migrations, redis_url=platform.env["REDIS_URL"]
        )
    )

    # Then every migration succeeded, and every client saw one stream that moved once
    outcomes = list(Migration.objects.filter(session_id__in=sids).values_list("outcome", "error"))
    assert outcomes == [("succeeded", "")] * 8, outcomes
    assert set(GenerationSession.objects.filter(pk__in=sids).values_list("worker__name", flat=True)) == {
        target.name
    }
    for view in views.values():
        view.assert_one_stream()
        workers = view.workers()
        switch = workers.index(target.name)
        assert set(workers[:switch]) == {source.name} and set(workers[switch:]) == {target.name}, workers
    probe.assert_one_owner()
    assert_recorded(views, records_of)
    with api(platform, platform.tokens["user"]) as client:
        for sid in sids:
            client.post(f"/api/sessions/{sid}/terminate/")


@pytest.mark.django_db
def test_a_worker_stopped_with_sigterm_hands_its_session_back(chaos_platform):
    platform = chaos_platform
    # Given a session streaming on one of two workers
    gpu_bounds(platform, 2, 2)
    wait_for(lambda: workers_ready(2), 90, message="two workers")
    sid = session_create(platform, platform.tokens["user"], 41)
    wait_for(lambda: GenerationSession.objects.get(pk=sid).status == "executing", 60, message="placement")
    worker = GenerationSession.objects.select_related("worker").get(pk=sid).worker
    pid = int(worker.external_id.split("@")[0])

    async def sigterm(views):
        # When its worker gets SIGTERM (a node drain, a deploy): it finishes its chunk, checkpoints
        # and deregisters; the session continues on the other worker
        os.kill(pid, signal.SIGTERM)
        (view,) = views.values()
        await until(
            lambda: sum(h["worker"] != worker.name for h in view.headers) >= 3,
            60,
            "chunks from another worker",
        )

    views, probe = asyncio.run(
        stream_through(platform, platform.tokens["user"], [sid], sigterm, redis_url=platform.env["REDIS_URL"])
    )

    # Then the worker deregistered (released, not lost) and the client saw one stream, handed back once
    assert GpuWorker.objects.get(pk=worker.pk).status == "released"
    assert SessionEvent.objects.filter(session_id=sid, kind="recover").exists()
    view = views[sid]
    view.assert_one_stream()
    workers = view.workers()
    switch = next(i for i, name in enumerate(workers) if name != worker.name)
    assert set(workers[:switch]) == {worker.name} and len(set(workers[switch:])) == 1, workers
    probe.assert_one_owner()
    assert_recorded(views, records_of)
    with api(platform, platform.tokens["user"]) as client:
        client.post(f"/api/sessions/{sid}/terminate/")
