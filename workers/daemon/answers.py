"""How the worker answers the control plane's commands: applied (``acked``), ``refused`` with a
reason, or ``failed``; one answer per command id, through the ``Reporter`` port."""

from __future__ import annotations

from typing import Any

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
        self.reporter.answer(command, status, reason, result)
