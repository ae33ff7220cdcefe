"""One-shot image and video jobs (GenServe): every way a job changes, in one module.

Users submit, cancel and delete (``job_submit``, ``job_cancel``, ``job_delete``); the scheduler's dispatcher assigns,
pauses, resumes, moves and re-queues (``job_assign``, ``job_pause``, ``job_resume``, ``job_move``,
``job_requeue``); workers report through ``workers.adapters.reporting.DjangoReporter``, which calls
``job_progress``, ``job_completed`` and ``job_failed`` (the contract with the runtime, issue 14).

Every change is a row-locked update inside ``transaction.atomic()``; broadcasts to the owner's
sockets and the ``job_changed`` signal go out after commit. A worker report whose epoch is not the
job's current one comes from a worker that lost the job (it was re-queued or moved since): it is
ignored, so it can never overwrite the job. ``state`` is the control plane's decision: a report
advances ``steps_done`` and may end the job, but never flips running ⇄ paused (a "paused" report
racing a resume that was already sent must not pause the job again).
"""

from __future__ import annotations

import logging
import random
from dataclasses import dataclass
from datetime import datetime, timedelta

from asgiref.sync import async_to_sync
from channels.layers import get_channel_layer
from django.conf import settings
from django.core.exceptions import ValidationError
from django.core.files.base import ContentFile
from django.db import transaction
from django.utils import timezone

from contracts.catalog import PRESETS, ModelPreset, parse_resolution
from contracts.catalog.presets import PRESETS as RUNTIME_PRESETS
from gpu.models import GpuWorker
from sessions import tenants
from sessions.models import Job, Tenant
from sessions.selectors import job_queue_positions, job_status_message
from sessions.services import MAX_SEED, owner_limit_check, validate_prompt
from sessions.signals import job_changed

logger = logging.getLogger(__name__)

State = Job.State
Kind = Job.Kind

MAX_PRIORITY = 9
MAX_SLO_S = 7 * 86_400.0  # a week: longer is a typo, and it would sit at the back of every queue
# Denoising steps of a job that names none, for a preset whose architecture does not say.
FALLBACK_STEPS = 4
# Queued jobs told their new position when their queue moves (``job_queue_broadcast``).
QUEUE_BROADCAST_LENGTH = 100


def group_name(user_id: int) -> str:
    """The channel-layer group of one user's job sockets."""
    return f"jobs.user.{user_id}"


JOB_MESSAGE = "job.update"


@dataclass(frozen=True)
class JobSpec:
    """A validated job request."""

    kind: str
    prompt: str
    model_name: str
    width: int
    height: int
    frames: int
    steps: int
    seed: int
    priority: int
    slo_s: float | None
    deadline: datetime


def default_steps(model_name: str) -> int:
    return getattr(RUNTIME_PRESETS[model_name].architecture, "denoising_steps", FALLBACK_STEPS)


def _int_in(value: object, low: int, high: int) -> int | None:
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        return None
    return value


def _preset_and_size(
    model_name: str, resolution: str | None, errors: dict
) -> tuple[ModelPreset | None, int, int]:
    preset = PRESETS.get(model_name)
    served = settings.STREAMSERVE["SERVED_MODELS"]
    if preset is None:
        errors["model"] = f"unknown model {model_name!r}; available: {', '.join(sorted(PRESETS))}"
        return None, 0, 0
    if preset.name not in served:
        errors["model"] = f"{preset.name} is not served by this deployment; served: {', '.join(served)}"
        return None, 0, 0
    try:
        width, height = parse_resolution(resolution or preset.default_resolution)
    except ValueError as exc:
        errors["resolution"] = str(exc)
        return preset, 0, 0
    if f"{width}x{height}" not in preset.resolutions:
        errors["resolution"] = (
            f"{width}x{height} is not supported by {preset.name}; supported: {', '.join(preset.resolutions)}"
        )
    return preset, width, height


def _frames(kind: str, frames: int | None, preset: ModelPreset | None, errors: dict) -> int:
    if kind != Kind.VIDEO:
        if frames not in (None, 1):
            errors["frames"] = "an image is one frame: leave frames out (or 1)"
        return 1
    bounds = f"between 2 and {settings.STREAMSERVE['JOB_MAX_FRAMES']}"
    if frames is None:
        errors["frames"] = f"a video needs frames (an integer {bounds})"
    elif _int_in(frames, 2, settings.STREAMSERVE["JOB_MAX_FRAMES"]) is None:
        errors["frames"] = f"a video has {bounds} frames"
    elif preset is not None and frames % preset.job_frame_unit:
        errors["frames"] = f"must be a multiple of {preset.job_frame_unit} for {preset.name}"
    elif preset is not None and preset.max_job_frames is not None and frames > preset.max_job_frames:
        errors["frames"] = f"at most {preset.max_job_frames} for {preset.name}"
    return frames or 0


def _deadline(slo_s: float | None, deadline: datetime | None, now: datetime, errors: dict) -> datetime:
    """The absolute deadline: as given, or ``slo_s`` (default ``JOB_DEFAULT_SLO_S``) from now."""
    if deadline is not None:
        if slo_s is not None:
            errors["deadline"] = "give slo_s or deadline, not both"
        elif deadline <= now:
            errors["deadline"] = f"is in the past ({deadline.isoformat()} ≤ now {now.isoformat()})"
        elif deadline > now + timedelta(seconds=MAX_SLO_S):
            errors["deadline"] = "must be within a week"
        return deadline
    slo = settings.STREAMSERVE["JOB_DEFAULT_SLO_S"] if slo_s is None else slo_s
    if not 0 < slo <= MAX_SLO_S:  # NaN fails it too
        errors["slo_s"] = f"must be a number of seconds in (0, {MAX_SLO_S:g}]"
        return now
    return now + timedelta(seconds=slo)


def job_spec_build(
    *,
    kind: str,
    prompt: object,
    model_name: str,
    resolution: str | None,
    frames: int | None,
    steps: int | None,
    seed: int | None,
    slo_s: float | None,
    deadline: datetime | None,
    priority: int,
    now: datetime,
) -> JobSpec:
    """Validate a submission against the model catalogue and the limits; ValidationError per field
    (every field's problem at once)."""
    errors: dict[str, str] = {}
    if kind not in Kind.values:
        errors["kind"] = f"must be one of {', '.join(Kind.values)}"
    preset, width, height = _preset_and_size(model_name, resolution, errors)
    frames = _frames(kind, frames, preset, errors)
    max_steps = settings.STREAMSERVE["JOB_MAX_STEPS"]
    if steps is not None and _int_in(steps, 1, max_steps) is None:
        errors["steps"] = f"must be an integer between 1 and {max_steps}"
    if seed is None:
        seed = random.SystemRandom().randrange(0, 2**31)
    elif _int_in(seed, 0, MAX_SEED) is None:
        errors["seed"] = f"must be an integer between 0 and {MAX_SEED}"
    if _int_in(priority, 0, MAX_PRIORITY) is None:
        errors["priority"] = f"must be an integer between 0 and {MAX_PRIORITY}"
    deadline = _deadline(slo_s, deadline, now, errors)
    try:
        prompt = validate_prompt(prompt)
    except ValidationError as exc:
        errors.update({k: v[0] for k, v in exc.message_dict.items()})
    if errors:
        raise ValidationError(errors)
    assert preset is not None
    return JobSpec(
        kind=kind,
        prompt=prompt,
        model_name=preset.name,
        width=width,
        height=height,
        frames=frames,
        steps=steps if steps is not None else default_steps(preset.name),
        seed=seed,
        priority=priority,
        slo_s=slo_s,
        deadline=deadline,
    )


class JobLimit(Exception):
    """The owner already has ``MAX_JOBS_IN_FLIGHT_PER_USER`` jobs queued, running or paused."""


# --- announcing (after commit) ----------------------------------------------------------------------


def _send(user_id: int, message: dict) -> None:
    async_to_sync(get_channel_layer().group_send)(group_name(user_id), {"type": JOB_MESSAGE, **message})


def job_broadcast(*, job_id: str) -> None:
    """Tell the owner's sockets the job's state (with its queue position while queued)."""
    job = Job.objects.select_related("worker").filter(pk=job_id).first()
    if job is None:
        return
    position = job_queue_positions([job.model_name]).get(job.pk) if job.state == State.QUEUED else None
    _send(job.owner_id, job_status_message(job, position=position))


def job_queue_broadcast(*, model_name: str) -> None:
    """The queue of a model moved: tell the owners of its first ``QUEUE_BROADCAST_LENGTH`` jobs their
    new positions. Further back a job hears nothing until it comes within that many of the front
    (each dispatch that starts jobs moves the window), so one change costs a bounded fan-out rather
    than a message per queued job; the API reads always give the exact position."""
    positions = job_queue_positions([model_name])
    front = sorted(positions, key=positions.get)[:QUEUE_BROADCAST_LENGTH]
    for job in Job.objects.filter(pk__in=front).select_related("worker"):
        _send(job.owner_id, job_status_message(job, position=positions[job.pk]))


def _announce(job: Job, change: str | None = None, *, queue: bool = False, **detail) -> None:
    """After commit: the owner's sockets, the queue's other owners when positions moved, and the
    scheduler (``job_changed``) when the change asks something of it."""

    job_id, model_name, state = str(job.pk), job.model_name, job.state

    def send() -> None:
        try:
            if queue:  # every queued job of the model, this one included if it is queued
                job_queue_broadcast(model_name=model_name)
            if not queue or state != State.QUEUED:
                job_broadcast(job_id=job_id)
        except Exception:  # a broadcast must never fail the report or request that changed the job
            logger.exception("job broadcast failed job=%s", job_id)
        if change is not None:
            job_changed.send(sender=Job, job_id=job_id, change=change, **detail)

    transaction.on_commit(send)


def _locked(job_id) -> Job | None:
    return Job.objects.select_for_update(no_key=True).filter(pk=job_id).first()


# --- what users do ----------------------------------------------------------------------------------


@transaction.atomic
def job_submit(*, owner, spec: JobSpec, tenant: Tenant | None = None) -> Job:
    """Queue a job for ``tenant`` (default: the owner's default tenant). Raises ``JobLimit`` when the
    owner already has the maximum in flight, ``tenants.QuotaExceeded`` when the tenant's hard quota
    is spent."""
    tenant = tenant or tenants.tenant_acting_for(user=owner)
    tenants.quota_admit_job(tenant=tenant)
    owner_limit_check(
        owner,
        Job.objects.filter(owner=owner, state__in=Job.IN_FLIGHT),
        setting="MAX_JOBS_IN_FLIGHT_PER_USER",
        error=JobLimit,
        what="jobs in flight",
        advice="wait for one to finish or cancel one",
    )
    job = Job.objects.create(
        owner=owner,
        tenant=tenant,
        kind=spec.kind,
        prompt=spec.prompt,
        model_name=spec.model_name,
        width=spec.width,
        height=spec.height,
        frames=spec.frames,
        steps=spec.steps,
        seed=spec.seed,
        priority=spec.priority,
        slo_s=spec.slo_s,
        deadline=spec.deadline,
        submitted_at=timezone.now(),
    )
    _announce(job, "submitted", queue=True)
    return job


@transaction.atomic
def job_cancel(*, job: Job) -> Job:
    """Cancel a job that has not ended (idempotent on an ended job). A worker that holds it is told
    to drop its state (``job_changed`` → the scheduler sends ``job_cancel``)."""
    job = _locked(job.pk)
    if not job.in_flight:
        return job
    held_by = job.worker.name if job.state in (State.RUNNING, State.PAUSED) and job.worker else None
    was_queued = job.state == State.QUEUED
    job.state, job.finished_at = State.CANCELLED, timezone.now()
    job.save(update_fields=["state", "finished_at"])
    _announce(job, "cancelled", queue=was_queued, held_by=held_by, epoch=job.epoch)
    return job


@transaction.atomic
def job_delete(*, job: Job) -> Job:
    """Delete a job for its owner (the OpenAI API's ``DELETE /v1/videos/{id}``): cancelled first if
    it has not ended (its worker drops its state), its result removed from the storage once this
    commits, and hidden from every listing (``deleted_at``). The row stays: the audit counts how the
    job ended, and an owner must not be able to rewrite that."""
    job = job_cancel(job=job)  # locks the row: a result reported meanwhile is ignored or already saved
    if job.deleted_at is not None:
        return job
    result = job.result.name
    job.deleted_at, job.result = timezone.now(), ""
    job.save(update_fields=["deleted_at", "result"])
    if result:
        storage = Job._meta.get_field("result").storage
        transaction.on_commit(lambda: storage.delete(result))
    return job


# --- what the dispatcher decides (scheduling.live.jobs) ----------------------------------------------


def job_assign(*, job: Job, worker: GpuWorker) -> bool:
    """queued → running on ``worker`` under a new epoch (compare-and-set; the caller holds the
    transaction, and tells the rest of the queue once per round: ``job_queue_broadcast``). Returns
    whether it applied."""
    now = timezone.now()
    applied = Job.objects.filter(pk=job.pk, state=State.QUEUED, epoch=job.epoch).update(
        state=State.RUNNING, worker=worker, epoch=job.epoch + 1, steps_done=0, started_at=now
    )
    if applied:
        job.state, job.worker, job.epoch, job.steps_done = State.RUNNING, worker, job.epoch + 1, 0
        job.started_at = job.started_at or now
        _announce(job)
    return bool(applied)


def _flip(job: Job, old: str, new: str, **changes) -> bool:
    applied = Job.objects.filter(pk=job.pk, state=old, epoch=job.epoch).update(state=new, **changes)
    if applied:
        job.state = new
        for name, value in changes.items():
            setattr(job, name, value)
        _announce(job)
    return bool(applied)


def job_pause(*, job: Job) -> bool:
    """running → paused on the same worker (the dispatcher sends ``job_pause``)."""
    return _flip(job, State.RUNNING, State.PAUSED)


def job_resume(*, job: Job) -> bool:
    """paused → running on the worker that holds its state (the dispatcher sends ``job_resume``)."""
    return _flip(job, State.PAUSED, State.RUNNING)


def job_move(*, job: Job, target: GpuWorker) -> bool:
    """A paused job's state goes to ``target`` (migration commands): it stays paused there, under a
    new epoch, so the source's reports are ignored from now on."""
    return _flip(job, State.PAUSED, State.PAUSED, worker=target, epoch=job.epoch + 1)


def job_requeue(*, job: Job, reason: str, retry_now: bool = True) -> bool:
    """Back to the queue from step 0 (its worker died, refused it, or a move failed). The epoch
    rises so whatever the old worker still reports is ignored; determinism makes the restart's
    result the same as the lost run's would have been. ``retry_now``: ask for a dispatch at once
    (a lost worker's jobs); otherwise the next tick retries (a refusal would repeat at once)."""
    if job.state not in (State.RUNNING, State.PAUSED):
        return False
    applied = Job.objects.filter(pk=job.pk, state=job.state, epoch=job.epoch).update(
        state=State.QUEUED, worker=None, epoch=job.epoch + 1, steps_done=0
    )
    if applied:
        logger.warning("job.requeued job=%s epoch=%d reason=%s", job.pk, job.epoch, reason)
        job.state, job.worker, job.epoch, job.steps_done = State.QUEUED, None, job.epoch + 1, 0
        _announce(job, "submitted" if retry_now else None, queue=True)
    return bool(applied)


# --- what workers report (workers.adapters.reporting.DjangoReporter) -------------------------------------------


def _current(job_id: str, epoch: int, worker_name: str) -> Job | None:
    """The locked job if the report comes from its current holder, else None (logged)."""
    # The worker is read after the lock, never joined into the locking query (a join would see the
    # worker row of before the wait: see scheduling.live.run._sessions_locked).
    job = _locked(job_id)
    if job is None or job.epoch != int(epoch) or not job.in_flight or job.state == State.QUEUED:
        logger.info(
            "job.report_ignored job=%s epoch=%s worker=%s current=%s",
            job_id,
            epoch,
            worker_name,
            (job.epoch, job.state) if job else None,
        )
        return None
    if job.worker is None or job.worker.name != worker_name:
        logger.warning("job.report_ignored job=%s worker=%s holder=%s", job_id, worker_name, job.worker)
        return None
    return job


@transaction.atomic
def job_progress(job_id: str, epoch: int, worker_name: str, *, state: str, step: int, steps: int) -> None:
    """The worker started, paused, resumed or advanced the job (``state``: running | paused)."""
    job = _current(job_id, epoch, worker_name)
    if job is None:
        return
    done = max(job.steps_done, min(int(step), job.steps))
    if done != job.steps_done or job.started_at is None:
        job.steps_done = done
        job.started_at = job.started_at or timezone.now()
        job.save(update_fields=["steps_done", "started_at"])
    if state not in (State.RUNNING, State.PAUSED) or int(steps) != job.steps:
        logger.warning("job.progress_odd job=%s state=%s steps=%s of %d", job_id, state, steps, job.steps)
    _announce(job)


@transaction.atomic
def job_completed(
    job_id: str,
    epoch: int,
    worker_name: str,
    *,
    content: bytes,
    content_type: str,
    extension: str,
    run_s: float,
) -> None:
    """The result is ready: saved through the default storage (``STORAGES``), the job is done."""
    job = _current(job_id, epoch, worker_name)
    if job is None:
        return
    extension = "".join(c for c in extension.lower().lstrip(".") if c.isalnum())[:8] or "bin"
    # Written inside the transaction: a rollback leaves at worst an orphan file, never a done job
    # without its file.
    job.result.save(f"{job.pk}.{extension}", ContentFile(content), save=False)
    job.result_content_type = content_type[:64]
    job.state, job.finished_at = State.DONE, timezone.now()
    job.steps_done, job.run_s = job.steps, max(0.0, float(run_s))
    job.save(update_fields=["result", "result_content_type", "state", "finished_at", "steps_done", "run_s"])
    _announce(job, "ended")


@transaction.atomic
def job_failed(job_id: str, epoch: int, worker_name: str, *, reason: str) -> None:
    job = _current(job_id, epoch, worker_name)
    if job is None:
        return
    job.state, job.finished_at, job.error = State.FAILED, timezone.now(), reason[:2000]
    job.save(update_fields=["state", "finished_at", "error"])
    _announce(job, "ended")
