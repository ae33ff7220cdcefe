"""How a core ``Decision`` becomes session transitions and worker commands.

The order is the one ``scheduling.core.policy`` documents: scale out and undrain first, then
suspend, migrate, assign and queue, then drain and release. Every session change is a transition
of ``sessions.lifecycle`` (a compare-and-set that records its own event); a command is sent only
for a transition that applied.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from django.db.models import Q

from gpu import services as gpu_services
from gpu.models import GpuWorker, Region
from scheduling.core.types import Decision
from scheduling.live.moves import migration_start
from scheduling.live.outbox import Outbox
from scheduling.live.scaling import scale_in, scale_out
from scheduling.live.stages.peers import EncoderMissing, encoder_for
from scheduling.live.state import checkpoint_file, delivered_index, prompt_history
from scheduling.models import Migration, SchedulerConfig, SchedulerDecision
from sessions import lifecycle
from sessions.models import GenerationSession, Job
from sessions.services import session_terminate

Status = GenerationSession.Status
Location = GenerationSession.StateLocation


@dataclass
class Pool:
    """The rows one decision acts on, locked by the run: live workers and non-terminated sessions
    of one model preset, by name and by id. A region's decision acts on the region's workers only
    (``region``: ``None`` for the local region) and may name any session of the preset (one the
    planning re-routed into the region)."""

    preset: str
    workers: dict[str, GpuWorker]
    sessions: dict[str, GenerationSession]
    region: Region | None = None


@dataclass
class Applied:
    placements: int = 0  # sessions started, resumed, suspended or moved
    queue: int = 0  # sessions whose queue position changed, or that the full queue turned away
    # Sessions not started because their worker lacks E and no E worker is ready: session → why.
    waiting_for_encoder: dict[str, str] = field(default_factory=dict)


def decision_apply(
    *, decision: Decision, record: SchedulerDecision, pool: Pool, config: SchedulerConfig, outbox: Outbox
) -> Applied:
    """Apply ``decision``; returns what it changed."""
    workers, sessions = pool.workers, pool.sessions
    changed = 0
    queue_changes = 0
    budget = len(workers)
    # 1. Scale-out before rebalancing; undrain what the policy keeps.
    for gpu_type, count in decision.add_gpus:
        scale_out(
            decision=record,
            preset=pool.preset,
            gpu_type=gpu_type,
            count=count,
            budget=budget,
            outbox=outbox,
            region=pool.region,
        )
        budget += count
    for name in decision.undrain:
        if name in workers and workers[name].status == GpuWorker.Status.DRAINING:
            gpu_services.worker_undrain(worker=workers[name])
            # The daemon drains on its own flag: it must hear that it admits again (FIFO on its
            # command stream, so before any start this decision sends it).
            outbox.command(workers[name], "undrain", decision=record)
    # 2. Suspend idle residents to host memory (TurboServe §3.1): the state stays on that worker's host.
    for sid in decision.suspend:
        session = sessions[sid]
        worker = session.worker
        if session.status == Status.EXECUTING and lifecycle.session_suspend(session=session):
            outbox.command(worker, "suspend", session=session, decision=record, epoch=session.epoch)
            changed += 1
    # 3. Migrations between ready workers, at chunk boundaries (§6.1).
    for move in decision.migrations:
        session = sessions[move.session]
        source, target = workers.get(move.src), workers.get(move.dst)
        if (
            session.status != Status.EXECUTING
            or source is None
            or target is None
            or session.worker_id != source.pk
        ):
            continue
        if migration_start(
            session=session,
            source=source,
            target=target,
            decision=record,
            reason="rebalance",
            outbox=outbox,
            parked=False,
        ):
            changed += 1
    # 4. Assignments: start, resume from host memory (here or handed over), or restart.
    waiting_for_encoder: dict[str, str] = {}
    for sid, name in decision.assign:
        target = workers.get(name)
        if target is None or target.status != GpuWorker.Status.READY or not target.holds_sessions:
            continue
        try:
            if _assign(sessions[sid], target, record, outbox):
                changed += 1
        except EncoderMissing as exc:
            # The session keeps waiting (queued, as it was) until an E worker is ready; the decision
            # records why, and the stage planner counts it as unserved (docs/stages.md).
            waiting_for_encoder[sid] = f"waiting for an encoder: {exc}"
    # 5. Admission queue: active sessions with no GPU memory left wait, oldest first. queue_max
    # bounds admission, not the sessions already admitted: after an operator lowers it, those
    # waiting keep their turn, and only arrivals that would make the queue longer are refused.
    waiting = sum(1 for sid in decision.queue if _waiting(sessions[sid]))
    position = 0
    for sid in decision.queue:
        session = sessions[sid]
        if session.status not in (Status.QUEUED, Status.SUSPENDED):
            continue
        if not _waiting(session):
            if waiting >= config.queue_max:
                session_terminate(session=session, reason=f"queue full ({config.queue_max} waiting)")
                queue_changes += 1
                continue
            waiting += 1
        position += 1
        if session.status != Status.QUEUED or session.queue_position != position:
            queue_changes += lifecycle.session_queue(session=session, position=position)
    # 6. Drain, then release only empty workers (parked states are handed to another host first).
    # A worker holding running or paused one-shot jobs is never drained nor released: their state
    # lives in its memory (docs/jobs.md); it becomes a candidate again once they have left.
    for name in decision.drain:
        worker = workers.get(name)
        if worker is not None and worker.status == GpuWorker.Status.READY and not _holds_jobs(worker):
            gpu_services.worker_drain(worker=worker)
            outbox.command(worker, "drain", decision=record)
    for name in decision.release:
        worker = workers.get(name)
        if worker is None:
            continue
        if _holds_jobs(worker) or _hand_off_parked(worker, workers, record, outbox) or _has_residents(worker):
            continue
        scale_in(decision=record, worker=worker, budget=budget, outbox=outbox)
        budget -= 1
    return Applied(placements=changed, queue=queue_changes, waiting_for_encoder=waiting_for_encoder)


def _waiting(session: GenerationSession) -> bool:
    """Already admitted to the queue (it holds a position) rather than arriving at it."""
    return session.status == Status.QUEUED and session.queue_position is not None


def _holds_jobs(worker: GpuWorker) -> bool:
    return Job.objects.filter(worker=worker, state__in=[Job.State.RUNNING, Job.State.PAUSED]).exists()


def _has_residents(worker: GpuWorker) -> bool:
    return GenerationSession.objects.filter(
        Q(worker=worker) | Q(host_worker=worker), ~Q(status=Status.TERMINATED)
    ).exists()


def _assign(session: GenerationSession, target: GpuWorker, record: SchedulerDecision, outbox: Outbox) -> bool:
    host = session.host_worker
    if session.state_location == Location.HOST and host is not None and host.is_live:
        if host.pk == target.pk:
            if not lifecycle.session_place(session=session, worker=target):
                return False
            outbox.command(target, "resume", session=session, decision=record, epoch=session.epoch)
            return True
        # Parked on another host: hand the state over; it executes once ownership flips. Not while
        # a hand-off of that state is in flight (its source would refuse: already migrating).
        if _handing_off(session):
            return False
        return (
            migration_start(
                session=session,
                source=host,
                target=target,
                decision=record,
                reason="resume-remote",
                outbox=outbox,
                parked=True,
            )
            is not None
        )
    # A worker without E encodes the prompts on the encoder the pool chose (raises when none is ready).
    encoder = encoder_for(target)
    checkpoint = checkpoint_file(str(session.pk))
    delivered = delivered_index(session)
    restart = None
    payload = {"seed": session.seed, "prompts": prompt_history(session), "deliver_from": delivered + 1}
    if encoder is not None:
        payload["encoder"] = encoder
    if delivered >= 0:  # it ran before, on a worker that is gone: restart, from its checkpoint if any
        if checkpoint.exists():
            payload["checkpoint"] = str(checkpoint)
        restart = {"worker": target.name, "checkpoint": payload.get("checkpoint"), "resume_after": delivered}
    if not lifecycle.session_place(session=session, worker=target, restart=restart):
        return False
    outbox.command(target, "start", session=session, decision=record, epoch=session.epoch, **payload)
    return True


def _handing_off(session: GenerationSession) -> bool:
    return Migration.objects.filter(session=session, outcome=Migration.Outcome.PENDING).exists()


def _hand_off_parked(
    worker: GpuWorker, workers: dict[str, GpuWorker], record: SchedulerDecision, outbox: Outbox
) -> bool:
    """Before a worker goes, the suspended states in its host memory move to another host of the
    same region (``workers`` is the region's).

    A hand-off changes no status (the state stays parked), so a state whose hand-off is still in
    flight is recognised by its pending migration and not handed off again: every scheduler run
    until the first one finished would otherwise start another, each refused by both workers
    (the soak's migration failures, docs/benchmarks-live.md §4).
    """
    parked = list(
        GenerationSession.objects.filter(host_worker=worker, state_location=Location.HOST).exclude(
            status__in=[Status.TERMINATED, Status.MIGRATING]
        )
    )
    if not parked:
        return False
    parked = [session for session in parked if not _handing_off(session)]
    if not parked:
        return True  # hand-offs in flight: keep the worker until they finish
    hosts = [w for w in workers.values() if w.status == GpuWorker.Status.READY and w.pk != worker.pk]
    if not hosts:
        return True  # nowhere to go yet: keep the worker
    for i, session in enumerate(parked):
        migration_start(
            session=session,
            source=worker,
            target=hosts[i % len(hosts)],
            decision=record,
            reason="handoff",
            outbox=outbox,
            parked=True,
        )
    return True
