"""Starting a migration (TurboServe §6.1): the record, the session's transition, both commands.

The source finishes its chunk and freezes the state (``migrate_out``); the target receives and
verifies it (``migrate_in``); ownership flips only when the target reports (``answers``).
"""

from __future__ import annotations

from django.utils import timezone

from gpu.models import GpuWorker
from scheduling.live.outbox import Outbox
from scheduling.live.state import prompt_history
from scheduling.live.worker_profiles import profile_for
from scheduling.models import Migration, SchedulerDecision
from sessions import lifecycle
from sessions.models import GenerationSession


def migration_start(
    *,
    session: GenerationSession,
    source: GpuWorker,
    target: GpuWorker,
    decision: SchedulerDecision | None,
    reason: str,
    outbox: Outbox,
    parked: bool,
) -> Migration | None:
    """Move ``session``'s state from ``source`` to ``target``. ``parked``: the state is suspended in
    ``source``'s host memory (``handoff``: it stays parked on the target; ``resume-remote``: it
    executes there once ownership flips). Returns None if the session changed meanwhile."""
    handoff = parked and reason == "handoff"
    if not handoff and not lifecycle.session_migration_start(
        session=session, source=source, target=target, reason=reason
    ):
        return None
    new_epoch = session.epoch + 1
    migration = Migration.objects.create(
        session=session,
        source=source,
        target=target,
        decision=decision,
        epoch=new_epoch,
        reason=reason,
        started_at=timezone.now(),
        state_bytes=profile_for(source.gpu_type).state_bytes,
    )
    outbox.command(
        target,
        "migrate_in",
        session=session,
        decision=decision,
        epoch=new_epoch,
        migration=migration.pk,
        source=source.name,
        prompts=prompt_history(session),
        park=handoff,
    )
    outbox.command(
        source,
        "migrate_out",
        session=session,
        decision=decision,
        epoch=session.epoch,
        new_epoch=new_epoch,
        migration=migration.pk,
        target=target.name,
        target_address=target.migration_address,
    )
    return migration
