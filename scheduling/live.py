"""The scheduler on live state: snapshot from PostgreSQL → ``scheduling.core`` → commands to workers.

``scheduler_run`` is what the Celery tasks call, one run at a time cluster-wide (a Redis lock).
It builds the same ``Snapshot`` the simulator builds, asks the same policy object (its internal
state persisted between runs), records the decision with its inputs, turns the decision into
session-row changes and worker commands in one transaction, and sends the commands after commit.

The other functions here are the control plane's answers to what workers report: command answers,
completed or failed migrations (the ownership flip of TurboServe §6.1 step iii), lost workers.
"""

from __future__ import annotations

import logging
import time
import uuid
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from functools import cache
from pathlib import Path
from typing import Any

import redis
from django.conf import settings
from django.db import transaction
from django.db.models import Max, Q
from django.utils import timezone

from gpu import services as gpu_services
from gpu.models import GpuWorker
from scheduling.core.policy import make_policy
from scheduling.core.profiles import load_profile
from scheduling.core.types import Event, GpuTypeSpec, GpuView, SessionView, Snapshot
from scheduling.models import (
    Migration,
    ScalingAction,
    SchedulerConfig,
    SchedulerDecision,
    SchedulerState,
    WorkerCommand,
)
from sessions.models import GenerationSession, SessionEvent
from workers.channel import delivered_key, new_command, send_command

logger = logging.getLogger("scheduling.live")

Status = GenerationSession.Status
Location = GenerationSession.StateLocation
LOCK_KEY = "ss:scheduler:lock"
POLICY_EVENTS = {"arrive", "active", "idle", "depart", "tick", "gpu_ready", "gpu_failed"}


@cache
def redis_client() -> redis.Redis:
    return redis.Redis.from_url(settings.REDIS_URL)


@cache
def gpu_profiles() -> dict[str, GpuTypeSpec]:
    """Scheduler profiles of the worker types, keyed by ``GpuWorker.gpu_type``."""
    specs = [
        load_profile(part.strip())
        for part in settings.STREAMSERVE["WORKER_PROFILE"].split(",")
        if part.strip()
    ]
    return {spec.gpu_type: spec for spec in specs}


def default_gpu_type() -> str:
    return next(iter(gpu_profiles()))


def checkpoint_path(session_id: str) -> Path:
    return Path(settings.STREAMSERVE["CHECKPOINT_DIR"]) / f"{session_id}.safetensors"


# --- the run ---------------------------------------------------------------------------------


@dataclass
class _Outbox:
    """Commands and broadcasts prepared inside the transaction, sent after it commits."""

    commands: list[tuple[str, dict]] = field(default_factory=list)
    statuses: set[str] = field(default_factory=set)
    after: list = field(default_factory=list)  # provisioner calls: slow I/O, never inside the transaction

    def command(
        self,
        worker: GpuWorker,
        kind: str,
        *,
        session: GenerationSession | None = None,
        decision: SchedulerDecision | None = None,
        epoch: int = 0,
        **payload: Any,
    ) -> dict:
        body = new_command(kind, session=str(session.pk) if session else None, epoch=epoch, **payload)
        WorkerCommand.objects.create(
            id=body["id"],
            worker=worker,
            session=session,
            decision=decision,
            kind=kind,
            epoch=epoch,
            payload=body,
            created_at=timezone.now(),
        )
        self.commands.append((worker.name, body))
        return body

    def send(self) -> None:
        client = redis_client()
        for worker_name, body in self.commands:
            send_command(client, worker_name, body)
        for session_id in self.statuses:
            broadcast_status(session_id)
        for action in self.after:
            try:
                action()
            except Exception:
                logger.exception("post-decision action failed")


def scheduler_run(*, trigger: str, session_id: str | None = None, was_active: bool = False) -> list[int]:
    """One closed-loop decision per served model pool; returns the decision ids."""
    with redis_client().lock(LOCK_KEY, timeout=60, blocking_timeout=30):
        decisions = []
        for preset in settings.STREAMSERVE["SERVED_MODELS"]:
            decision = _run_pool(preset=preset, trigger=trigger, session_id=session_id, was_active=was_active)
            if decision is not None:
                decisions.append(decision)
        return decisions


def _session_view(session: GenerationSession, spec: GpuTypeSpec, now: float, placed_at: dict) -> SessionView:
    """``since`` is when the session entered its current state: its last placement on a GPU (which
    the policy's minimum-residency rule reads) or, waiting, its activation (queue order)."""
    if session.status in (Status.EXECUTING, Status.MIGRATING):
        state, gpu = "executing", session.worker.name
        entered = placed_at.get(session.pk) or session.last_active_at or session.created_at
    elif session.status == Status.SUSPENDED:
        state, gpu = "suspended", None
        entered = session.last_active_at or session.created_at
    else:
        state, gpu = "queued", None
        entered = session.last_active_at or session.created_at
    return SessionView(
        id=str(session.pk),
        alpha=int(session.activity == GenerationSession.Activity.ACTIVE),
        state=state,
        load=session.load,
        gpu=gpu,
        state_bytes=int(spec.state_bytes * session.load),
        since=min(entered.timestamp(), now),
    )


def _run_pool(*, preset: str, trigger: str, session_id: str | None, was_active: bool) -> int | None:
    started = time.perf_counter()
    outbox = _Outbox()
    with transaction.atomic():
        config = SchedulerConfig.load()
        profiles = gpu_profiles()
        now = timezone.now()
        clock = now.timestamp()
        workers = {
            w.name: w
            # FOR NO KEY UPDATE: chunk-record inserts (FK checks take KEY SHARE) never wait on it.
            # Rows are locked in primary-key order, like every other multi-row locker, so no deadlock.
            for w in GpuWorker.objects.select_for_update(no_key=True)
            .filter(model_preset=preset, status__in=GpuWorker.LIVE_STATUSES)
            .order_by("pk")
        }
        sessions = {
            str(s.pk): s
            for s in GenerationSession.objects.select_for_update(of=("self",), no_key=True)
            .select_related("worker", "host_worker")
            .filter(model_name=preset)
            .exclude(status=Status.TERMINATED)
            .order_by("pk")
        }
        if session_id is not None and session_id not in sessions and trigger != "depart":
            session_id = None
        spec = profiles[default_gpu_type()]
        placed_at = dict(
            WorkerCommand.objects.filter(
                session_id__in=[
                    s.pk for s in sessions.values() if s.status in (Status.EXECUTING, Status.MIGRATING)
                ],
                kind__in=["start", "resume", "activate"],
            )
            .values("session_id")
            .annotate(last=Max("created_at"))
            .values_list("session_id", "last")
        )
        views = [
            _session_view(s, profiles.get(s.worker.gpu_type, spec) if s.worker else spec, clock, placed_at)
            for s in sessions.values()
        ]
        snapshot = Snapshot.build(
            time=clock,
            sessions=views,
            gpus=[
                GpuView(
                    id=w.name,
                    gpu_type=w.gpu_type if w.gpu_type in profiles else default_gpu_type(),
                    status=w.status,
                    ready_at=w.ready_at.timestamp() if w.ready_at else None,
                    requested_at=w.requested_at.timestamp(),
                )
                for w in workers.values()
            ],
            gpu_types=profiles,
            min_gpus=config.min_gpus,
            max_gpus=config.max_gpus,
        )
        kind = trigger if trigger in POLICY_EVENTS else "tick"
        event = Event(time=clock, kind=kind, session=session_id, was_active=was_active)
        state_row, _ = SchedulerState.objects.select_for_update(no_key=True).get_or_create(
            policy=f"{config.policy}@{preset}"
        )
        options: dict[str, Any] = {"cooldown_s": config.scale_in_cooldown_s}
        if config.target_utilization is not None:
            options["rho_hat"] = config.target_utilization
        policy = make_policy(config.policy, **options)
        if state_row.state:
            policy.load_state_dict(state_row.state)
        decision = policy.decide(snapshot, event)
        state_row.state = policy.state_dict()
        state_row.save(update_fields=["state", "updated_at"])
        record = SchedulerDecision.objects.create(
            trigger=trigger if trigger in SchedulerDecision.Trigger.values else "tick",
            session=sessions.get(session_id) if session_id else None,
            decided_at=now,
            policy=config.policy,
            active_sessions=sum(v.alpha for v in snapshot.sessions.values()),
            budget=len(workers),
            rho_max=decision.signals.rho_max,
            volatility=decision.signals.volatility,
            volatility_level=decision.signals.volatility_level,
            lambda_weight=decision.signals.lam,
            rho_hat=decision.signals.rho_hat,
            target_budget=decision.target_budget,
            duration_ms=0.0,
            inputs={
                "preset": preset,
                "event": {"kind": kind, "session": session_id},
                "sessions": len(snapshot.sessions),
                "pending": list(snapshot.pending),
                "gpus": {
                    g: {"status": v.status, "load": snapshot.gpu_load[g]} for g, v in snapshot.gpus.items()
                },
            },
            outputs=decision.to_json(),
        )
        changed = _apply(decision, record, preset, workers, sessions, config, outbox)
        acted = changed or decision.add_gpus or decision.drain or decision.undrain or decision.release
        if kind == "tick" and not acted and not outbox.commands and not outbox.statuses:
            # Periodic ticks that change nothing are not history: keep the table to real decisions.
            record.delete()
            transaction.on_commit(outbox.send)
            return None
        record.placements_changed = changed
        record.duration_ms = (time.perf_counter() - started) * 1000.0
        record.save(update_fields=["placements_changed", "duration_ms"])
        transaction.on_commit(outbox.send)
    logger.info(
        "scheduler.decision id=%s preset=%s trigger=%s sessions=%d gpus=%d target=%d changed=%d ms=%.2f",
        record.pk,
        preset,
        trigger,
        len(sessions),
        len(workers),
        decision.target_budget,
        changed,
        record.duration_ms,
    )
    return record.pk


def _apply(decision, record, preset, workers, sessions, config, outbox: _Outbox) -> int:
    """Turn a core ``Decision`` into row changes and commands, in the order the core documents."""
    changed = 0
    now = timezone.now()
    budget = len(workers)
    # 1. Scale-out before rebalancing; undrain what the policy keeps.
    for gpu_type, count in decision.add_gpus:
        _scale_out(record, preset, gpu_type, count, budget, outbox)
        budget += count
    for name in decision.undrain:
        if name in workers and workers[name].status == GpuWorker.Status.DRAINING:
            gpu_services.worker_undrain(worker=workers[name])
    # 2. Suspend idle residents to host memory (TurboServe §3.1): the state stays on that worker's host.
    for sid in decision.suspend:
        session = sessions[sid]
        if session.status != Status.EXECUTING:
            continue
        worker = session.worker
        session.epoch += 1
        session.status, session.state_location = Status.SUSPENDED, Location.HOST
        session.host_worker, session.worker = worker, None
        session.save(update_fields=["epoch", "status", "state_location", "host_worker", "worker"])
        outbox.command(worker, "suspend", session=session, decision=record, epoch=session.epoch)
        outbox.statuses.add(sid)
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
        _start_migration(session, source, target, record, "rebalance", outbox, parked=False)
        changed += 1
    # 4. Assignments: start, resume from host memory (here or handed over), or restart.
    for sid, name in decision.assign:
        session, target = sessions[sid], workers.get(name)
        if target is None or target.status != GpuWorker.Status.READY:
            continue
        _assign(session, target, record, outbox)
        changed += 1
    # 5. Admission queue: active sessions with no GPU memory left wait, oldest first.
    position = 0
    for sid in decision.queue:
        session = sessions[sid]
        if session.status not in (Status.QUEUED, Status.SUSPENDED):
            continue
        position += 1
        if position > config.queue_max:
            from sessions.services import session_terminate

            session_terminate(session=session, reason=f"queue full ({config.queue_max} waiting)")
            outbox.statuses.add(sid)
            continue
        if session.status != Status.QUEUED or session.queue_position != position:
            session.status, session.queue_position = Status.QUEUED, position
            session.save(update_fields=["status", "queue_position"])
            outbox.statuses.add(sid)
    # 6. Drain, then release only empty workers (parked states are handed to another host first).
    for name in decision.drain:
        worker = workers.get(name)
        if worker is not None and worker.status == GpuWorker.Status.READY:
            gpu_services.worker_drain(worker=worker)
            outbox.command(worker, "drain", decision=record)
    for name in decision.release:
        worker = workers.get(name)
        if worker is None:
            continue
        if _hand_off_parked(worker, workers, record, outbox) or _has_residents(worker):
            continue
        _scale_in(record, worker, budget, outbox)
        budget -= 1
    del now
    return changed


def _has_residents(worker: GpuWorker) -> bool:
    return GenerationSession.objects.filter(
        Q(worker=worker) | Q(host_worker=worker), ~Q(status=Status.TERMINATED)
    ).exists()


def _scale_out(record, preset: str, gpu_type: str, count: int, budget: int, outbox: _Outbox) -> None:
    """Record the scale-out now; ask the provisioner right after commit, still under the scheduler
    lock, so the next decision already sees the new workers as provisioning."""
    action = ScalingAction.objects.create(
        decision=record,
        created_at=timezone.now(),
        direction="out",
        from_budget=budget,
        to_budget=budget + count,
        gpu_type=gpu_type,
        reason=f"ρ_max={record.rho_max:.2f} vs ρ̂={record.rho_hat:.2f}; target {record.target_budget}",
    )
    outbox.after.append(lambda: provision(action_id=action.pk, preset=preset, gpu_type=gpu_type, count=count))


def provision(*, action_id: int, preset: str, gpu_type: str, count: int) -> None:
    from gpu.provisioners.registry import get_provisioner

    action = ScalingAction.objects.get(pk=action_id)
    try:
        spec = gpu_profiles()[gpu_type]
        result = get_provisioner().request(
            count=count,
            gpu_type=gpu_type,
            preset=preset,
            capacity=max(1, int(spec.capacity)),
            price_per_hour=spec.price_per_hour,
        )
    except Exception as exc:
        logger.exception("scale-out failed")
        action.outcome, action.provisioner_result = "failed", {"error": str(exc)}
        action.save(update_fields=["outcome", "provisioner_result"])
        return
    action.provisioner_result = result.as_dict()
    action.outcome = "requested" if result.ok else "failed"
    action.save(update_fields=["outcome", "provisioner_result"])
    action.workers.set(result.worker_ids)


def _scale_in(record, worker: GpuWorker, budget: int, outbox: _Outbox) -> None:
    """Scale-in: the (empty) worker stops taking sessions now; a Celery task stops its process,
    which may take a grace period, outside the scheduler's transaction and lock."""
    from scheduling.tasks import worker_release

    action = ScalingAction.objects.create(
        decision=record,
        created_at=timezone.now(),
        direction="in",
        from_budget=budget,
        to_budget=budget - 1,
        gpu_type=worker.gpu_type,
        reason=f"consolidated; ρ_max={record.rho_max:.2f} vs ρ̂={record.rho_hat:.2f}",
    )
    action.workers.set([worker.pk])
    if worker.status == GpuWorker.Status.READY:
        gpu_services.worker_drain(worker=worker)
    outbox.after.append(lambda: worker_release.delay(worker_id=worker.pk, action_id=action.pk))


def release(*, worker_id: int, action_id: int | None) -> None:
    from gpu.provisioners.registry import get_provisioner

    worker = GpuWorker.objects.get(pk=worker_id)
    action = ScalingAction.objects.filter(pk=action_id).first()
    # Ask the daemon to exit by itself first (a hand-started worker has no process to stop).
    outbox = _Outbox()
    outbox.command(worker, "shutdown")
    outbox.send()
    try:
        result = get_provisioner(worker.provider).release(worker)
        outcome, details = ("succeeded" if result.ok else "failed"), result.as_dict()
    except Exception as exc:
        logger.exception("scale-in failed worker=%s", worker.name)
        outcome, details = "failed", {"error": str(exc)}
    if action is not None:
        action.outcome, action.provisioner_result = outcome, details
        action.save(update_fields=["outcome", "provisioner_result"])


def _prompts(session: GenerationSession) -> list[list]:
    return [[p.from_chunk, p.text] for p in session.prompts.order_by("from_chunk", "id")]


def _delivered(session: GenerationSession) -> int:
    raw = redis_client().get(delivered_key(str(session.pk)))
    return max(session.delivered_index, int(raw) if raw is not None else -1)


def _start_migration(session, source, target, record, reason, outbox: _Outbox, *, parked: bool) -> Migration:
    new_epoch = session.epoch + 1
    migration = Migration.objects.create(
        session=session,
        source=source,
        target=target,
        decision=record,
        epoch=new_epoch,
        reason=reason,
        started_at=timezone.now(),
        state_bytes=gpu_profiles().get(source.gpu_type, gpu_profiles()[default_gpu_type()]).state_bytes,
    )
    if not parked:
        session.status = Status.MIGRATING
        session.save(update_fields=["status"])
        outbox.statuses.add(str(session.pk))
    outbox.command(
        target,
        "migrate_in",
        session=session,
        decision=record,
        epoch=new_epoch,
        migration=migration.pk,
        source=source.name,
        prompts=_prompts(session),
        park=parked and reason == "handoff",
    )
    outbox.command(
        source,
        "migrate_out",
        session=session,
        decision=record,
        epoch=session.epoch,
        new_epoch=new_epoch,
        migration=migration.pk,
        target=target.name,
        target_address=target.migration_address,
    )
    return migration


def _assign(session: GenerationSession, target: GpuWorker, record, outbox: _Outbox) -> None:
    sid = str(session.pk)
    host = session.host_worker
    if session.state_location == Location.HOST and host is not None and host.is_live:
        if host.pk == target.pk:
            session.epoch += 1
            session.status, session.worker, session.host_worker = Status.EXECUTING, target, None
            session.state_location, session.queue_position = Location.WORKER, None
            session.save(
                update_fields=["epoch", "status", "worker", "host_worker", "state_location", "queue_position"]
            )
            outbox.command(target, "resume", session=session, decision=record, epoch=session.epoch)
        else:
            # Parked on another host: hand the state over; it executes once ownership flips.
            session.status, session.worker, session.queue_position = Status.MIGRATING, host, None
            session.save(update_fields=["status", "worker", "queue_position"])
            _start_migration(session, host, target, record, "resume-remote", outbox, parked=True)
        outbox.statuses.add(sid)
        return
    checkpoint = checkpoint_path(sid)
    delivered = _delivered(session)
    restart = delivered >= 0
    session.epoch += 1
    session.status, session.worker, session.host_worker = Status.EXECUTING, target, None
    session.state_location, session.queue_position = Location.WORKER, None
    session.save(
        update_fields=["epoch", "status", "worker", "host_worker", "state_location", "queue_position"]
    )
    payload = {"seed": session.seed, "prompts": _prompts(session), "deliver_from": delivered + 1}
    if restart and checkpoint.exists():
        payload["checkpoint"] = str(checkpoint)
    if restart:
        SessionEvent.objects.create(
            session=session,
            kind=SessionEvent.Kind.RESTART,
            at=timezone.now(),
            detail={
                "worker": target.name,
                "checkpoint": payload.get("checkpoint"),
                "resume_after": delivered,
            },
        )
    outbox.command(target, "start", session=session, decision=record, epoch=session.epoch, **payload)
    outbox.statuses.add(sid)


def _hand_off_parked(worker: GpuWorker, workers: dict[str, GpuWorker], record, outbox: _Outbox) -> bool:
    """Before a worker goes, the suspended states in its host memory move to another host."""
    parked = list(
        GenerationSession.objects.filter(host_worker=worker, state_location=Location.HOST).exclude(
            status__in=[Status.TERMINATED, Status.MIGRATING]
        )
    )
    if not parked:
        return False
    hosts = [w for w in workers.values() if w.status == GpuWorker.Status.READY and w.pk != worker.pk]
    if not hosts:
        return True  # nowhere to go yet: keep the worker
    for i, session in enumerate(parked):
        target = hosts[i % len(hosts)]
        _start_migration(session, worker, target, record, "handoff", outbox, parked=True)
    return True


# --- what workers report ---------------------------------------------------------------------


def command_answered(*, command: dict, status: str, reason: str, result: dict) -> None:
    """A worker answered a command; failed placements go back to the scheduler."""
    updated = WorkerCommand.objects.filter(pk=command["id"], status=WorkerCommand.Status.SENT).update(
        status=status, reason=reason[:2000], result=result, answered_at=timezone.now()
    )
    if updated and status == "acked" and command.get("kind") == "prompt" and "from_chunk" in result:
        from sessions.models import Prompt

        # The worker applied it at its next chunk boundary, which may be later than the DB knew.
        Prompt.objects.filter(pk=command.get("prompt_id"), from_chunk__lt=result["from_chunk"]).update(
            from_chunk=result["from_chunk"]
        )
    if not updated or status == "acked":
        return
    logger.warning(
        "command.%s kind=%s session=%s reason=%s", status, command.get("kind"), command.get("session"), reason
    )
    sid = command.get("session")
    if command.get("kind") in ("start", "resume") and sid:
        with transaction.atomic():
            moved = GenerationSession.objects.filter(
                pk=sid, epoch=command.get("epoch"), status=Status.EXECUTING
            ).update(
                status=Status.QUEUED,
                worker=None,
                state_location=Location.NONE if command["kind"] == "start" else Location.HOST,
            )
        if moved:
            transaction.on_commit(lambda: trigger_scheduler("tick"))


def migration_completed(*, command: dict, report: dict) -> None:
    """§6.1 step (iii): the target verified the state; flip ownership (epoch CAS), then activate."""
    sid, new_epoch = command["session"], int(command["new_epoch"])
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
        if session.status == Status.TERMINATED or session.epoch != int(command["epoch"]):
            migration.outcome, migration.error = (
                Migration.Outcome.ABORTED,
                "session changed during the transfer",
            )
            migration.save()
            _Outbox().command(target, "stop", session=session, epoch=new_epoch)
            return
        migration.outcome = Migration.Outcome.SUCCEEDED
        migration.save()
        outbox = _Outbox()
        if migration.reason == "handoff":
            session.host_worker, session.epoch = target, new_epoch
            session.save(update_fields=["host_worker", "epoch"])
        else:
            session.epoch = new_epoch
            session.status, session.worker, session.host_worker = Status.EXECUTING, target, None
            session.state_location = Location.WORKER
            session.save(update_fields=["epoch", "status", "worker", "host_worker", "state_location"])
            outbox.command(
                target, "activate", session=session, epoch=new_epoch, deliver_from=_delivered(session) + 1
            )
            if migration.reason == "resume-remote":
                outbox.command(target, "resume", session=session, epoch=new_epoch)
        outbox.statuses.add(sid)
        transaction.on_commit(outbox.send)


def migration_failed(*, command: dict, error: str) -> None:
    """Any failure before the flip leaves the session where it was (§6.1)."""
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
        outbox = _Outbox()
        if session.status == Status.MIGRATING:
            if migration.reason not in ("handoff", "resume-remote"):
                session.status = Status.EXECUTING
            else:  # the parked state stays in the source's host memory
                session.status, session.worker = Status.SUSPENDED, None
            session.save(update_fields=["status", "worker"])
            outbox.statuses.add(str(session.pk))
        outbox.command(migration.target, "stop", session=session, epoch=migration.epoch)
        transaction.on_commit(outbox.send)


def workers_check(*, now: datetime | None = None) -> list[str]:
    """Declare workers whose heartbeat stopped dead, and re-place their sessions. Returns their names."""
    now = now or timezone.now()
    timeout = timedelta(seconds=settings.STREAMSERVE["HEARTBEAT_TIMEOUT_S"])
    stale = list(
        GpuWorker.objects.filter(
            status__in=[GpuWorker.Status.READY, GpuWorker.Status.DRAINING], last_heartbeat__lt=now - timeout
        )
    )
    lost = []
    for worker in stale:
        try:
            gpu_services.worker_fail(worker=worker, at=now)
        except gpu_services.TransitionError:
            continue
        lost.append(worker.name)
        logger.error("worker.lost worker=%s last_heartbeat=%s", worker.name, worker.last_heartbeat)
        sessions_recover(worker=worker)
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
    # Commands nobody answered in time.
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
    return lost


@transaction.atomic
def sessions_recover(*, worker: GpuWorker) -> int:
    """A worker died: its sessions continue elsewhere from a checkpoint (or from the start)."""
    affected = GenerationSession.objects.select_for_update(no_key=True).filter(
        Q(worker=worker) | Q(host_worker=worker), ~Q(status=Status.TERMINATED)
    )
    count = 0
    outbox = _Outbox()
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
        session.epoch += 1
        session.worker = session.host_worker = None
        session.state_location = (
            Location.CHECKPOINT if checkpoint_path(str(session.pk)).exists() else Location.NONE
        )
        session.status = (
            Status.QUEUED if session.activity == GenerationSession.Activity.ACTIVE else Status.SUSPENDED
        )
        session.save(update_fields=["epoch", "worker", "host_worker", "state_location", "status"])
        outbox.statuses.add(str(session.pk))
        count += 1
    transaction.on_commit(outbox.send)
    return count


def prompt_forward(*, session_id: str, prompt_id: int) -> None:
    """A new prompt goes to whoever holds the session (both ends while it migrates)."""
    from sessions.models import Prompt

    session = GenerationSession.objects.select_related("worker", "host_worker").get(pk=session_id)
    prompt = Prompt.objects.get(pk=prompt_id)
    outbox = _Outbox()
    holders = [w for w in (session.worker, session.host_worker) if w is not None]
    if session.status == Status.MIGRATING:
        pending = Migration.objects.filter(session=session, outcome=Migration.Outcome.PENDING).select_related(
            "target"
        )
        holders += [m.target for m in pending]
    for worker in {w.pk: w for w in holders}.values():
        outbox.command(
            worker,
            "prompt",
            session=session,
            epoch=session.epoch,
            text=prompt.text,
            from_chunk=prompt.from_chunk,
            prompt_id=prompt.pk,
        )
    outbox.send()


def session_stop(*, session_id: str, held_by: list[str]) -> None:
    """After a depart: the workers that held the session free its state."""
    outbox = _Outbox()
    for worker in GpuWorker.objects.filter(name__in=held_by, status__in=GpuWorker.LIVE_STATUSES):
        outbox.command(worker, "stop", session=GenerationSession.objects.filter(pk=session_id).first())
    outbox.send()


def migration_request(*, session_id: str, target_name: str, reason: str = "operator") -> Migration:
    """Move an executing session to ``target_name`` now (operators; forced rebalancing)."""
    with redis_client().lock(LOCK_KEY, timeout=60, blocking_timeout=30), transaction.atomic():
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
        outbox = _Outbox()
        migration = _start_migration(session, session.worker, target, None, reason, outbox, parked=False)
        transaction.on_commit(outbox.send)
        return migration


class MigrationRefused(Exception):
    """An operator-requested migration that cannot happen (with the reason)."""


def broadcast_status(session_id: str) -> None:
    from asgiref.sync import async_to_sync
    from channels.layers import get_channel_layer

    from sessions.selectors import session_status_message

    session = GenerationSession.objects.select_related("worker").filter(pk=session_id).first()
    if session is None:
        return
    async_to_sync(get_channel_layer().group_send)(
        f"session.{session_id}", {"type": "session.status", **session_status_message(session)}
    )


def trigger_scheduler(trigger: str, session_id: str | None = None, was_active: bool = False) -> None:
    from scheduling.tasks import scheduler_event

    scheduler_event.delay(trigger=trigger, session_id=session_id, was_active=was_active)


def new_id() -> str:
    return str(uuid.uuid4())
