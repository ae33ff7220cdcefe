"""The job dispatcher: one-shot jobs onto the room the streams leave (issue 14, GenServe).

``jobs_dispatch`` runs from the closed-loop tick right after the streams' decision
(``scheduling.tasks.scheduler_tick``) and on every committed job change (``job_changed`` →
``scheduling.tasks.jobs_dispatch``), under the same cluster-wide lock as the scheduler's runs, so it
always sees the streams' latest placement. In one transaction it re-queues the jobs of workers that
have ended, reads the pools (workers locked in primary-key order, like every multi-row locker), asks
the ``JOB_POLICY`` (``scheduling.core.jobs.policy``) for a plan, applies each entry as a compare-and-set
``sessions.jobs`` transition and writes the commands (``job_run``, ``job_pause``, ``job_resume``,
migration with ``"job"``), which go out after commit (``outbox``).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from functools import cache, partial
from typing import Any

from django.conf import settings
from django.db import transaction
from django.db.models import Count, Q
from django.utils import timezone

from gpu.models import GpuWorker
from scheduling.core.jobs.genserve import JobCosts
from scheduling.core.jobs.policy import JobPolicy, JobRound, JobView, WorkerView, load_job_policy
from scheduling.live.outbox import Outbox, scheduler_lock
from scheduling.live.stages.peers import EncoderMissing, StageServiceMissing, decoder_for, encoder_for
from scheduling.models import WorkerCommand
from sessions import jobs as job_services
from sessions.models import GenerationSession, Job
from sessions.selectors import job_queue

logger = logging.getLogger("scheduling.live")

State = Job.State
SessionStatus = GenerationSession.Status
# How many queued jobs per dispatch the policy sees (the front of the queue); the rest wait a tick.
QUEUE_WINDOW = 500
# The roles that run one-shot jobs: diffuse on the worker; E on it or on an E worker, C on it or on
# a C worker (D and ED send a finished job's latents to a C worker for its decode).
JOB_ROLES = ("EDC", "ED", "DC", "D")


@dataclass
class DispatchResult:
    assigned: int = 0
    paused: int = 0
    resumed: int = 0
    moved: int = 0
    requeued: int = 0
    # Workers without E (or C) that take no new job this round, and why (no ready encoder, or
    # decoder, serves them).
    waiting_for_encoder: dict[str, str] = field(default_factory=dict)

    def as_dict(self) -> dict[str, Any]:
        counts = {k: v for k, v in self.__dict__.items() if k != "waiting_for_encoder"}
        return counts | (
            {"waiting_for_encoder": self.waiting_for_encoder} if self.waiting_for_encoder else {}
        )


@cache
def _policy(path: str, job_profiles: tuple[str, ...]) -> JobPolicy:
    return load_job_policy(path, job_profiles=job_profiles)


@cache
def _costs(job_profiles: tuple[str, ...]) -> JobCosts:
    return JobCosts(job_profiles)


@dataclass
class JobBacklog:
    """One pool's jobs in flight for the autoscaler: ``(deadline, id, remaining s)`` per job, keyed by
    the name of the worker holding it (``None``: queued), and the workers holding running or paused
    jobs (never drained: ``scheduling.live.apply``)."""

    open_jobs: dict[str | None, list[tuple[float, str, float]]]
    holders: set[str]


def jobs_backlog(preset: str) -> JobBacklog:
    """The pool's open jobs costed like ``genserve`` does (``JobCosts``, ``JOB_PROFILES``)."""
    costs = _costs(tuple(settings.STREAMSERVE["JOB_PROFILES"]))
    backlog = JobBacklog({}, set())
    jobs = Job.objects.filter(model_name=preset, state__in=Job.IN_FLIGHT).select_related("worker")
    for job in jobs:
        name = job.worker.name if job.worker is not None else None
        if name is not None and job.state in (State.RUNNING, State.PAUSED):
            backlog.holders.add(name)
        remaining = costs.remaining_s(_view(job, {}, moving=set()))
        backlog.open_jobs.setdefault(name, []).append((job.deadline.timestamp(), str(job.pk), remaining))
    return backlog


def jobs_dispatch() -> DispatchResult:
    """One dispatch round over every served pool."""
    if not Job.objects.filter(state__in=Job.IN_FLIGHT).exists():
        return DispatchResult()  # the common tick without jobs: no lock, no pool read
    with scheduler_lock(), transaction.atomic():
        outbox = Outbox()
        transaction.on_commit(outbox.send)
        result = DispatchResult(requeued=_orphans_requeue())
        models = list(settings.STREAMSERVE["SERVED_MODELS"])
        workers = {
            w.name: w
            for w in GpuWorker.objects.select_for_update(no_key=True)
            .filter(model_preset__in=models, status__in=[GpuWorker.Status.READY, GpuWorker.Status.DRAINING])
            # Jobs run where diffuse is (EDC, ED, DC, D; docs/stages.md, "Live placement"): the
            # job_run of a worker without E names its encoder, of one without C its decoder.
            .filter(stage_role__in=JOB_ROLES)
            .order_by("pk")
        }
        held = list(
            Job.objects.select_for_update(no_key=True)
            .filter(state__in=[State.RUNNING, State.PAUSED], worker__in=workers.values())
            .order_by("pk")
        )
        queued = list(job_queue(models).select_for_update(no_key=True, skip_locked=True)[:QUEUE_WINDOW])
        by_id = {str(j.pk): j for j in [*held, *queued]}
        names, moving = {w.pk: name for name, w in workers.items()}, _moving(held)
        services, result.waiting_for_encoder = _stage_services(workers)
        if result.waiting_for_encoder and queued:
            logger.warning(
                "jobs.waiting_for_encoder queued=%d %s",
                len(queued),
                "; ".join(f"{w}: {why}" for w, why in sorted(result.waiting_for_encoder.items())),
            )
        conf = settings.STREAMSERVE
        plan = _policy(conf["JOB_POLICY"], tuple(conf["JOB_PROFILES"])).plan(
            JobRound(
                now=timezone.now().timestamp(),
                jobs=[_view(j, names, moving=moving) for j in [*held, *queued]],
                workers=_worker_views(workers, held, moving, no_encoder=set(result.waiting_for_encoder)),
                streams_waiting=_streams_waiting(models),
            )
        )
        for job_id in plan.pause:
            result.paused += preempt_job(by_id[job_id], reason="streams need the room", outbox=outbox)
        for job_id in plan.resume:
            result.resumed += _resume(by_id[job_id], outbox)
        for job_id, target in plan.move:
            result.moved += move_job(by_id[job_id], workers[target], outbox=outbox)
        for job_id, target in plan.assign:
            result.assigned += _assign(by_id[job_id], workers[target], outbox, services.get(target, {}))
        # The jobs left in line moved up: their owners hear it once per queue, not once per start.
        moved = sorted({by_id[job_id].model_name for job_id, _ in plan.assign})
        transaction.on_commit(partial(_queues_broadcast, moved))
    if any(v for k, v in result.as_dict().items() if k != "waiting_for_encoder"):
        logger.info("jobs.dispatch %s", " ".join(f"{k}={v}" for k, v in result.as_dict().items()))
    return result


def _queues_broadcast(model_names: list[str]) -> None:
    for model_name in model_names:
        job_services.job_queue_broadcast(model_name=model_name)


def _view(job: Job, names: dict[int, str], *, moving: set) -> JobView:
    return JobView(
        id=str(job.pk),
        model=job.model_name,
        state=job.state,
        priority=job.priority,
        deadline=job.deadline.timestamp(),
        steps=job.steps,
        steps_done=job.steps_done,
        worker=names.get(job.worker_id) if job.worker_id is not None else None,
        kind=job.kind,
        width=job.width,
        height=job.height,
        frames=job.frames,
        moving=job.pk in moving,
    )


def _stage_services(workers: dict[str, GpuWorker]) -> tuple[dict[str, dict], dict[str, str]]:
    """What each ready worker's ``job_run`` names: its ``encoder`` when it lacks E (``encoder_for``),
    its ``decoder`` when it lacks C (``decoder_for``); and the workers one is missing for, with why."""
    services: dict[str, dict] = {}
    missing: dict[str, str] = {}
    for name, worker in workers.items():
        if worker.status != GpuWorker.Status.READY:
            continue
        try:
            found = {"encoder": encoder_for(worker), "decoder": decoder_for(worker)}
        except StageServiceMissing as exc:
            what = "an encoder" if isinstance(exc, EncoderMissing) else "a decoder"
            missing[name] = f"waiting for {what}: {exc}"
            continue
        services[name] = {k: v for k, v in found.items() if v is not None}
    return services, missing


def _worker_views(
    workers: dict[str, GpuWorker], held: list[Job], moving: set, *, no_encoder: set[str] = frozenset()
) -> list[WorkerView]:
    """Room = K − resident stream sessions − running jobs − jobs whose state is on its way there (the
    slot a move was made for is kept for it); a draining worker has none at all, nor has a worker
    without E (or C) while no encoder (or decoder) is ready for it (its jobs would be refused)."""
    resident = dict(
        GenerationSession.objects.filter(
            worker__in=workers.values(), status__in=[SessionStatus.EXECUTING, SessionStatus.MIGRATING]
        )
        .values("worker")
        .annotate(n=Count("id"))
        .values_list("worker", "n")
    )
    running: dict[int, int] = {}
    for job in held:
        if job.state == State.RUNNING or job.pk in moving:
            running[job.worker_id] = running.get(job.worker_id, 0) + 1
    return [
        WorkerView(
            name=name,
            model=w.model_preset,
            room=(w.capacity if w.status == GpuWorker.Status.READY and name not in no_encoder else 0)
            - resident.get(w.pk, 0)
            - running.get(w.pk, 0),
            role=w.stage_role,
        )
        for name, w in workers.items()
    ]


def _moving(held: list[Job]) -> set:
    """Paused jobs whose state is still on its way to their new worker: either side of the move
    unanswered. The source answers ``migrate_out`` once the target has verified the region (the
    target may answer ``migrate_in`` as soon as it listens), so both answers mean it has landed."""
    paused = [j.pk for j in held if j.state == State.PAUSED]
    if not paused:
        return set()
    return set(
        WorkerCommand.objects.filter(
            job__in=paused,
            kind__in=[WorkerCommand.Kind.MIGRATE_IN, WorkerCommand.Kind.MIGRATE_OUT],
            status=WorkerCommand.Status.SENT,
        ).values_list("job", flat=True)
    )


def _streams_waiting(models: list[str]) -> dict[str, int]:
    return dict(
        GenerationSession.objects.filter(
            model_name__in=models,
            status=SessionStatus.QUEUED,
            activity=GenerationSession.Activity.ACTIVE,
        )
        .values("model_name")
        .annotate(n=Count("id"))
        .values_list("model_name", "n")
    )


def _assign(job: Job, worker: GpuWorker, outbox: Outbox, extra: dict | None = None) -> bool:
    if not job_services.job_assign(job=job, worker=worker):
        return False
    # A worker without E takes the prompt's embeddings from the encoder worker named here (``extra``'s
    # ``encoder``), one without C decodes the finished job on the decoder worker named (``decoder``).
    extra = extra or {}
    outbox.command(
        worker,
        WorkerCommand.Kind.JOB_RUN,
        job=job,
        epoch=job.epoch,
        job_kind=job.kind,
        model=job.model_name,
        prompt=job.prompt,
        width=job.width,
        height=job.height,
        frames=job.frames,
        steps=job.steps,
        seed=job.seed,
        deadline=job.deadline.timestamp(),
        priority=job.priority,
        **sp_degree(job, worker),
        **extra,
    )
    return True


def _resume(job: Job, outbox: Outbox) -> bool:
    if not job_services.job_resume(job=job):
        return False
    outbox.command(
        job.worker, WorkerCommand.Kind.JOB_RESUME, job=job, epoch=job.epoch, **sp_degree(job, job.worker)
    )
    return True


def sp_degree(job: Job, worker: GpuWorker) -> dict[str, int]:
    """``{"sp_degree": n}`` for a video on a worker that reports n ≥ 2 job devices in its heartbeat
    (``job_devices``), else nothing (one device). A worker runs one video step at a time, so its
    other devices would sit idle through that step: the video takes them all (elastic SP within a
    worker; the degree is re-chosen for the worker a moved job resumes on)."""
    devices = (worker.telemetry or {}).get("job_devices", 1)
    if job.kind != Job.Kind.VIDEO or isinstance(devices, bool) or not isinstance(devices, int) or devices < 2:
        return {}
    return {"sp_degree": devices}


def preempt_job(job: Job, *, reason: str, outbox: Outbox) -> bool:
    """Pause a running job at its next step boundary; its state stays in that worker's host memory
    (``job_pause``). Returns whether the job was still running under the epoch the caller read."""
    if not job_services.job_pause(job=job):
        return False
    logger.info("job.preempted job=%s worker=%s reason=%s", job.pk, job.worker_id, reason)
    outbox.command(job.worker, WorkerCommand.Kind.JOB_PAUSE, job=job, epoch=job.epoch)
    return True


def move_job(job: Job, target: GpuWorker, *, outbox: Outbox) -> bool:
    """Move a paused job's state to ``target`` through the migration commands (``"job"`` in place of
    ``"session"``, docs/jobs.md): it stays paused there under a new epoch, and the dispatcher resumes it
    once both sides have answered (``_moving``). A refused or failed side re-queues the job
    (``job_command_failed``)."""
    source = job.worker
    old_epoch = job.epoch
    try:
        # A target without C decodes the job on a decoder worker: named in its migrate_in.
        decoder = decoder_for(target)
    except StageServiceMissing as exc:
        logger.warning("job.move_skipped job=%s target=%s reason=%s", job.pk, target.name, exc)
        return False
    if not job_services.job_move(job=job, target=target):
        return False
    extra = {"decoder": decoder} if decoder is not None else {}
    outbox.command(
        target, WorkerCommand.Kind.MIGRATE_IN, job=job, epoch=job.epoch, source=source.name, **extra
    )
    outbox.command(
        source,
        WorkerCommand.Kind.MIGRATE_OUT,
        job=job,
        epoch=old_epoch,
        new_epoch=job.epoch,
        target=target.name,
        target_address=target.migration_address,
    )
    return True


def _orphans_requeue() -> int:
    """Jobs held by workers that have ended start again elsewhere (``jobs_recover`` per worker)."""
    ended = GpuWorker.objects.filter(
        Q(jobs__state__in=[State.RUNNING, State.PAUSED]),
        status__in=[GpuWorker.Status.FAILED, GpuWorker.Status.RELEASED],
    ).distinct()
    return sum(jobs_recover(worker=w) for w in ended)


@transaction.atomic
def jobs_recover(*, worker: GpuWorker) -> int:
    """``worker`` died: its running and paused jobs go back to the queue with a raised epoch (their
    state died with it; a late report from it is ignored). A move that was under way to or from it
    fails the same way. Returns how many were re-queued."""
    affected = list(
        Job.objects.select_for_update(no_key=True)
        .filter(state__in=[State.RUNNING, State.PAUSED], worker=worker)
        .order_by("pk")
    )
    moving_from = Job.objects.filter(
        pk__in=WorkerCommand.objects.filter(
            worker=worker, kind=WorkerCommand.Kind.MIGRATE_OUT, status=WorkerCommand.Status.SENT
        ).values("job"),
        state=State.PAUSED,
    ).select_for_update(no_key=True)
    affected += [j for j in moving_from if j.pk not in {a.pk for a in affected}]
    return sum(job_services.job_requeue(job=job, reason=f"worker {worker.name} lost") for job in affected)


def job_command_failed(*, command: dict, status: str, reason: str) -> None:
    """A worker refused or failed a job command (``answers.command_answered``): a run, a resume or
    either side of a move that did not happen leaves no usable state, so the job starts again from
    the queue (if the command's epoch is still the job's: otherwise a newer decision already
    superseded it). A refused pause or cancel changes nothing here."""
    if command.get("kind") not in ("job_run", "job_resume", "migrate_in", "migrate_out"):
        return
    epoch = int(command["new_epoch"] if command.get("kind") == "migrate_out" else command["epoch"])
    with transaction.atomic():
        job = Job.objects.select_for_update(no_key=True).filter(pk=command["job"], epoch=epoch).first()
        # Retried at the next tick, not at once: a worker that refuses would refuse again at once.
        why = f"{command['kind']} {status}: {reason}"
        if job is None or not job_services.job_requeue(job=job, reason=why, retry_now=False):
            return
        if command["kind"] in ("migrate_in", "migrate_out"):
            # Whatever copy either side holds is not the job's any more.
            outbox = Outbox()
            sides = {command.get("target"), command.get("source")} | set(
                WorkerCommand.objects.filter(pk=command["id"]).values_list("worker__name", flat=True)
            )
            for worker in GpuWorker.objects.filter(
                name__in=sides - {None}, status__in=GpuWorker.LIVE_STATUSES
            ):
                outbox.command(worker, WorkerCommand.Kind.JOB_CANCEL, job=job, epoch=job.epoch)
            transaction.on_commit(outbox.send)
