"""Worker commands: a row per command inside the decision's transaction, sent after it commits.

The row is the audit record and the answer's target (``answers.command_answered``); the send goes
to the worker's durable Redis stream (``contracts.wire.channel``), so a command is never announced for a
change that rolled back, and a worker that restarts re-reads its backlog.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import cache
from typing import Any

import redis
from django.conf import settings
from django.utils import timezone

from contracts import tracing
from contracts.wire.channel import new_command, send_command
from gpu.models import GpuWorker
from scheduling.models import SchedulerDecision, WorkerCommand
from sessions.models import GenerationSession, Job

logger = logging.getLogger("scheduling.live")

# One scheduler decision at a time cluster-wide (runs and operator moves take it).
LOCK_KEY = "ss:scheduler:lock"


@cache
def redis_client() -> redis.Redis:
    return redis.Redis.from_url(settings.REDIS_URL)


def scheduler_lock():
    return redis_client().lock(LOCK_KEY, timeout=60, blocking_timeout=30)


@dataclass
class Outbox:
    """Commands prepared inside the transaction, sent after it commits; then slow follow-ups
    (provisioner calls) that must never run inside the transaction."""

    commands: list[tuple[str, dict]] = field(default_factory=list)
    after: list[Callable[[], None]] = field(default_factory=list)

    def command(
        self,
        worker: GpuWorker,
        kind: str,
        *,
        session: GenerationSession | None = None,
        job: Job | None = None,
        decision: SchedulerDecision | None = None,
        epoch: int = 0,
        **payload: Any,
    ) -> dict:
        # A job's commands name the job in place of the session (the contract of issue 14).
        subject = {"job": str(job.pk)} if job else {"session": str(session.pk) if session else None}
        body = new_command(kind, **subject, epoch=epoch, **payload)
        if tracing.ON:
            # The decision's trace, which the send (after commit) and the worker's answer continue.
            traceparent = tracing.traceparent()
            if traceparent is not None:
                body["traceparent"] = traceparent
        WorkerCommand.objects.create(
            id=body["id"],
            worker=worker,
            session=session,
            job=job,
            decision=decision,
            kind=kind,
            epoch=epoch,
            payload=body,
            created_at=timezone.now(),
        )
        self.commands.append((worker.name, body))
        return body

    def send(self) -> None:
        client = redis_client()
        for worker_name, body in self.commands:
            if tracing.ON and "traceparent" in body:
                self._send_traced(client, worker_name, body)
            else:
                send_command(client, worker_name, body)
        for action in self.after:
            try:
                action()
            except Exception:
                logger.exception("post-decision action failed")

    @staticmethod
    def _send_traced(client: redis.Redis, worker_name: str, body: dict) -> None:
        attributes = {
            "command.id": body["id"],
            "command.kind": body["kind"],
            "worker.name": worker_name,
            "session.id": body.get("session"),
            "job.id": body.get("job"),
        }
        with tracing.span(
            tracing.COMMAND_SEND, parent=body["traceparent"], kind="producer", attributes=attributes
        ):
            body["traceparent"] = tracing.traceparent()  # the worker's span is this one's child
            send_command(client, worker_name, body)
