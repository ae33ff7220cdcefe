"""What the chaos modules share: sessions over REST, the platform on the suite's database, the run."""

from __future__ import annotations

import asyncio
import contextlib
from pathlib import Path

import httpx
from rest_framework.authtoken.models import Token

from gpu.models import GpuWorker
from scheduling.models import SchedulerConfig
from sessions.models import ChunkRecord
from tests.e2e.chaos import (
    ClientView,
    OwnerProbe,
    until,
)
from tests.e2e.conftest import Platform, wait_for
from tests.factories import StaffFactory, UserFactory

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
    platform: Platform,
    token: str,
    sids: list[str],
    fault,
    *,
    redis_url: str,
    settle_s: float = 3.0,
    codec: str = "jpeg",
) -> tuple[dict[str, ClientView], OwnerProbe]:
    """Clients (reading ``codec``) and the probe on ``sids``; once each client has 3 chunks,
    ``await fault(views)``; then keep listening ``settle_s`` for late or duplicate chunks."""
    views = {
        sid: ClientView(f"{platform.ws_url}/ws/sessions/{sid}/?token={token}&codec={codec}") for sid in sids
    }
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
