"""The session lifecycle: every change of a session's status, and of where it runs, is one of these.

    queued → executing ⇄ suspended → terminated       (+ migrating, transiently)

Each transition is a compare-and-set on the row — ``UPDATE … WHERE pk AND status IN (from) AND
epoch = expected`` — that returns whether it applied. When it applied, the instance it was given
carries the new values and the transition has recorded its own ``SessionEvent``; the event is
announced after commit (status to the session's clients, ``session_event_committed`` to whoever
listens), so nothing is announced that did not commit. When it did not apply, nothing was written:
the caller sees ``False`` and sends no command (a stale worker answer, a session that changed
under a concurrent writer).

The epoch is the ownership number of TurboServe §6.1: a transition that moves the session to
another owner bumps it, so commands and reports of the previous owner are recognised as stale.
The transitions that take the session from a publisher — migration finish (the source has
delivered everything before it answers), recover (its worker was declared lost) and end — also
raise its publish lease in Redis after commit (``contracts.wire.channel.PublishFence``), so a previous
owner that is still running (frozen past its heartbeat timeout, then woken) can no longer publish a
chunk. Place does not: nobody publishes a waiting session, and the new owner takes the lease with
its first chunk. Suspend and hand-off bump the epoch without raising it: the suspending worker may
still be sending its last chunk, and nobody generates a parked session.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from datetime import datetime
from functools import cache, partial
from typing import Any

import redis
from django.conf import settings
from django.db import transaction
from django.utils import timezone

from contracts.wire.channel import EPOCH_ENDED, PublishFence
from gpu.models import GpuWorker
from sessions.broadcast import session_status_broadcast
from sessions.models import GenerationSession, SessionEvent
from sessions.signals import session_event_committed

logger = logging.getLogger(__name__)

Status = GenerationSession.Status
Location = GenerationSession.StateLocation
Kind = SessionEvent.Kind

PENDING = (Status.QUEUED, Status.SUSPENDED)  # active or idle, without a GPU
LIVE = (Status.QUEUED, Status.EXECUTING, Status.SUSPENDED, Status.MIGRATING)


def event_record(session: GenerationSession, kind: str, *, at: datetime | None = None, **detail: Any):
    """Record a session event; announce it once the surrounding transaction commits."""
    event = SessionEvent.objects.create(session=session, kind=kind, at=at or timezone.now(), detail=detail)
    transaction.on_commit(partial(_announce, session_id=str(session.pk), kind=kind, detail=detail))
    return event


def _announce(*, session_id: str, kind: str, detail: dict) -> None:
    try:
        session_status_broadcast(session_id=session_id)
    except Exception:  # a status broadcast must never fail the request that changed the session
        logger.exception("status broadcast failed session=%s", session_id)
    session_event_committed.send(sender=SessionEvent, session_id=session_id, kind=kind, detail=detail)


@cache
def _publish_fence() -> PublishFence:
    return PublishFence(redis.Redis.from_url(settings.REDIS_URL))


def _lease_raise(*, session_id: str, epoch: int) -> None:
    """After commit (so an epoch that rolled back never fences its real owner out). The order
    against the commands sent after the same commit does not matter: the lease only rises, and a
    new owner takes it itself on its first publish if this lands later."""
    try:
        _publish_fence().raise_to(session_id, epoch)
    except redis.RedisError:  # the session consumer still drops a stale epoch's chunks
        logger.exception("raising the publish lease failed session=%s epoch=%s", session_id, epoch)


def _transition(
    session: GenerationSession,
    kind: str,
    *,
    source: Iterable[str],
    expect_epoch: int | None = None,
    detail: dict | None = None,
    lease: int | None = None,
    **changes: Any,
) -> bool:
    """Compare-and-set ``changes`` on ``session`` if it is in ``source`` at ``expect_epoch``
    (default: the instance's epoch); on success update the instance and record ``kind``, and
    after commit raise the session's publish lease to ``lease`` if given."""
    expected = session.epoch if expect_epoch is None else expect_epoch
    applied = GenerationSession.objects.filter(pk=session.pk, status__in=list(source), epoch=expected).update(
        **changes
    )
    if not applied:
        return False
    for name, value in changes.items():
        setattr(session, name, value)
    event_record(session, kind, **(detail or {}))
    if lease is not None:
        transaction.on_commit(partial(_lease_raise, session_id=str(session.pk), epoch=lease))
    return True


def session_place(*, session: GenerationSession, worker: GpuWorker, restart: dict | None = None) -> bool:
    """A waiting session starts executing on ``worker``: fresh, resumed from that worker's host
    memory, or (``restart``: the event's detail) restarted from a checkpoint after a lost worker."""
    resumed = session.state_location == Location.HOST and session.host_worker_id == worker.pk
    return _transition(
        session,
        Kind.RESTART if restart is not None else Kind.PLACE,
        source=PENDING,
        detail=restart if restart is not None else {"worker": worker.name, "resumed": resumed},
        **_placed_on(worker, session.epoch + 1),
    )


def _placed_on(worker: GpuWorker, epoch: int) -> dict:
    return {
        "epoch": epoch,
        "status": Status.EXECUTING,
        "worker": worker,
        "host_worker": None,
        "state_location": Location.WORKER,
        "queue_position": None,
    }


def session_suspend(*, session: GenerationSession) -> bool:
    """Idle and executing → its state goes to its worker's host memory (TurboServe §3.1)."""
    worker = session.worker
    return _transition(
        session,
        Kind.SUSPEND,
        source=(Status.EXECUTING,),
        detail={"worker": worker.name if worker else None},
        epoch=session.epoch + 1,
        status=Status.SUSPENDED,
        state_location=Location.HOST,
        host_worker=worker,
        worker=None,
    )


def session_queue(*, session: GenerationSession, position: int) -> bool:
    """Active with no GPU memory left: wait at ``position`` (1 = next)."""
    return _transition(
        session,
        Kind.QUEUE,
        source=PENDING,
        detail={"position": position},
        status=Status.QUEUED,
        queue_position=position,
    )


def session_migration_start(
    *, session: GenerationSession, source: GpuWorker, target: GpuWorker, reason: str
) -> bool:
    """A migration begins (§6.1): an executing session keeps running on ``source`` until the flip;
    a parked one (state in ``source``'s host memory) waits for it. A hand-off between hosts of a
    parked state is not a status change (see ``session_handoff``)."""
    detail = {"source": source.name, "target": target.name, "reason": reason}
    if session.status == Status.EXECUTING:
        return _transition(
            session, Kind.MIGRATE, source=(Status.EXECUTING,), detail=detail, status=Status.MIGRATING
        )
    return _transition(
        session,
        Kind.MIGRATE,
        source=PENDING,
        detail=detail,
        status=Status.MIGRATING,
        worker=source,
        queue_position=None,
    )


def session_migration_finish(
    *, session: GenerationSession, target: GpuWorker, epoch: int, new_epoch: int
) -> bool:
    """§6.1 step (iii): the target verified the state; ownership flips to it at ``new_epoch``."""
    return _transition(
        session,
        Kind.MIGRATED,
        source=(Status.MIGRATING,),
        expect_epoch=epoch,
        detail={"worker": target.name, "epoch": new_epoch},
        lease=new_epoch,
        **_placed_on(target, new_epoch),
    )


def session_migration_fail(*, session: GenerationSession, parked: bool, error: str) -> bool:
    """Any failure before the flip leaves the session where it was (§6.1): executing on the
    source, or parked in the source's host memory."""
    changes: dict[str, Any] = {"status": Status.EXECUTING}
    if parked:
        changes = {"status": Status.SUSPENDED, "worker": None}
    return _transition(
        session, Kind.MIGRATE_FAILED, source=(Status.MIGRATING,), detail={"error": error[:500]}, **changes
    )


def session_handoff(*, session: GenerationSession, host: GpuWorker, epoch: int, new_epoch: int) -> bool:
    """A parked state moved to ``host``'s memory (its old host is going away)."""
    return _transition(
        session,
        Kind.HANDOFF,
        source=PENDING,
        expect_epoch=epoch,
        detail={"host": host.name, "epoch": new_epoch},
        host_worker=host,
        epoch=new_epoch,
    )


def session_requeue(*, session: GenerationSession, epoch: int, kind: str, reason: str) -> bool:
    """The worker refused a ``start`` or ``resume`` sent at ``epoch``: the session waits again, its
    state (if any) still in that worker's host memory."""
    worker = session.worker
    changes: dict[str, Any] = {"status": Status.QUEUED, "worker": None, "state_location": Location.NONE}
    if kind == "resume":
        changes.update(state_location=Location.HOST, host_worker=worker)
    return _transition(
        session,
        Kind.REQUEUE,
        source=(Status.EXECUTING,),
        expect_epoch=epoch,
        detail={"worker": worker.name if worker else None, "command": kind, "reason": reason[:500]},
        **changes,
    )


def session_recover(*, session: GenerationSession, lost: GpuWorker, has_checkpoint: bool) -> bool:
    """Its worker died: the session continues elsewhere from its checkpoint (or from the start)."""
    active = session.activity == GenerationSession.Activity.ACTIVE
    return _transition(
        session,
        Kind.RECOVER,
        source=LIVE,
        detail={"worker": lost.name, "checkpoint": has_checkpoint},
        lease=session.epoch + 1,
        epoch=session.epoch + 1,
        worker=None,
        host_worker=None,
        state_location=Location.CHECKPOINT if has_checkpoint else Location.NONE,
        status=Status.QUEUED if active else Status.SUSPENDED,
        queue_position=None,
    )


def session_end(*, session: GenerationSession, reason: str) -> bool:
    """The session departs: it forgets where it ran. The depart event names the workers that held
    its state, so they are told to free it."""
    held_by = sorted({w.name for w in (session.worker, session.host_worker) if w is not None})
    was_active = session.activity == GenerationSession.Activity.ACTIVE
    return _transition(
        session,
        Kind.DEPART,
        source=LIVE,
        detail={"reason": reason, "held_by": held_by, "was_active": was_active},
        lease=EPOCH_ENDED,
        status=Status.TERMINATED,
        activity=GenerationSession.Activity.IDLE,
        worker=None,
        host_worker=None,
        state_location=Location.NONE,
        queue_position=None,
        terminated_at=timezone.now(),
    )
