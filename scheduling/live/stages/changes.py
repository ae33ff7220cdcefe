"""A stage placement's role changes on the live pool: the next ones sent (never more than
``STAGE_MAX_CHANGING`` workers changing role at once), each settled by the worker's answer to
``set_role`` (``stage_change_answered``) or by the command timeout, the placement finished when its
last change ends."""

from __future__ import annotations

import logging
from datetime import datetime

from django.conf import settings
from django.db import transaction
from django.utils import timezone

from gpu.models import STAGE_ROLES, GpuWorker
from scheduling.live.enqueue import scheduler_trigger
from scheduling.live.outbox import Outbox
from scheduling.live.stages.peers import EncoderMissing, encoder_for
from scheduling.models import StagePlacement, StageRoleChange, WorkerCommand

logger = logging.getLogger("scheduling.live")

Change = StageRoleChange.Status


def progress_changes(*, preset: str, workers: dict[str, GpuWorker], now: datetime, outbox: Outbox) -> bool:
    """Settle timed-out changes, send the next ones within ``STAGE_MAX_CHANGING``, finish the
    placements whose changes all ended. Returns whether a placement is still in progress."""
    open_placements = list(
        StagePlacement.objects.select_for_update(no_key=True)
        .filter(preset=preset, status__in=[StagePlacement.Status.PLANNED, StagePlacement.Status.APPLYING])
        .order_by("created_at", "id")
    )
    if not open_placements:
        return False
    sent = list(
        StageRoleChange.objects.select_for_update(of=("self",), no_key=True)
        .filter(placement__in=open_placements, status=Change.SENT)
        .select_related("command")
    )
    for change in sent:
        command = change.command
        if command is None:
            _settle(change, status="failed", reason="its set_role command is gone", result={}, now=now)
        elif command.status != WorkerCommand.Status.SENT:
            # Normally settled by the answer itself; this catches a command the liveness check timed
            # out (no answer before COMMAND_TIMEOUT_S).
            reason = command.reason or (
                "no answer before the command timeout" if command.status == "timed_out" else ""
            )
            _settle(change, status=command.status, reason=reason, result=command.result or {}, now=now)
    in_flight = StageRoleChange.objects.filter(placement__preset=preset, status=Change.SENT).count()
    limit = settings.STREAMSERVE["STAGE_MAX_CHANGING"]
    for placement in open_placements:
        for change in (
            placement.changes.select_for_update(no_key=True).filter(status=Change.PLANNED).order_by("order")
        ):
            if in_flight >= limit:
                break
            worker = workers.get(change.worker.name)
            if worker is None or worker.status != GpuWorker.Status.READY:
                status = worker.status if worker is not None else change.worker.status
                _cancel(change, reason=f"worker is {status}", now=now)
                continue
            if worker.stage_role == change.to_role:
                _cancel(change, reason=f"worker already has role {change.to_role}", now=now)
                continue
            # A worker dropping E learns its encoder with the change: its residents' next prompts
            # are encoded there. None ready: sent without, the worker refuses if a session needs one.
            try:
                encoder = encoder_for(worker, change.to_role) if "D" in change.to_role else None
            except EncoderMissing:
                encoder = None
            extra = {"encoder": encoder} if encoder is not None else {}
            body = outbox.command(worker, WorkerCommand.Kind.SET_ROLE, role=change.to_role, **extra)
            change.status, change.sent_at, change.command_id = Change.SENT, now, body["id"]
            change.save(update_fields=["status", "sent_at", "command"])
            in_flight += 1
            if placement.status == StagePlacement.Status.PLANNED:
                placement.status = StagePlacement.Status.APPLYING
                placement.save(update_fields=["status"])
        _finish_if_done(placement, now)
    return any(p.status not in StagePlacement.ENDED for p in open_placements)


def _cancel(change: StageRoleChange, *, reason: str, now: datetime) -> None:
    change.status, change.reason, change.answered_at = Change.CANCELLED, reason[:2000], now
    change.save(update_fields=["status", "reason", "answered_at"])


def _settle(change: StageRoleChange, *, status: str, reason: str, result: dict, now: datetime) -> None:
    """The outcome of a sent change: ``acked`` → applied (the worker's role is what it answered),
    ``refused`` → refused with the worker's reason, anything else → failed."""
    if status == WorkerCommand.Status.ACKED:
        change.status = Change.APPLIED
        role = result.get("role", change.to_role)
        load_ms = result.get("load_ms")
        if isinstance(load_ms, (int, float)) and not isinstance(load_ms, bool):
            change.load_ms = float(load_ms)
        GpuWorker.objects.filter(pk=change.worker_id, status__in=GpuWorker.LIVE_STATUSES).update(
            stage_role=role if role in STAGE_ROLES else change.to_role
        )
    elif status == WorkerCommand.Status.REFUSED:
        change.status = Change.REFUSED
    else:
        change.status = Change.FAILED
    change.reason, change.answered_at = reason[:2000], now
    change.save(update_fields=["status", "reason", "load_ms", "answered_at"])


def _finish_if_done(placement: StagePlacement, now: datetime) -> None:
    statuses = list(placement.changes.values_list("status", flat=True))
    if any(s not in StageRoleChange.ENDED for s in statuses):
        return
    refused = any(s in (Change.REFUSED, Change.FAILED) for s in statuses)
    placement.status = StagePlacement.Status.PARTIAL if refused else StagePlacement.Status.APPLIED
    placement.finished_at = now
    placement.save(update_fields=["status", "finished_at"])
    logger.info("stages.placement_done id=%s status=%s", placement.pk, placement.status)


def stage_change_answered(*, command_id: str, status: str, reason: str, result: dict) -> bool:
    """A worker answered ``set_role`` (``answers.command_answered``): record it on its change, finish
    the placement when that was its last change, and ask for a tick so the next change goes out.
    Returns whether a change was waiting for this answer."""
    now = timezone.now()
    with transaction.atomic():
        change = (
            StageRoleChange.objects.select_for_update(of=("self",), no_key=True)
            .select_related("placement")
            .filter(command_id=command_id, status=Change.SENT)
            .first()
        )
        if change is None:
            return False
        _settle(change, status=status, reason=reason, result=result, now=now)
        placement = StagePlacement.objects.select_for_update(no_key=True).get(pk=change.placement_id)
        _finish_if_done(placement, now)
        transaction.on_commit(lambda: scheduler_trigger("tick"))
    return True
