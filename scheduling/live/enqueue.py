"""The scheduler's Celery tasks, enqueued by name.

Parts of the live loop that the tasks themselves run (answers, scaling) also need to enqueue them;
sending by name keeps the dependency one-way (tasks → live) and the route is the same, since
``CELERY_TASK_ROUTES`` matches names.
"""

from __future__ import annotations

from celery import current_app

from contracts import tracing

SCHEDULER_EVENT = "scheduling.tasks.scheduler_event"
SCHEDULER_TICK = "scheduling.tasks.scheduler_tick"
WORKER_RELEASE = "scheduling.tasks.worker_release"
JOBS_DISPATCH = "scheduling.tasks.jobs_dispatch"


def scheduler_trigger(trigger: str, session_id: str | None = None, was_active: bool = False) -> None:
    """Wake the scheduler now (TurboServe is event-driven). Traced, the event starts the decision's
    trace (or joins the request's): the task carries it in its headers (the Celery instrumentation)."""
    attributes = {"scheduler.trigger": str(trigger), "session.id": session_id}
    with tracing.span(tracing.SCHEDULER_EVENT, kind="producer", attributes=attributes):
        current_app.send_task(
            SCHEDULER_EVENT,
            kwargs={"trigger": str(trigger), "session_id": session_id, "was_active": was_active},
        )


def worker_release_enqueue(*, worker_id: int, action_id: int | None) -> None:
    current_app.send_task(WORKER_RELEASE, kwargs={"worker_id": worker_id, "action_id": action_id})


def jobs_dispatch_trigger() -> None:
    """A job was submitted, ended or re-queued: dispatch now rather than at the next tick."""
    current_app.send_task(JOBS_DISPATCH)
