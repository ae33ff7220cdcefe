"""What operators ask of the scheduler by hand."""

from __future__ import annotations

from django.db import transaction

from gpu.models import GpuWorker
from scheduling.live.moves import migration_start
from scheduling.live.outbox import Outbox, scheduler_lock
from scheduling.models import Migration
from sessions.models import GenerationSession

Status = GenerationSession.Status


class MigrationRefused(Exception):
    """An operator-requested migration that cannot happen (with the reason)."""


def migration_request(*, session_id: str, target_name: str, reason: str = "operator") -> Migration:
    """Move an executing session to ``target_name`` now (at its next chunk boundary)."""
    with scheduler_lock(), transaction.atomic():
        session = (
            GenerationSession.objects.select_for_update(of=("self",), no_key=True)
            .select_related("worker")
            .get(pk=session_id)
        )
        target = GpuWorker.objects.filter(name=target_name).first()
        if session.status != Status.EXECUTING or session.worker is None:
            raise MigrationRefused(f"the session is {session.status}; only executing sessions migrate")
        if target is None or target.status != GpuWorker.Status.READY:
            raise MigrationRefused(f"worker {target_name!r} is not a ready worker")
        if target.pk == session.worker_id:
            raise MigrationRefused(f"the session already runs on {target_name}")
        if target.model_preset != session.model_name:
            raise MigrationRefused(
                f"worker {target_name} serves {target.model_preset}, not {session.model_name}"
            )
        outbox = Outbox()
        migration = migration_start(
            session=session,
            source=session.worker,
            target=target,
            decision=None,
            reason=reason,
            outbox=outbox,
            parked=False,
        )
        if migration is None:  # unreachable under the row lock; kept so a change cannot go unnoticed
            raise MigrationRefused("the session changed while the migration was being started")
        transaction.on_commit(outbox.send)
        return migration
