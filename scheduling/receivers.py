"""The scheduler's side of a committed session event (connected in ``SchedulingConfig.ready``).

Sessions announce; the scheduler listens. Events flow one way: ``sessions.lifecycle`` /
``sessions.services`` → ``session_event_committed`` → here → Celery → ``scheduling.live.run``.
"""

from __future__ import annotations

from scheduling.core.types import EventKind
from scheduling.live.enqueue import jobs_dispatch_trigger, scheduler_trigger
from scheduling.live.reactions import job_stop, prompt_forward, session_stop
from scheduling.live.regions import session_region_route

# A user's idle or depart ends an active period unless the event says otherwise.
_ACTIVITY_ENDS = (EventKind.IDLE, EventKind.DEPART)


def session_event_received(*, session_id: str, kind: str, detail: dict, **_signal) -> None:
    if kind == EventKind.PROMPT:
        # The fast path: the owning worker applies it at its next chunk boundary. A scheduler run
        # follows as for every session event (prompt changes do not move sessions by themselves).
        prompt_forward(session_id=session_id, prompt_id=detail["prompt_id"])
        scheduler_trigger(EventKind.PROMPT, session_id=session_id)
        return
    if kind == EventKind.ARRIVE:
        # The global router: a region by the plan before the ACTIVE event's run places the session.
        session_region_route(session_id=session_id)
        return
    if kind == EventKind.DEPART and detail.get("held_by"):
        session_stop(session_id=session_id, held_by=detail["held_by"])
    # ARRIVE is recorded with an ACTIVE event in the same transaction: that one triggers the run.
    # Lifecycle transitions (place, suspend, …) are the scheduler's own doing: no run.
    if kind in (EventKind.ACTIVE, EventKind.IDLE, EventKind.DEPART):
        was_active = kind in _ACTIVITY_ENDS and bool(detail.get("was_active", True))
        scheduler_trigger(kind, session_id=session_id, was_active=was_active)


def job_change_received(
    *, job_id: str, change: str, held_by: str | None = None, epoch: int = 0, **_signal
) -> None:
    """A job was submitted or re-queued (it needs a worker), ended or cancelled (it freed room)."""
    if change == "cancelled" and held_by:
        job_stop(job_id=job_id, held_by=held_by, epoch=epoch)
    jobs_dispatch_trigger()
