"""The viewer rule (sessions.viewers) against real PostgreSQL and Redis: a session nobody watches
goes idle after the grace (reason ``no_viewers``), ends after the idle timeout (``idle_timeout``),
and resumes when a viewer comes back; a viewer inside the grace changes nothing."""

from __future__ import annotations

from datetime import timedelta

import pytest
import redis
from django.conf import settings as django_settings
from django.utils import timezone

from contracts.wire.viewers import viewer_last_seen, viewer_leave, viewer_register
from scheduling.console import _sessions as console_sessions
from sessions import services, viewers
from sessions.models import GenerationSession, SessionEvent
from sessions.selectors import session_status_message
from tests.factories import SessionFactory, UserFactory

pytestmark = pytest.mark.django_db

GRACE_S = 30
TIMEOUT_S = 900


@pytest.fixture(autouse=True)
def rule(settings):
    settings.STREAMSERVE = {
        **settings.STREAMSERVE,
        "SESSION_VIEWER_GRACE_S": GRACE_S,
        "SESSION_IDLE_TIMEOUT_S": TIMEOUT_S,
    }


@pytest.fixture
def client():
    return redis.Redis.from_url(django_settings.REDIS_URL)


def an_active_session(at):
    return SessionFactory(activity=GenerationSession.Activity.ACTIVE, last_active_at=at)


def last_event(session, kind):
    return session.events.filter(kind=kind).order_by("-at", "-id").first()


def check(at, client):
    return viewers.sessions_viewer_check(now=at, client=client)


def test_an_unwatched_session_goes_idle_after_the_grace_with_reason_no_viewers(client):
    t0 = timezone.now()
    session = an_active_session(t0)
    viewer_register(client, str(session.pk), "chan-a", now=t0.timestamp())
    viewer_leave(client, str(session.pk), "chan-a", now=t0.timestamp() + 5)

    assert check(t0 + timedelta(seconds=5 + GRACE_S - 1), client) == {"idled": 0, "ended": 0}
    session.refresh_from_db()
    assert session.activity == "active"

    assert check(t0 + timedelta(seconds=5 + GRACE_S + 1), client) == {"idled": 1, "ended": 0}
    session.refresh_from_db()
    assert session.activity == "idle"
    assert last_event(session, SessionEvent.Kind.IDLE).detail == {"reason": "no_viewers"}


def test_the_reasons_are_in_the_status_message_and_the_console():
    t0 = timezone.now()
    watched_by_nobody, paused_by_user = an_active_session(t0), an_active_session(t0)
    watched_by_nobody = services.session_pause(session=watched_by_nobody, reason=viewers.NO_VIEWERS)
    paused_by_user = services.session_pause(session=paused_by_user)

    assert session_status_message(watched_by_nobody)["idle_reason"] == "no_viewers"
    assert session_status_message(paused_by_user)["idle_reason"] is None
    rows = {row["id"]: row for row in console_sessions()}
    assert rows[str(watched_by_nobody.pk)]["idle_reason"] == "no_viewers"
    assert rows[str(paused_by_user.pk)]["idle_reason"] is None

    ended = services.session_terminate(session=watched_by_nobody, reason=viewers.IDLE_TIMEOUT)
    assert session_status_message(ended)["reason"] == "idle_timeout"


def test_an_idle_unwatched_session_ends_after_the_timeout_with_reason_idle_timeout(
    client, django_capture_on_commit_callbacks
):
    t0 = timezone.now()
    session = an_active_session(t0)
    viewer_register(client, str(session.pk), "chan-a", now=t0.timestamp())
    viewer_leave(client, str(session.pk), "chan-a", now=t0.timestamp())
    check(t0 + timedelta(seconds=GRACE_S + 1), client)  # idle now (its idle event: real time)
    idle_at = last_event(session, SessionEvent.Kind.IDLE).at

    assert check(idle_at + timedelta(seconds=TIMEOUT_S - 1), client)["ended"] == 0
    with django_capture_on_commit_callbacks(execute=True):
        assert check(idle_at + timedelta(seconds=TIMEOUT_S + 1), client)["ended"] == 1
    session.refresh_from_db()
    assert session.status == "terminated"
    assert last_event(session, SessionEvent.Kind.DEPART).detail["reason"] == "idle_timeout"
    assert viewer_last_seen(client, str(session.pk)) is None  # forgotten once ended


def test_a_session_the_user_paused_also_ends_after_the_timeout_but_is_not_resumed_by_a_viewer(client):
    t0 = timezone.now()
    session = an_active_session(t0)
    services.session_pause(session=session)

    assert not viewers.session_viewer_returned(session_id=session.pk)
    session.refresh_from_db()
    assert session.activity == "idle"
    idle_at = last_event(session, SessionEvent.Kind.IDLE).at
    assert check(idle_at + timedelta(seconds=TIMEOUT_S - 1), client)["ended"] == 0
    assert check(idle_at + timedelta(seconds=TIMEOUT_S + 1), client)["ended"] == 1


def test_a_viewer_inside_the_grace_changes_nothing(client):
    t0 = timezone.now()
    session = an_active_session(t0)
    viewer_register(client, str(session.pk), "chan-a", now=t0.timestamp())
    viewer_leave(client, str(session.pk), "chan-a", now=t0.timestamp() + 1)
    # It reconnects 20 s later (inside the grace) and stays: refreshed, never idle.
    for second in range(21, 200, 5):
        viewer_register(client, str(session.pk), "chan-b", now=t0.timestamp() + second)
        assert check(t0 + timedelta(seconds=second + 1), client) == {"idled": 0, "ended": 0}
    session.refresh_from_db()
    assert session.activity == "active"
    assert not session.events.filter(kind=SessionEvent.Kind.IDLE).exists()


def test_a_session_created_through_the_api_and_never_watched_follows_the_rule_from_its_creation(client):
    spec = services.session_spec_build(prompt="a fox", model_name="tiny", resolution=None, seed=1)
    session = services.session_create(owner=UserFactory(), spec=spec)
    created = session.last_active_at

    assert check(created + timedelta(seconds=GRACE_S - 1), client)["idled"] == 0
    assert check(created + timedelta(seconds=GRACE_S + 1), client)["idled"] == 1
    session.refresh_from_db()
    assert session.activity == "idle"


def test_a_viewer_returning_to_a_no_viewers_idle_session_resumes_it(client):
    t0 = timezone.now()
    session = an_active_session(t0 - timedelta(seconds=GRACE_S + 5))
    check(t0, client)
    session.refresh_from_db()
    assert session.activity == "idle"

    viewer_register(client, str(session.pk), "chan-a")
    assert viewers.session_viewer_returned(session_id=session.pk)
    session.refresh_from_db()
    assert session.activity == "active"
    assert last_event(session, SessionEvent.Kind.ACTIVE).at >= t0
    # Watched now: the next checks leave it alone.
    assert check(timezone.now() + timedelta(seconds=1), client) == {"idled": 0, "ended": 0}


def test_a_zero_setting_turns_its_rule_off(client, settings):
    settings.STREAMSERVE = {**settings.STREAMSERVE, "SESSION_VIEWER_GRACE_S": 0, "SESSION_IDLE_TIMEOUT_S": 0}
    t0 = timezone.now()
    active, paused = an_active_session(t0), an_active_session(t0)
    services.session_pause(session=paused)

    assert check(t0 + timedelta(days=1), client) == {"idled": 0, "ended": 0}
    assert GenerationSession.objects.get(pk=active.pk).activity == "active"
    assert GenerationSession.objects.get(pk=paused.pk).status != "terminated"


def test_terminated_sessions_are_left_alone(client):
    t0 = timezone.now()
    session = an_active_session(t0)
    services.session_terminate(session=session)

    assert check(t0 + timedelta(days=1), client) == {"idled": 0, "ended": 0}
