"""What workers report back: command answers, and migrations the target verified or that failed.

Called by the worker's reporter thread (``workers.adapters.reporting``), never inside a scheduler run.
"""

from __future__ import annotations

import logging

from django.db import transaction
from django.utils import timezone

from contracts import tracing
from scheduling.live.enqueue import scheduler_trigger
from scheduling.live.jobs import job_command_failed
from scheduling.live.outbox import Outbox
from scheduling.live.stages.changes import stage_change_answered
from scheduling.live.state import delivered_index
from scheduling.models import Migration, WorkerCommand
from sessions import lifecycle
from sessions.models import GenerationSession, Prompt

logger = logging.getLogger("scheduling.live")

Status = GenerationSession.Status


def command_answered(*, command: dict, status: str, reason: str, result: dict) -> None:
    """A worker answered a command; a refused start or resume puts the session back in the queue (a
    refused job command, its job: ``jobs.job_command_failed``; a ``set_role``, its stage role change:
    ``stages.stage_change_answered``). A traced command's answer ends its decision's trace."""
    if tracing.ON and command.get("traceparent"):
        attributes = {
            "command.id": command.get("id"),
            "command.kind": command.get("kind"),
            "command.status": status,
        }
        with tracing.span(tracing.COMMAND_ANSWERED, parent=command["traceparent"], attributes=attributes):
            _command_answered(command=command, status=status, reason=reason, result=result)
    else:
        _command_answered(command=command, status=status, reason=reason, result=result)


def _command_answered(*, command: dict, status: str, reason: str, result: dict) -> None:
    updated = WorkerCommand.objects.filter(pk=command["id"], status=WorkerCommand.Status.SENT).update(
        status=status, reason=reason[:2000], result=result, answered_at=timezone.now()
    )
    if updated and status == "acked" and command.get("kind") == "prompt" and "from_chunk" in result:
        # The worker applied it at its next chunk boundary, which may be later than the DB knew.
        Prompt.objects.filter(pk=command.get("prompt_id"), from_chunk__lt=result["from_chunk"]).update(
            from_chunk=result["from_chunk"]
        )
    if updated and command.get("kind") == WorkerCommand.Kind.SET_ROLE:
        # A stage role change of a placement (scheduling.live.stages.changes): applied, refused or failed.
        stage_change_answered(command_id=str(command["id"]), status=status, reason=reason, result=result)
        return
    if not updated or status == "acked":
        return
    logger.warning(
        "command.%s kind=%s session=%s reason=%s", status, command.get("kind"), command.get("session"), reason
    )
    if command.get("job"):
        job_command_failed(command=command, status=status, reason=reason)
        return
    sid = command.get("session")
    if command.get("kind") in ("migrate_out", "migrate_in") and command.get("migration") and sid:
        # Either side refused (or failed) before any state moved: the migration fails now and the
        # session goes on where it was (§6.1), instead of waiting MIGRATING for the deadline. A
        # target that refused installed nothing for it: whatever copy it holds (e.g. "already on")
        # is not this migration's to free.
        migration_failed(
            command=command,
            error=f"{command['kind']} {status}: {reason}",
            free_target=command["kind"] != "migrate_in",
        )
        return
    if command.get("kind") not in ("start", "resume") or not sid:
        return
    with transaction.atomic():
        session = (
            GenerationSession.objects.select_for_update(of=("self",), no_key=True)
            .select_related("worker")
            .filter(pk=sid)
            .first()
        )
        if session is not None and lifecycle.session_requeue(
            session=session, epoch=command.get("epoch"), kind=command["kind"], reason=reason
        ):
            transaction.on_commit(lambda: scheduler_trigger("tick"))


def migration_completed(*, command: dict, report: dict) -> None:
    """§6.1 step (iii): the target verified the state; flip ownership (epoch CAS), then activate."""
    sid, epoch, new_epoch = command["session"], int(command["epoch"]), int(command["new_epoch"])
    with transaction.atomic():
        migration = (
            Migration.objects.select_for_update(of=("self",), no_key=True)
            .select_related("target", "source")
            .get(pk=command["migration"])
        )
        session = GenerationSession.objects.select_for_update(no_key=True).get(pk=sid)
        finished = timezone.now()
        migration.finished_at = finished
        migration.duration_ms = (finished - migration.started_at).total_seconds() * 1000.0
        migration.state_bytes = report.get("bytes") or migration.state_bytes
        target = migration.target
        outbox = Outbox()
        transaction.on_commit(outbox.send)
        if migration.reason == "handoff":
            flipped = lifecycle.session_handoff(
                session=session, host=target, epoch=epoch, new_epoch=new_epoch
            )
        else:
            flipped = lifecycle.session_migration_finish(
                session=session, target=target, epoch=epoch, new_epoch=new_epoch
            )
        if not flipped:
            migration.outcome = Migration.Outcome.ABORTED
            migration.error = "session changed during the transfer"
            migration.save()
            # The copy the target installed is never activated: free it.
            outbox.command(target, "stop", session=session, epoch=new_epoch)
            return
        migration.outcome = Migration.Outcome.SUCCEEDED
        migration.save()
        if migration.cross_region:
            # A move across regions: the session is in the target region from the flip on, not
            # before (a failed move leaves it where it runs; scheduling.live.region_moves).
            session.region_id = migration.target_region_id
            session.save(update_fields=["region"])
        if migration.reason != "handoff":
            outbox.command(
                target,
                "activate",
                session=session,
                epoch=new_epoch,
                deliver_from=delivered_index(session) + 1,
            )
            if migration.reason == "resume-remote":
                outbox.command(target, "resume", session=session, epoch=new_epoch)


def migration_failed(*, command: dict, error: str, free_target: bool = True) -> None:
    """Any failure before the flip leaves the session where it was (§6.1); the target is told to
    free a copy it may have installed (``free_target``)."""
    with transaction.atomic():
        migration = (
            Migration.objects.select_for_update(of=("self",), no_key=True)
            .select_related("target")
            .get(pk=command["migration"])
        )
        if migration.outcome != Migration.Outcome.PENDING:
            return
        migration.outcome, migration.error = Migration.Outcome.FAILED, error[:2000]
        migration.finished_at = timezone.now()
        migration.duration_ms = (migration.finished_at - migration.started_at).total_seconds() * 1000.0
        migration.save()
        session = GenerationSession.objects.select_for_update(no_key=True).get(pk=command["session"])
        if session.status == Status.MIGRATING:
            lifecycle.session_migration_fail(
                session=session, parked=migration.reason in ("handoff", "resume-remote"), error=error
            )
        if free_target:
            outbox = Outbox()
            outbox.command(migration.target, "stop", session=session, epoch=migration.epoch)
            transaction.on_commit(outbox.send)
