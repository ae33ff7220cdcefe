"""How the worker answers the control plane's commands: applied (``acked``), ``refused`` with a
reason, or ``failed``; one answer per command id, through the ``Reporter`` port."""

from __future__ import annotations

from typing import Any

from contracts import tracing
from workers.ports import Reporter


class CommandRefused(Exception):
    """The worker does not apply this command; the reason goes back to the control plane."""


DEFERRED = object()  # the command is answered later (migrations)


class Answers:
    """The answers given, by command id: a command read again (the unacknowledged backlog after a
    restart, a redelivery) is not applied twice."""

    def __init__(self, reporter: Reporter) -> None:
        self.reporter = reporter
        self.answered: dict[str, str] = {}  # command id → status (idempotency)

    def __contains__(self, command_id: object) -> bool:
        return command_id in self.answered

    def give(
        self, command: dict[str, Any], status: str, reason: str = "", result: dict | None = None
    ) -> None:
        self.answered[command.get("id", "")] = status
        if tracing.ON and isinstance(command.get("traceparent"), str):
            attributes = {"command.id": command.get("id"), "command.status": status, "command.reason": reason}
            with tracing.span(tracing.WORKER_ANSWER, parent=command["traceparent"], attributes=attributes):
                # Recorded in PostgreSQL by the reporter's thread, as a child of this span.
                command = {**command, "traceparent": tracing.traceparent()}
                self.reporter.answer(command, status, reason, result)
        else:
            self.reporter.answer(command, status, reason, result)
