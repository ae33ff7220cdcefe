"""The session socket as a viewer (real Redis channel layer and registry, real PostgreSQL): it
registers once accepted, refreshes while open, leaves on close; connecting to a session made idle
for ``no_viewers`` resumes it, one the user paused stays paused."""

from __future__ import annotations

import asyncio
import json

import pytest
import redis
from asgiref.sync import sync_to_async
from django.conf import settings

from contracts.wire.viewers import viewer_count, viewer_last_seen
from sessions import consumers, services
from sessions.models import GenerationSession, SessionEvent
from tests.factories import SessionFactory, UserFactory
from tests.sessions.sockets import connect_as

pytestmark = [
    pytest.mark.django_db(transaction=True),
    pytest.mark.asyncio,
    pytest.mark.usefixtures("close_thread_connections"),
]


# The leave runs in the consumer's disconnect handler: wait for it (the default is 1 s).
DISCONNECT_S = 10


@pytest.fixture
def client():
    return redis.Redis.from_url(settings.REDIS_URL)


async def a_session(user, **fields):
    return await sync_to_async(SessionFactory)(
        owner=user, activity=GenerationSession.Activity.ACTIVE, **fields
    )


async def test_a_socket_is_a_viewer_while_open_and_refreshes(client, monkeypatch):
    monkeypatch.setattr(consumers, "VIEWER_REFRESH_S", 0.2)
    user = await sync_to_async(UserFactory)()
    session = await a_session(user)
    sid = str(session.pk)

    communicator = await connect_as(user, f"/ws/sessions/{sid}/")
    await communicator.receive_from()  # status
    assert viewer_count(client, sid) == 1
    first = viewer_last_seen(client, sid)
    for _ in range(50):  # refreshed while open (every 0.2 s; polled for a loaded machine)
        await asyncio.sleep(0.1)
        if viewer_last_seen(client, sid) > first:
            break
    assert viewer_last_seen(client, sid) > first

    await communicator.disconnect(timeout=DISCONNECT_S)
    assert viewer_count(client, sid) == 0
    assert viewer_last_seen(client, sid) is not None


async def test_two_sockets_are_two_viewers(client):
    user = await sync_to_async(UserFactory)()
    session = await a_session(user)
    sid = str(session.pk)
    first = await connect_as(user, f"/ws/sessions/{sid}/")
    second = await connect_as(user, f"/ws/sessions/{sid}/")
    # The status message follows the registration (accept comes before it).
    await first.receive_from()
    await second.receive_from()
    assert viewer_count(client, sid) == 2
    await first.disconnect(timeout=DISCONNECT_S)
    assert viewer_count(client, sid) == 1
    await second.disconnect(timeout=DISCONNECT_S)
    assert viewer_count(client, sid) == 0


async def test_connecting_to_a_session_idle_for_no_viewers_resumes_it():
    user = await sync_to_async(UserFactory)()
    session = await a_session(user)
    await sync_to_async(services.session_pause)(session=session, reason="no_viewers")

    communicator = await connect_as(user, f"/ws/sessions/{session.pk}/")
    status = json.loads(await communicator.receive_from())
    assert status["type"] == "status" and status["activity"] == "active"
    await sync_to_async(session.refresh_from_db)()
    assert session.activity == "active"
    kinds = await sync_to_async(
        lambda: list(session.events.order_by("at", "id").values_list("kind", flat=True))
    )()
    assert kinds[-2:] == [SessionEvent.Kind.IDLE, SessionEvent.Kind.ACTIVE]
    await communicator.disconnect(timeout=DISCONNECT_S)


async def test_connecting_to_a_session_the_user_paused_leaves_it_paused():
    user = await sync_to_async(UserFactory)()
    session = await a_session(user)
    await sync_to_async(services.session_pause)(session=session)

    communicator = await connect_as(user, f"/ws/sessions/{session.pk}/")
    status = json.loads(await communicator.receive_from())
    assert status["activity"] == "idle"
    await communicator.disconnect(timeout=DISCONNECT_S)


async def test_a_socket_on_an_ended_session_is_no_viewer(client):
    user = await sync_to_async(UserFactory)()
    session = await a_session(user)
    await sync_to_async(services.session_terminate)(session=session)

    communicator = await connect_as(user, f"/ws/sessions/{session.pk}/")
    status = json.loads(await communicator.receive_from())
    assert status["status"] == "terminated"
    assert viewer_count(client, str(session.pk)) == 0
    await communicator.disconnect(timeout=DISCONNECT_S)
    assert viewer_last_seen(client, str(session.pk)) is None
