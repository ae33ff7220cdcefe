"""`/ws/console/`: staff receive periodic cluster snapshots; everyone else is refused."""

from __future__ import annotations

import pytest
from asgiref.sync import async_to_sync
from channels.testing import WebsocketCommunicator
from django.contrib.auth.models import AnonymousUser
from django.core.cache import cache

from scheduling.console import snapshot_cache_key
from scheduling.consumers import FORBIDDEN, ConsoleConsumer
from tests.factories import GpuWorkerFactory, SessionFactory, StaffFactory, UserFactory

pytestmark = pytest.mark.django_db(transaction=True)


@pytest.fixture(autouse=True)
def in_memory_layer(settings):
    # A unit test of one consumer: the in-memory layer is enough (the browser tests use Redis).
    settings.CHANNEL_LAYERS = {"default": {"BACKEND": "channels.layers.InMemoryChannelLayer"}}


@pytest.fixture(autouse=True)
def no_shared_snapshot():
    # Periodic pushes share a snapshot through the cache for a second; start each test without one.
    cache.delete(snapshot_cache_key())


async def _connect(user):
    communicator = WebsocketCommunicator(ConsoleConsumer.as_asgi(), "/ws/console/")
    communicator.scope["user"] = user
    connected, code = await communicator.connect()
    return communicator, connected, code


@pytest.mark.parametrize(
    "make_user", [lambda: AnonymousUser(), lambda: UserFactory()], ids=["anonymous", "user"]
)
def test_non_staff_are_refused(make_user):
    user = make_user()

    async def scenario():
        communicator, connected, code = await _connect(user)
        await communicator.disconnect()
        return connected, code

    connected, code = async_to_sync(scenario)()
    assert not connected and code == FORBIDDEN


def test_staff_receive_snapshots_that_follow_the_cluster():
    staff = StaffFactory()
    worker = GpuWorkerFactory(name="gpu-a")

    async def first_snapshot(communicator):
        message = await communicator.receive_json_from(timeout=10)
        assert message["type"] == "snapshot"
        return message["snapshot"]

    async def scenario():
        from channels.db import database_sync_to_async

        communicator, connected, _ = await _connect(staff)
        assert connected
        before = await first_snapshot(communicator)
        await database_sync_to_async(
            lambda: SessionFactory(status="executing", worker=worker, state_location="worker")
        )()
        await communicator.send_json_to({"type": "refresh"})
        # The refresh answers at once; a periodic push taken before the insert may still be queued.
        for _ in range(3):
            after = await first_snapshot(communicator)
            if after["sessions"]["active"]:
                break
        await communicator.send_json_to({"type": "drain"})
        error = await communicator.receive_json_from(timeout=10)
        while error["type"] == "snapshot":  # a periodic push may come first
            error = await communicator.receive_json_from(timeout=10)
        await communicator.disconnect()
        return before, after, error

    before, after, error = async_to_sync(scenario)()
    assert [w["name"] for w in before["workers"]] == ["gpu-a"]
    assert before["sessions"]["active"] == 0
    assert after["sessions"]["active"] == 1 and after["workers"][0]["sessions"] == 1
    assert error == {"type": "error", "code": "bad_message", "detail": "only refresh is accepted"}
