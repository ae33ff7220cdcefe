"""Viewer-aware sessions on the real platform (issue 31): a socket closed and reopened inside the
grace changes nothing; closed and not reopened, the session goes idle (``no_viewers``) after the
grace; a viewer coming back resumes it and it streams again; left alone once more it goes idle and
ends after the idle timeout (``idle_timeout``). Short values: grace 2 s, timeout 4 s."""

from __future__ import annotations

import asyncio
import json
import time

import pytest
import websockets

from sessions.models import GenerationSession, SessionEvent
from tests.e2e.chaos_run import running_platform, session_create
from tests.e2e.conftest import wait_for

pytestmark = [pytest.mark.django_db]

GRACE_S = 2
TIMEOUT_S = 4


@pytest.fixture(scope="module")
def viewer_platform(django_db_setup, django_db_blocker, tmp_path_factory):
    env = {"SESSION_VIEWER_GRACE_S": str(GRACE_S), "SESSION_IDLE_TIMEOUT_S": str(TIMEOUT_S)}
    with running_platform(django_db_blocker, tmp_path_factory.mktemp("viewers"), env=env) as platform:
        yield platform


def watch(platform, session_id: str, *, chunks: int, hold_s: float, timeout: float) -> tuple[list[dict], int]:
    """Open the session's socket until ``chunks`` chunks came and ``hold_s`` passed (at most
    ``timeout``); returns its text messages and the number of chunks."""

    async def run() -> tuple[list[dict], int]:
        url = f"{platform.ws_url}/ws/sessions/{session_id}/?token={platform.tokens['user']}"
        texts: list[dict] = []
        got = 0
        start = time.monotonic()
        async with websockets.connect(url, max_size=None) as ws:
            while time.monotonic() - start < timeout:
                if got >= chunks and time.monotonic() - start >= hold_s:
                    break
                try:
                    message = await asyncio.wait_for(ws.recv(), timeout=0.5)
                except TimeoutError:
                    continue
                if isinstance(message, bytes):
                    got += 1
                else:
                    texts.append(json.loads(message))
        return texts, got

    return asyncio.run(run())


def events(session_id) -> list[tuple[str, str | None]]:
    return [
        (kind, (detail or {}).get("reason"))
        for kind, detail in SessionEvent.objects.filter(session_id=session_id)
        .order_by("at", "id")
        .values_list("kind", "detail")
        if kind in ("idle", "active", "depart")
    ]


def test_a_session_nobody_watches_goes_idle_then_ends_and_a_returning_viewer_resumes_it(viewer_platform):
    platform = viewer_platform
    sid = session_create(platform, platform.tokens["user"], seed=31)

    # Given a viewer that watched it stream
    _, got = watch(platform, sid, chunks=2, hold_s=0, timeout=180)
    assert got >= 2
    # When it reconnects inside the grace and stays for longer than the grace: nothing changes
    _, got = watch(platform, sid, chunks=1, hold_s=GRACE_S * 3, timeout=60)
    assert got >= 1
    assert events(sid) == [("active", None)]

    # When the socket closes and is not reopened: idle, reason no_viewers, after the grace
    closed = time.monotonic()
    wait_for(lambda: ("idle", "no_viewers") in events(sid), 30, message="the session idle for no_viewers")
    assert time.monotonic() - closed >= GRACE_S - 0.5  # not before the grace (clock slack)
    wait_for(lambda: GenerationSession.objects.get(pk=sid).status == "suspended", 30, message="suspended")

    # When a viewer comes back: the session resumes and streams again
    texts, got = watch(platform, sid, chunks=1, hold_s=0, timeout=90)
    assert got >= 1
    assert texts[0]["type"] == "status" and texts[0]["activity"] == "active"
    assert events(sid)[-1] == ("active", None)

    # When it leaves for good: idle again, then ended after the idle timeout
    wait_for(
        lambda: GenerationSession.objects.get(pk=sid).status == "terminated",
        GRACE_S + TIMEOUT_S + 40,
        message="the session ended",
    )
    assert events(sid) == [
        ("active", None),
        ("idle", "no_viewers"),
        ("active", None),
        ("idle", "no_viewers"),
        ("depart", "idle_timeout"),
    ]
