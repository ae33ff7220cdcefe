"""The worker's command door: the control plane's commands (a durable per-worker Redis stream,
``contracts.wire.channel``), applied at chunk boundaries, one answer each.

A command of kind ``k`` is handled by the method ``cmd_k`` (django/channels' dispatch), which checks
what concerns several parts (draining, the stage role, a migration in flight) and hands the work to
the part that owns it: the streams, the job runner, the stage role or the migration endpoint. A
handler's result is the ``acked`` answer; a `CommandRefused` (or `JobRefused`) is ``refused`` with
its reason; any other exception is ``failed``; `DEFERRED` is answered later (a migration's transfer).
A command id answered before is only acknowledged again (the backlog is re-read after a restart).
"""

from __future__ import annotations

import logging
import threading
from typing import Any

from contracts import tracing
from contracts.wire.channel import CommandReader, ReceivedCommand, claims_the_device
from workers.daemon.answers import DEFERRED, Answers, CommandRefused
from workers.daemon.jobs import JobRefused, JobRunner
from workers.daemon.migration import MigrationEndpoint
from workers.daemon.stages import StageRole
from workers.daemon.streams import Streams
from workers.runtime.stages.clients import StageUnavailable

logger = logging.getLogger("workers.daemon")


class CommandDispatcher:
    def __init__(
        self,
        *,
        name: str,
        reader: CommandReader,
        answers: Answers,
        streams: Streams,
        jobs: JobRunner,
        stage_role: StageRole,
        migration: MigrationEndpoint,
        stopping: threading.Event,
    ) -> None:
        self.name = name
        self.reader = reader
        self.answers = answers
        self.streams = streams
        self.jobs = jobs
        self.stage_role = stage_role
        self.migration = migration
        self.stopping = stopping
        self.draining = False  # after ``drain``: no new session nor job

    def apply_pending(self, block_ms: int | None) -> bool:
        """Apply what the stream holds (waiting up to ``block_ms`` for a first command)."""
        received = self.reader.read(block_ms=block_ms)
        for item in received:
            self.apply(item)
        return bool(received)

    def apply(self, item: ReceivedCommand) -> None:
        command = item.command
        command_id = command.get("id", item.entry_id)
        if command_id in self.answers:
            self.reader.ack(item.entry_id)
            return
        if tracing.ON and isinstance(command.get("traceparent"), str):
            attributes = {
                "command.id": command_id,
                "command.kind": command.get("kind"),
                "worker.name": self.name,
            }
            with tracing.span(
                tracing.WORKER_COMMAND, parent=command["traceparent"], kind="consumer", attributes=attributes
            ):
                # The answer, given now or later (a migration's), is this span's child.
                self._apply(item, {**command, "traceparent": tracing.traceparent()})
        else:
            self._apply(item, command)

    def _apply(self, item: ReceivedCommand, command: dict) -> None:
        kind = command.get("kind")
        handler = getattr(self, f"cmd_{kind}", None) if isinstance(kind, str) else None
        try:
            if handler is None:
                raise CommandRefused(f"unknown command kind {kind!r}")
            result = handler(command) or {}
        except (CommandRefused, JobRefused) as exc:
            self.answers.give(command, "refused", str(exc))
        except Exception as exc:
            logger.exception("command failed worker=%s command=%s", self.name, command)
            self.answers.give(command, "failed", f"{type(exc).__name__}: {exc}")
        else:
            if result is not DEFERRED:
                if self.jobs.abandoned is not None and claims_the_device(command):
                    # This stream's claim stopped a job step part-way: say what it cost.
                    result = result | {"job_step_abandoned": self.jobs.abandoned.as_result()}
                    self.jobs.abandoned = None
                self.answers.give(command, "acked", result=result)
        self.reader.ack(item.entry_id)

    # --- sessions (``workers.daemon.streams``) ---------------------------------------------------

    def cmd_start(self, command: dict) -> dict:
        self._admitting()
        self.stage_role.for_sessions(command)
        return self.streams.start(command)

    def cmd_prompt(self, command: dict) -> dict:
        owned = self.streams.owned(command, epoch_check=False)
        self.stage_role.for_sessions(command)
        return self.streams.prompt(owned, command)

    def cmd_suspend(self, command: dict) -> dict:
        return self.streams.suspend(command)

    def cmd_resume(self, command: dict) -> dict:
        return self.streams.resume(command)

    def cmd_stop(self, command: dict) -> dict:
        return self.streams.stop(command)

    # --- one-shot jobs (docs/jobs.md; ``workers.daemon.jobs``) -----------------------------------

    def cmd_job_run(self, command: dict) -> dict:
        self._admitting()
        self.stage_role.for_job(command)
        try:
            return self.jobs.run(command)
        except StageUnavailable as exc:
            raise CommandRefused(str(exc)) from exc

    def cmd_job_pause(self, command: dict) -> dict:
        self._job_here(command)
        return self.jobs.pause(command)

    def cmd_job_resume(self, command: dict) -> dict:
        self._job_here(command)
        return self.jobs.resume(command)

    def cmd_job_cancel(self, command: dict) -> dict:
        self._job_here(command)
        return self.jobs.cancel(command)

    # --- the stage role (``workers.daemon.stages``) ----------------------------------------------

    def cmd_set_encoder(self, command: dict) -> dict:
        return self.stage_role.set_encoder(command)

    def cmd_set_role(self, command: dict) -> dict:
        return self.stage_role.set_role(command, in_flight=self.migration.in_flight())

    # --- migration (``workers.daemon.migration``) ------------------------------------------------

    def cmd_migrate_out(self, command: dict) -> Any:
        return self.migration.migrate_out(command)

    def cmd_migrate_in(self, command: dict) -> Any:
        return self.migration.migrate_in(command)

    def cmd_activate(self, command: dict) -> dict:
        return self.migration.activate(command)

    # --- the worker's lifecycle ------------------------------------------------------------------

    def cmd_drain(self, command: dict) -> dict:
        self.draining = True
        return {"resident": len(self.streams.sessions)}

    def cmd_undrain(self, command: dict) -> dict:
        # The scheduler kept a draining worker after all (scale-out undrains paid-for GPUs first): it
        # admits sessions and jobs again. Without this the control plane's row said ready while the
        # daemon refused every start, and the scheduler assigned the same session to it again and
        # again until the worker was released.
        self.draining = False
        return {"resident": len(self.streams.sessions)}

    def cmd_shutdown(self, command: dict) -> dict:
        sessions = self.streams.sessions
        if any(o for o in sessions.values()):
            raise CommandRefused(f"{len(sessions)} session(s) still on {self.name}")
        if self.jobs.jobs:
            raise CommandRefused(f"{len(self.jobs.jobs)} job(s) still on {self.name}")
        self.stopping.set()
        return {}

    # --- checks several commands share ----------------------------------------------------------

    def _admitting(self) -> None:
        if self.draining:
            raise CommandRefused(f"worker {self.name} is draining")

    def _job_here(self, command: dict) -> None:
        if command.get("job") in self.migration.outgoing:
            raise CommandRefused(f"job {command.get('job')} is migrating")
