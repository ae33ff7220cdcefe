"""The chaos suite (issue 17), part 2: the platform's Redis, then its PostgreSQL, restarted mid-stream.

Each test starts a platform of its own against a private service it can stop and start (a
``redis-server`` on another port; a PostgreSQL cluster made with ``initdb`` in a temporary
directory), streams a session to a real WebSocket client and checks what it saw, the owner probe
and the chunk records, as in ``test_chaos.py``. Run under the heavy lock.
"""

from __future__ import annotations

import asyncio
import json
import os

import psycopg
import pytest

from gpu.models import GpuWorker
from sessions.models import GenerationSession, SessionEvent
from tests.e2e.chaos import (
    PrivatePostgres,
    PrivateRedis,
    until,
)
from tests.e2e.chaos_run import (
    CHAOS_ENV,
    CHAOS_PROFILE,
    assert_recorded,
    records_of,
    running_platform,
    session_create,
    stream_through,
    workers_ready,
)
from tests.e2e.conftest import Platform, wait_for

pytestmark = [pytest.mark.e2e, pytest.mark.slow]


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
