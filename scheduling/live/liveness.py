"""Lost workers and overdue answers: detect them, and continue their sessions (and re-queue their
one-shot jobs, ``jobs.jobs_recover``) elsewhere.

Run by the beat tick before each periodic decision (``scheduling.tasks.scheduler_tick``) and by a
worker that restarts under the same name (its old sessions' states are gone).
"""

from __future__ import annotations

import logging
from datetime import datetime, timedelta

import redis
from django.conf import settings
from django.db import transaction
from django.db.models import Q
from django.utils import timezone

from contracts.wire.channel import heartbeats_acknowledge, heartbeats_alive
from gpu import services as gpu_services
from gpu.models import GpuWorker
from scheduling.live.answers import migration_failed
from scheduling.live.jobs import jobs_recover
from scheduling.live.outbox import Outbox, redis_client
from scheduling.live.scaling import command_streams_prune
from scheduling.live.state import checkpoint_file
from scheduling.models import Migration, WorkerCommand
from sessions import lifecycle
from sessions.models import GenerationSession

logger = logging.getLogger("scheduling.live")

Status = GenerationSession.Status


def workers_check(*, now: datetime | None = None) -> list[str]:
    """Declare workers whose heartbeat stopped dead, and re-place their sessions. Returns their names."""
    now = now or timezone.now()
    timeout = timedelta(seconds=settings.STREAMSERVE["HEARTBEAT_TIMEOUT_S"])
    stale = list(
        GpuWorker.objects.filter(
            status__in=[GpuWorker.Status.READY, GpuWorker.Status.DRAINING], last_heartbeat__lt=now - timeout
        )
    )
    # A heartbeat row goes stale when PostgreSQL was down too (the worker could not write it):
    # a worker that still beats in Redis is alive. Lost means silent on both channels.
    try:
        beating = heartbeats_alive(redis_client(), [w.name for w in stale])
    except redis.RedisError:
        beating = set()
    if beating:
        logger.warning("worker.heartbeat_row_stale workers=%s: alive in Redis", ",".join(sorted(beating)))
    stale = [w for w in stale if w.name not in beating]
    lost = []
    for worker in stale:
        try:
            gpu_services.worker_fail(worker=worker, at=now)
        except gpu_services.TransitionError:
            continue
        lost.append(worker.name)
        logger.error("worker.lost worker=%s last_heartbeat=%s", worker.name, worker.last_heartbeat)
        sessions_recover(worker=worker)
        jobs_recover(worker=worker)
    # Workers ended by someone else (the provisioner saw the process or pod die, a release raced a
    # placement) may still be named by sessions: re-place those too.
    ended = (
        GpuWorker.objects.filter(status__in=[GpuWorker.Status.FAILED, GpuWorker.Status.RELEASED])
        .filter(Q(sessions__isnull=False) | Q(parked_sessions__isnull=False))
        .distinct()
    )
    for worker in ended:
        if sessions_recover(worker=worker):
            lost.append(worker.name)
    heartbeats_ack(now=now, timeout=timeout, beating=beating)
    commands_expire(now=now)
    command_streams_prune()
    # The parameter pool heals too: a host cache whose heartbeat stopped leaves it with its copies
    # (a lost worker's copies left with ``worker_fail`` above).
    gpu_services.host_caches_check(now=now)
    return lost


def heartbeats_ack(*, now: datetime, timeout: timedelta, beating: set[str]) -> None:
    """Acknowledge the heartbeats of the workers the control plane counts as alive: a worker that
    sees no acknowledgement (and no command) for ``WORKER_ORPHAN_TIMEOUT_S`` has lost its control
    plane, checkpoints its sessions and exits (``workers.daemon.orphan``)."""
    fresh = GpuWorker.objects.filter(
        status__in=GpuWorker.LIVE_STATUSES, last_heartbeat__gte=now - timeout
    ).values_list("name", flat=True)
    names = sorted(set(fresh) | beating)
    # Outlives a few ticks, so a slow one does not look like silence; a lost worker's key expires.
    ttl_s = max(settings.STREAMSERVE["WORKER_ORPHAN_TIMEOUT_S"], timeout.total_seconds())
    try:
        heartbeats_acknowledge(redis_client(), names, ttl_s)
    except redis.RedisError as exc:
        logger.warning("worker.heartbeat_ack failed: %s", exc)


def commands_expire(*, now: datetime) -> None:
    """Commands nobody answered in time time out; migrations nobody finished fail (§6.1: the
    session stays where it was)."""
    command_deadline = now - timedelta(seconds=settings.STREAMSERVE["COMMAND_TIMEOUT_S"])
    WorkerCommand.objects.filter(status=WorkerCommand.Status.SENT, created_at__lt=command_deadline).update(
        status=WorkerCommand.Status.TIMED_OUT
    )
    migration_deadline = now - timedelta(seconds=2 * settings.STREAMSERVE["MIGRATION_TIMEOUT_S"] + 5)
    for migration in Migration.objects.filter(
        outcome=Migration.Outcome.PENDING, started_at__lt=migration_deadline
    ):
        migration_failed(
            command={"migration": migration.pk, "session": str(migration.session_id)},
            error="no answer from the source before the deadline",
        )


@transaction.atomic
def sessions_recover(*, worker: GpuWorker) -> int:
    """A worker died: its sessions continue elsewhere from a checkpoint (or from the start)."""
    affected = GenerationSession.objects.select_for_update(no_key=True).filter(
        Q(worker=worker) | Q(host_worker=worker), ~Q(status=Status.TERMINATED)
    )
    count = 0
    outbox = Outbox()
    for session in affected:
        for migration in Migration.objects.filter(
            session=session, outcome=Migration.Outcome.PENDING
        ).select_related("target"):
            migration.outcome, migration.error = Migration.Outcome.FAILED, f"worker {worker.name} lost"
            migration.finished_at = timezone.now()
            migration.save(update_fields=["outcome", "error", "finished_at"])
            if migration.target.is_live and migration.target_id != worker.pk:
                # A copy the target may have installed is never activated: free it.
                outbox.command(migration.target, "stop", session=session, epoch=migration.epoch)
        has_checkpoint = checkpoint_file(str(session.pk)).exists()
        count += lifecycle.session_recover(session=session, lost=worker, has_checkpoint=has_checkpoint)
    transaction.on_commit(outbox.send)
    return count
