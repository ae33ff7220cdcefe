"""The viewer registry (contracts.wire.viewers) against real Redis: registrations lapse after their
TTL unless refreshed, several viewers count apart, leaving and forgetting drop them."""

from __future__ import annotations

import uuid

import pytest
import redis
from django.conf import settings

from contracts.wire.viewers import (
    VIEWER_TTL_S,
    viewer_count,
    viewer_last_seen,
    viewer_leave,
    viewer_refresh,
    viewer_register,
    viewers_forget,
)

T0 = 1_800_000_000.0


@pytest.fixture
def client():
    return redis.Redis.from_url(settings.REDIS_URL)


@pytest.fixture
def session_id():
    return str(uuid.uuid4())


def test_a_registration_lapses_after_its_ttl(client, session_id):
    viewer_register(client, session_id, "chan-a", now=T0)

    assert viewer_count(client, session_id, now=T0 + VIEWER_TTL_S - 0.1) == 1
    assert viewer_count(client, session_id, now=T0 + VIEWER_TTL_S + 0.1) == 0
    # The last sighting stays: the rule measures "no viewer since" from it.
    assert viewer_last_seen(client, session_id) == T0


def test_a_refresh_extends_the_registration_and_the_last_sighting(client, session_id):
    viewer_register(client, session_id, "chan-a", now=T0)
    viewer_refresh(client, session_id, "chan-a", now=T0 + 10)

    assert viewer_count(client, session_id, now=T0 + VIEWER_TTL_S + 5) == 1
    assert viewer_last_seen(client, session_id) == T0 + 10


def test_several_viewers_count_apart_and_leave_one_by_one(client, session_id):
    for channel in ("chan-a", "chan-b", "chan-c"):
        viewer_register(client, session_id, channel, now=T0)
    viewer_register(client, session_id, "chan-a", now=T0 + 1)  # a refresh is not a new viewer

    assert viewer_count(client, session_id, now=T0 + 2) == 3
    viewer_leave(client, session_id, "chan-b", now=T0 + 3)
    assert viewer_count(client, session_id, now=T0 + 3) == 2
    assert viewer_last_seen(client, session_id) == T0 + 3
    # Another session's viewers are not this one's.
    assert viewer_count(client, str(uuid.uuid4()), now=T0 + 3) == 0


def test_a_registration_lapses_in_redis_too(client, session_id):
    """Real time: the sorted set expires with its newest registration (no key left behind)."""
    viewer_register(client, session_id, "chan-a", ttl_s=1)

    assert 0 < client.ttl(f"ss:viewers:{session_id}") <= 2
    assert viewer_count(client, session_id) == 1


def test_forget_drops_viewers_and_the_last_sighting(client, session_id):
    viewer_register(client, session_id, "chan-a", now=T0)
    viewers_forget(client, session_id)

    assert viewer_count(client, session_id, now=T0) == 0
    assert viewer_last_seen(client, session_id) is None


def test_a_session_never_watched_has_no_sighting(client, session_id):
    assert viewer_count(client, session_id) == 0
    assert viewer_last_seen(client, session_id) is None
