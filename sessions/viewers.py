"""Sessions nobody watches (issue 31): idle after a grace period, ended after an idle timeout.

The rule, checked every 2 s by beat (``sessions.tasks.sessions_viewer_check``) for each live
session that has no viewer in the registry (``contracts.wire.viewers``):

- active, and no viewer for ``SESSION_VIEWER_GRACE_S`` → idle, its idle event's reason
  ``no_viewers`` (the scheduler then suspends it as for any idle user);
- idle, and no viewer for ``SESSION_IDLE_TIMEOUT_S`` → terminated, reason ``idle_timeout``.

"No viewer since" is measured from the latest of: the last sighting of a viewer, the moment the
session last became active (creation or resume: a session created through the API that nobody
ever watches follows the rule from its creation, and one resumed through the API gets a new
grace), and, for the timeout, the moment it went idle. A setting of 0 turns its rule off.

A viewer that connects to a session made idle for ``no_viewers`` resumes it
(``session_viewer_returned``, called by the session socket). A session the user paused stays
paused. A reconnect inside the grace changes nothing: the new sighting restarts the count.

Races: both the check and the return lock the session row, and the check counts viewers again
under the lock; the socket registers before it asks to resume. So a viewer who arrives while the
check runs is either counted (no idle) or finds the idle session and resumes it.
"""

from __future__ import annotations

import functools
import logging
from datetime import datetime
from functools import partial

import redis
from django.conf import settings
from django.db import transaction
from django.db.models import OuterRef, Subquery
from django.utils import timezone

from contracts.viewer_rule import unwatched_deadline
from contracts.wire.viewers import viewer_count, viewers_census, viewers_forget
from sessions import lifecycle, services
from sessions.models import GenerationSession, SessionEvent
from sessions.selectors import sessions_with_idle_reason

logger = logging.getLogger(__name__)

NO_VIEWERS = "no_viewers"
IDLE_TIMEOUT = "idle_timeout"

Activity = GenerationSession.Activity


@functools.cache
def viewers_client() -> redis.Redis:
    """One client (one connection pool) per process for the viewer registry."""
    return redis.Redis.from_url(settings.REDIS_URL)


def _idle_since_subquery() -> Subquery:
    return Subquery(
        SessionEvent.objects.filter(session=OuterRef("pk"), kind=SessionEvent.Kind.IDLE)
        .order_by("-at", "-id")
        .values("at")[:1]
    )


def _verdict(
    session: GenerationSession, *, idle_since: datetime | None, last_seen: float | None, now: datetime
) -> str | None:
    """``"idle"``, ``"end"`` or None for a live session that has no viewer now."""
    since = session.last_active_at or session.created_at
    if session.activity != Activity.ACTIVE and idle_since is not None:
        since = max(since, idle_since)
    due = unwatched_deadline(
        active=session.activity == Activity.ACTIVE,
        since=since.timestamp(),
        last_seen=last_seen,
        grace_s=settings.STREAMSERVE["SESSION_VIEWER_GRACE_S"],
        timeout_s=settings.STREAMSERVE["SESSION_IDLE_TIMEOUT_S"],
    )
    if due is None or due[1] > now.timestamp():
        return None
    return due[0]


def sessions_viewer_check(
    *, now: datetime | None = None, client: redis.Redis | None = None
) -> dict[str, int]:
    """Apply the viewer rule to every live session; returns how many went idle and how many ended."""
    done = {"idled": 0, "ended": 0}
    if not (settings.STREAMSERVE["SESSION_VIEWER_GRACE_S"] or settings.STREAMSERVE["SESSION_IDLE_TIMEOUT_S"]):
        return done
    now = now or timezone.now()
    client = client or viewers_client()
    live = list(
        GenerationSession.objects.filter(status__in=lifecycle.LIVE).annotate(
            idle_since=_idle_since_subquery()
        )
    )
    if not live:
        return done
    census = viewers_census(client, [str(s.pk) for s in live], now=now.timestamp())
    for session in live:
        viewers, last_seen = census[str(session.pk)]
        if viewers:
            continue
        verdict = _verdict(session, idle_since=session.idle_since, last_seen=last_seen, now=now)
        if verdict is not None and _apply(session_id=session.pk, verdict=verdict, now=now, client=client):
            done["idled" if verdict == "idle" else "ended"] += 1
    return done


@transaction.atomic
def _apply(*, session_id, verdict: str, now: datetime, client: redis.Redis) -> bool:
    """Make the verdict so if it still holds under the session's lock (a viewer may have come, the
    user may have resumed or ended it since the scan)."""
    session = (
        GenerationSession.objects.select_for_update(no_key=True)
        .filter(pk=session_id, status__in=lifecycle.LIVE)
        .first()
    )
    if session is None or viewer_count(client, str(session_id), now=now.timestamp()):
        return False
    idle_since = (
        session.events.filter(kind=SessionEvent.Kind.IDLE)
        .order_by("-at", "-id")
        .values_list("at", flat=True)
        .first()
    )
    last_seen = viewers_census(client, [str(session_id)], now=now.timestamp())[str(session_id)][1]
    if _verdict(session, idle_since=idle_since, last_seen=last_seen, now=now) != verdict:
        return False
    if verdict == "idle":
        services.session_pause(session=session, reason=NO_VIEWERS)
        logger.info("session.idle session=%s reason=%s", session_id, NO_VIEWERS)
    else:
        services.session_terminate(session=session, reason=IDLE_TIMEOUT)
        transaction.on_commit(partial(_forget, session_id=str(session_id), client=client))
        logger.info("session.end session=%s reason=%s", session_id, IDLE_TIMEOUT)
    return True


def _forget(*, session_id: str, client: redis.Redis) -> None:
    try:
        viewers_forget(client, session_id)
    except redis.RedisError:  # the keys expire on their own
        logger.exception("forgetting viewers failed session=%s", session_id)


@transaction.atomic
def session_viewer_returned(*, session_id) -> bool:
    """A viewer connected: a session made idle for ``no_viewers`` resumes (as ``resume`` does).
    Returns whether it did; a session the user paused, or one that is active or ended, is left."""
    live_idle = GenerationSession.objects.filter(
        pk=session_id, status__in=lifecycle.LIVE, activity=Activity.IDLE
    )
    session = sessions_with_idle_reason(live_idle.select_for_update(no_key=True)).first()
    if session is None or session.idle_reason != NO_VIEWERS:
        return False
    services.session_resume(session=session)
    logger.info("session.active session=%s reason=viewer_returned", session_id)
    return True
