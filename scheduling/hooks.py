"""What happens after a session event commits: the scheduler is woken and clients are told.

Kept apart from ``sessions.services`` so the sessions app does not import Celery or Channels.
"""

from __future__ import annotations

import logging

logger = logging.getLogger(__name__)


def session_event_committed(event_id: int) -> None:
    from scheduling import live
    from sessions.models import SessionEvent

    event = SessionEvent.objects.filter(pk=event_id).select_related("session").first()
    if event is None:
        return
    session_id = str(event.session_id)
    try:
        live.broadcast_status(session_id)
    except Exception:  # a status broadcast must never fail the request that changed the session
        logger.exception("status broadcast failed session=%s", session_id)
    if event.kind == event.Kind.PROMPT:
        # The fast path: the owning worker applies it at its next chunk boundary. A scheduler run
        # follows as for every session event (prompt changes do not move sessions by themselves).
        live.prompt_forward(session_id=session_id, prompt_id=event.detail["prompt_id"])
        live.trigger_scheduler("prompt", session_id=session_id)
        return
    if event.kind == event.Kind.DEPART and event.detail.get("held_by"):
        live.session_stop(session_id=session_id, held_by=event.detail["held_by"])
    if event.kind in (event.Kind.ARRIVE, event.Kind.ACTIVE, event.Kind.IDLE, event.Kind.DEPART):
        if event.kind == event.Kind.ARRIVE:
            return  # the active event recorded with it triggers the run
        was_active = event.kind in (event.Kind.IDLE, event.Kind.DEPART) and bool(
            event.detail.get("was_active", True)
        )
        live.trigger_scheduler(event.kind, session_id=session_id, was_active=was_active)
