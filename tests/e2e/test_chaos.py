"""The chaos suite (issue 17): faults on the live platform, judged by what a real client saw.

Each test starts the whole platform (uvicorn, Celery worker and beat, local CPU workers), streams
sessions to real WebSocket clients, injects one fault mid-stream and asserts, per session:

- the client saw no chunk index twice and none skipped (``ClientView.assert_one_stream``);
- every chunk the client received has its record in PostgreSQL once the ingester drained;
- the owner probe (``tests/e2e/chaos.py``), sampling every 150 ms during the fault, never saw two
  workers able to publish the session, nor a fenced-out worker publishing.

Faults: a worker's SIGTERM (graceful hand-back), 8 concurrent migrations into one worker, the
platform's Redis restarted (a private ``redis-server``), its PostgreSQL restarted (a private
cluster). Bounded in time; run them under the heavy lock (they start many processes).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import json
import os
import signal
from pathlib import Path

import httpx
import psycopg
import pytest
from rest_framework.authtoken.models import Token

from gpu.models import GpuWorker
from scheduling.models import Migration, SchedulerConfig
from sessions.models import ChunkRecord, GenerationSession, SessionEvent
from tests.e2e.chaos import (
    ClientView,
    OwnerProbe,
    PrivatePostgres,
    PrivateRedis,
    until,
)
from tests.e2e.conftest import Platform, wait_for
from tests.factories import StaffFactory, UserFactory

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

# The measured CPU profile (K = 8: eight sessions fit one worker), a short provisioning delay, and a
# policy that never migrates on its own: every migration here is the test's.
CHAOS_PROFILE = {"name": "cpu-tiny-chaos", "provisioning_delay_s": 2.0}
CHAOS_ENV = {"MAX_LIVE_SESSIONS_PER_USER": "20"}


def api(platform: Platform, token: str) -> httpx.Client:
    return httpx.Client(base_url=platform.url, headers={"Authorization": f"Token {token}"}, timeout=30)


def session_create(platform: Platform, token: str, seed: int) -> str:
    with api(platform, token) as client:
        response = client.post(
            "/api/sessions/", json={"prompt": f"chaos {seed}", "model": "tiny", "seed": seed}
        )
    assert response.status_code == 201, response.text
    return response.json()["id"]


def records_of(sid: str) -> set[int]:
    return set(ChunkRecord.objects.filter(session_id=sid).values_list("chunk_index", flat=True))


def assert_recorded(views: dict[str, ClientView], records) -> None:
    """Every chunk a client received has its record (waits for the ingester, bounded)."""
    for sid, view in views.items():
        wait_for(
            lambda sid=sid, view=view: set(view.indices) <= records(sid), 30, message=f"records of {sid}"
        )


async def stream_through(
    platform: Platform, token: str, sids: list[str], fault, *, redis_url: str, settle_s: float = 3.0
) -> tuple[dict[str, ClientView], OwnerProbe]:
    """Clients and the probe on ``sids``; once each client has 3 chunks, ``await fault(views)``;
    then keep listening ``settle_s`` for late or duplicate chunks."""
    views = {sid: ClientView(f"{platform.ws_url}/ws/sessions/{sid}/?token={token}") for sid in sids}
    probe = OwnerProbe(redis_url, sids)
    stop = asyncio.Event()
    tasks = [asyncio.ensure_future(v.run(stop)) for v in views.values()]
    tasks.append(asyncio.ensure_future(probe.run(stop)))
    try:
        await until(lambda: all(len(v.headers) >= 3 for v in views.values()), 60, "3 chunks on every client")
        await fault(views)
        await asyncio.sleep(settle_s)
    finally:
        stop.set()
        await asyncio.gather(*tasks, return_exceptions=True)
    return views, probe


# --- on the suite's database and Redis ------------------------------------------------------------


@contextlib.contextmanager
def running_platform(django_db_blocker, tmp: Path, *, min_gpus: int = 1, env: dict | None = None):
    """The platform on the suite's database, with a user's and a staff member's API tokens."""
    from django.core.management import call_command

    from scheduling.services import beat_schedule_install

    with django_db_blocker.unblock():
        call_command("flush", "--noinput", verbosity=0)
        beat_schedule_install(tick_s=1)
        SchedulerConfig.objects.update_or_create(
            pk=1, defaults={"min_gpus": min_gpus, "max_gpus": min_gpus, "policy": "turboserve-no-migration"}
        )
        tmp.mkdir(parents=True, exist_ok=True)
        platform = Platform(tmp, profile=CHAOS_PROFILE, env={**CHAOS_ENV, **(env or {})})
        platform.tokens = {
            "user": Token.objects.create(user=UserFactory()).key,
            "staff": Token.objects.create(user=StaffFactory()).key,
        }
        platform.start()
        try:
            yield platform
        except BaseException:
            print(platform.logs())
            raise
        finally:
            platform.stop()
            call_command("flush", "--noinput", verbosity=0)


@pytest.fixture(scope="module")
def chaos_platform(django_db_setup, django_db_blocker, tmp_path_factory):
    with running_platform(django_db_blocker, tmp_path_factory.mktemp("chaos")) as platform:
        yield platform


def workers_ready(count: int) -> list[GpuWorker]:
    return (
        list(GpuWorker.objects.filter(status="ready").order_by("id"))
        if GpuWorker.objects.filter(status="ready").count() >= count
        else []
    )


def gpu_bounds(platform: Platform, low: int, high: int) -> None:
    with api(platform, platform.tokens["staff"]) as staff:
        response = staff.patch("/api/scheduler/config/", json={"min_gpus": low, "max_gpus": high})
    assert response.status_code == 200, response.text


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


# --- Redis restarted --------------------------------------------------------------------------------


@pytest.mark.django_db(transaction=True)
def test_the_platform_rides_out_a_redis_restart(django_db_setup, django_db_blocker, tmp_path):
    # Given the platform on a Redis of its own (channel layer, leases, record and command streams,
    # Celery's broker), a session streaming
    server = PrivateRedis(tmp_path)
    server.start()
    env = {"REDIS_URL": server.url, "CELERY_BROKER_URL": server.url.replace("/0", "/1")}
    try:
        with running_platform(django_db_blocker, tmp_path / "platform", env=env) as platform:
            wait_for(lambda: workers_ready(1), 90, message="a worker")
            sid = session_create(platform, platform.tokens["user"], 7)
            wait_for(
                lambda: GenerationSession.objects.get(pk=sid).status == "executing", 60, message="placement"
            )
            worker = GenerationSession.objects.select_related("worker").get(pk=sid).worker

            async def restart_redis(views):
                # When Redis stops for 3 s mid-stream and comes back
                (view,) = views.values()
                await asyncio.to_thread(server.stop)
                await asyncio.sleep(3)
                await asyncio.to_thread(server.start)
                seen = len(view.headers)
                await until(
                    lambda: len(view.headers) >= seen + 5, 60, "the stream to go on after the restart"
                )

            views, probe = asyncio.run(
                stream_through(platform, platform.tokens["user"], [sid], restart_redis, redis_url=server.url)
            )
            # Then the client saw one stream, nothing twice, nothing skipped, from the same worker:
            # it waited for Redis instead of exiting (its session was never restarted elsewhere)
            view = views[sid]
            view.assert_one_stream()
            assert set(view.workers()) == {worker.name}, view.workers()
            assert not SessionEvent.objects.filter(session_id=sid, kind__in=["recover", "restart"]).exists()
            assert GpuWorker.objects.get(pk=worker.pk).status == "ready"
            probe.assert_one_owner()
            assert_recorded(views, records_of)
    finally:
        server.stop()


# --- PostgreSQL restarted ---------------------------------------------------------------------------

SETUP_SCRIPT = """
import json
from rest_framework.authtoken.models import Token
from django.contrib.auth import get_user_model
from scheduling.models import SchedulerConfig
from scheduling.services import beat_schedule_install
beat_schedule_install(tick_s=1)
SchedulerConfig.objects.update_or_create(pk=1, defaults={"min_gpus": 1, "max_gpus": 1, "policy": "turboserve-no-migration"})
User = get_user_model()
user = User.objects.create_user("chaos", password="chaos-pass-1")
staff = User.objects.create_user("chaos-staff", password="chaos-pass-1", is_staff=True)
print(json.dumps({"user": Token.objects.create(user=user).key, "staff": Token.objects.create(user=staff).key}))
"""


def manage(env: dict[str, str], *args: str) -> str:
    import subprocess
    import sys

    from tests.e2e.conftest import ROOT

    done = subprocess.run(
        [sys.executable, "manage.py", *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout


def test_the_platform_rides_out_a_postgres_restart(tmp_path):
    # Given the platform on a PostgreSQL cluster of its own, migrated, a session streaming
    server = PrivatePostgres()
    server.init()
    server.start()
    dbname = "streamserve_chaos"
    platform = None
    try:
        with psycopg.connect(server.url("postgres"), autocommit=True) as conn:
            conn.execute(f"CREATE DATABASE {dbname}")
        env = {**os.environ, **CHAOS_ENV, "DATABASE_URL": server.url(dbname), "DEBUG": "true"}
        manage(env, "migrate", "--noinput", "-v", "0")
        tokens = json.loads(manage(env, "shell", "-c", SETUP_SCRIPT).strip().splitlines()[-1])
        (tmp_path / "platform").mkdir()
        platform = Platform(
            tmp_path / "platform",
            profile=CHAOS_PROFILE,
            env={**CHAOS_ENV, "DATABASE_URL": server.url(dbname)},
        )
        platform.start()

        def query(sql: str, *params):
            with psycopg.connect(server.url(dbname), connect_timeout=2) as conn:
                return conn.execute(sql, params).fetchall()

        def executing_on() -> str | None:
            rows = query(
                "SELECT w.name FROM streams_generationsession s JOIN gpu_gpuworker w ON w.id = s.worker_id"
                " WHERE s.id = %s AND s.status = 'executing'",
                sid,
            )
            return rows[0][0] if rows else None

        sid = session_create(platform, tokens["user"], 11)
        worker = wait_for(executing_on, 120, message="placement")

        async def restart_postgres(views):
            # When PostgreSQL stops for 3 s mid-stream (fast shutdown: connections cut) and comes back
            (view,) = views.values()
            await asyncio.to_thread(server.stop)
            await asyncio.sleep(3)
            await asyncio.to_thread(server.start)
            seen = len(view.headers)
            await until(lambda: len(view.headers) >= seen + 8, 60, "the stream to go on after the restart")

        views, probe = asyncio.run(
            stream_through(
                platform, tokens["user"], [sid], restart_postgres, redis_url=platform.env["REDIS_URL"]
            )
        )

        # Then the client saw one stream from the same worker: a control-plane outage is not a
        # worker's death (it was never declared lost, its session never restarted)
        view = views[sid]
        view.assert_one_stream()
        assert set(view.workers()) == {worker}, view.workers()
        kinds = {k for (k,) in query("SELECT kind FROM streams_sessionevent WHERE session_id = %s", sid)}
        assert not kinds & {"recover", "restart"}, kinds
        assert query("SELECT status FROM gpu_gpuworker WHERE name = %s", worker) == [("ready",)]
        probe.assert_one_owner()

        def records(session_id: str) -> set[int]:
            rows = query("SELECT chunk_index FROM streams_chunkrecord WHERE session_id = %s", session_id)
            return {i for (i,) in rows}

        assert_recorded(views, records)
    except BaseException:
        if platform is not None:
            print(platform.logs())
        raise
    finally:
        if platform is not None:
            platform.stop()
        server.remove()
