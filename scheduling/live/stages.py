"""Live stage placement: TridentServe's Alg. 2 and §5.3 trigger on the live pool (docs/stages.md,
"Live placement").

With ``STAGE_PLACEMENT=tridentserve`` every scheduler run calls ``stage_placement_step`` for its
model pool, inside the run's transaction with the pool's worker rows locked:

1. The placement being applied makes progress: a ``set_role`` left without an answer past the
   command timeout fails; then the next planned changes are sent, never more than
   ``STAGE_MAX_CHANGING`` workers changing role at once, so the pool never pauses as a whole (every
   other worker keeps serving in its role; the changing one loads or drops stages lazily).
2. With no placement in progress, the first run plans from the recent mix (``bootstrap``); later runs
   feed the §5.3 trigger with the stage ops completed in its window and re-plan when it fires. A plan
   whose role counts equal the current ones changes nothing and is not recorded.

The worker answers ``set_role`` through ``answers.command_answered`` → ``stage_change_answered``,
which records the outcome and asks for a tick, so the next change goes out without waiting for the
periodic one.

Sessions run where their diffusion model and decoder are: the snapshot the policy sees leaves out
workers without D and C (``GpuWorker.holds_sessions``), and a session on a worker without E gets the
encoder the pool chose for it (``encoder_for``) in its ``start`` and ``prompt`` commands.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta

from django.conf import settings
from django.db import transaction
from django.db.models import Count, F, Q
from django.utils import timezone

from gpu.models import STAGE_ROLES, GpuWorker
from scheduling.core.stages.placement import (
    PlacementError,
    ReplacementTrigger,
    plan_placement,
    preferred_type,
    role_changes,
    stream_fits,
)
from scheduling.core.stages.stage_profiles import GPUS, GpuSpec, PipelineProfile, Shape, get_gpu, get_pipeline
from scheduling.live.enqueue import scheduler_trigger
from scheduling.live.outbox import Outbox
from scheduling.models import SchedulerState, StagePlacement, StageRoleChange, WorkerCommand
from sessions.models import ChunkRecord, GenerationSession, Job, Prompt

logger = logging.getLogger("scheduling.live")

Change = StageRoleChange.Status
# The plan sees the requests of the last few trigger windows, as the simulator's re-placement does.
HISTORY_WINDOWS = 5
# A prompt encode's cost does not depend on the output size (encode is 2·P·text_len FLOPs).
STREAM_SHAPE = Shape(64, 64, 1, 1)
# Bounds the plan's input (Alg. 2 looks at every request once): beyond it, the streams' chunks are
# counted at a common scale.
MAX_STREAM_CHUNKS = 2048


def stage_placement_on() -> bool:
    return settings.STREAMSERVE["STAGE_PLACEMENT"] == "tridentserve"


def _state_key(preset: str) -> str:
    return f"stages@{preset}"


def _pipeline() -> PipelineProfile:
    return get_pipeline(settings.STREAMSERVE["STAGE_PIPELINE"])


def _gpu_spec(workers: Iterable[GpuWorker]) -> GpuSpec:
    """The analytic spec of the pool's GPUs: the first worker's type where the profiles know it (a
    live pool of one preset is of one type in practice), else ``STAGE_GPU``."""
    for worker in workers:
        if worker.gpu_type.lower() in GPUS:
            return get_gpu(worker.gpu_type)
    return get_gpu(settings.STREAMSERVE["STAGE_GPU"])


# --- the encoder of a worker without E ------------------------------------------------------------


def encoder_for(worker: GpuWorker, role: str | None = None, *, exclude: str | None = None) -> dict | None:
    """The encoder a session or job on ``worker`` (in ``role``: default its current one) uses:
    ``None`` when the role hosts E itself, else the least-loaded ready E worker of its model (the
    queue its heartbeat reported), same region first, other than ``exclude`` (one just lost). Raises
    ``EncoderMissing`` when there is none."""
    return _service_for(worker, "E", role, exclude=exclude)


def decoder_for(worker: GpuWorker, role: str | None = None, *, exclude: str | None = None) -> dict | None:
    """The decoder a one-shot job on a ``D`` or ``ED`` worker sends its final latents to: ``None``
    when the role hosts C itself, else the least-loaded ready C worker of its model, same region
    first (as `encoder_for`). Raises ``DecoderMissing`` when there is none."""
    return _service_for(worker, "C", role, exclude=exclude)


def _service_for(worker: GpuWorker, stage: str, role: str | None, *, exclude: str | None) -> dict | None:
    role = role or worker.stage_role
    if stage in role:
        return None
    candidates = list(
        GpuWorker.objects.filter(
            model_preset=worker.model_preset, status=GpuWorker.Status.READY, stage_role=stage
        )
        .exclude(migration_address="")
        .exclude(name=exclude or "")
    )
    service = "encoder" if stage == "E" else "decoder"
    if not candidates:
        missing = EncoderMissing if stage == "E" else DecoderMissing
        raise missing(f"no ready {stage} worker serves {worker.model_preset} to {worker.name} (role {role})")
    best = min(candidates, key=lambda e: (e.region_id != worker.region_id, e.service_load(service), e.name))
    return {"worker": best.name, "address": best.migration_address}


class StageServiceMissing(Exception):
    """A worker needs a stage service (an encoder or a decoder worker) and none is ready."""


class EncoderMissing(StageServiceMissing):
    """A worker without E needs an encoder and no ready E worker serves its model."""


class DecoderMissing(StageServiceMissing):
    """A ``D`` or ``ED`` worker needs a decoder for its jobs and no ready C worker serves its model."""


# --- the live request mix -------------------------------------------------------------------------


@dataclass(frozen=True)
class LiveMix:
    """What the plan is made from: the one-shot jobs of the recent windows and the queued ones, and
    the streams' prompt encodes (the shared encoder pool's work)."""

    shapes: tuple[Shape, ...]
    stream_chunks: int  # of ``shapes``, the streams' chunks (the rest are jobs)
    pending: tuple[Shape, ...]
    encodes: int
    encode_only_s: float
    queued_sessions: int
    unplaceable: int  # jobs no placement type can hold on this GPU

    @property
    def job_shapes(self) -> tuple[Shape, ...]:
        return self.shapes[: len(self.shapes) - self.stream_chunks]

    @property
    def stream_shapes(self) -> tuple[Shape, ...]:
        return self.shapes[len(self.shapes) - self.stream_chunks :]

    def to_json(self) -> dict:
        return {
            "jobs": len(self.shapes) - self.stream_chunks,
            "stream_chunks": self.stream_chunks,
            "pending_jobs": len(self.pending),
            "stream_encodes": self.encodes,
            "encode_only_s": round(self.encode_only_s, 6),
            "queued_sessions": self.queued_sessions,
            "unplaceable_jobs": self.unplaceable,
        }


def _fits(pipeline: PipelineProfile, shape: Shape, gpu: GpuSpec) -> bool:
    try:
        preferred_type(pipeline, shape, gpu)
    except PlacementError:
        return False
    return True


def live_mix(
    *, preset: str, now: datetime, window_s: float, pipeline: PipelineProfile, gpu: GpuSpec
) -> LiveMix:
    since = now - timedelta(seconds=HISTORY_WINDOWS * window_s)
    fields = ("width", "height", "frames", "steps")
    recent = Job.objects.filter(model_name=preset).filter(
        Q(submitted_at__gte=since) | Q(state=Job.State.QUEUED)
    )
    shapes = [Shape(*(max(1, v) for v in row)) for row in recent.values_list(*fields)]
    pending = [
        Shape(*(max(1, v) for v in row))
        for row in Job.objects.filter(model_name=preset, state=Job.State.QUEUED).values_list(*fields)
    ]
    placeable = [s for s in shapes if _fits(pipeline, s, gpu)]
    streams = _stream_chunks(preset=preset, since=since, pipeline=pipeline, gpu=gpu)
    # Every prompt of a stream is one encode: the first at session start, then each switch.
    encodes = Prompt.objects.filter(session__model_name=preset, created_at__gte=since).count()
    queued = GenerationSession.objects.filter(
        model_name=preset,
        status=GenerationSession.Status.QUEUED,
        activity=GenerationSession.Activity.ACTIVE,
    ).count()
    return LiveMix(
        shapes=tuple(placeable + streams),
        stream_chunks=len(streams),
        pending=tuple(s for s in pending if _fits(pipeline, s, gpu)),
        encodes=encodes,
        encode_only_s=encodes * pipeline.encode_s(STREAM_SHAPE, gpu),
        queued_sessions=queued,
        unplaceable=len(shapes) - len(placeable),
    )


def _stream_chunks(*, preset: str, since: datetime, pipeline: PipelineProfile, gpu: GpuSpec) -> list[Shape]:
    """The streams' diffusion work in the mix: each chunk generated since ``since`` as a request of
    one chunk's frames (Alg. 2 weighs types by work, and a session's chunks run where its state is:
    on a primary). Past ``MAX_STREAM_CHUNKS`` chunks every size's count is scaled down by one factor:
    the sizes keep their proportions, the streams' weight against the jobs' is then understated. A size
    that cannot run with D and C on one GPU is left out: no session of it can be held."""
    rows = list(
        ChunkRecord.objects.filter(session__model_name=preset, created_at__gte=since)
        .values_list("session__width", "session__height", "session__frames_per_chunk")
        .annotate(n=Count("id"))
    )
    total = sum(n for *_, n in rows)
    scale = min(1.0, MAX_STREAM_CHUNKS / total) if total else 1.0
    shapes: list[Shape] = []
    for width, height, frames, n in rows:
        shape = Shape(max(1, width), max(1, height), max(1, frames), pipeline.default_steps)
        if stream_fits(pipeline, shape, gpu):
            shapes += [shape] * max(1, round(n * scale))
    return shapes


def _stage_ops(*, preset: str, since: datetime, until: datetime) -> list[tuple[float, str]]:
    """Stage ops completed in ``[since, until]``: a prompt encode per acknowledged ``start`` or
    ``prompt`` command, and E, D and C for every finished job. A stream's chunks are not stage ops of
    the placement: a session's diffuse and decode stay on the worker that holds it."""
    encodes = WorkerCommand.objects.filter(
        worker__model_preset=preset,
        kind__in=[WorkerCommand.Kind.START, WorkerCommand.Kind.PROMPT],
        status=WorkerCommand.Status.ACKED,
        answered_at__gte=since,
        answered_at__lte=until,
    ).values_list("answered_at", flat=True)
    jobs = Job.objects.filter(
        model_name=preset, state=Job.State.DONE, finished_at__gte=since, finished_at__lte=until
    ).values_list("finished_at", flat=True)
    ops = [(t.timestamp(), "E") for t in encodes]
    ops += [(t.timestamp(), stage) for t in jobs for stage in ("E", "D", "C")]
    return sorted(ops)


def _busy(workers: Iterable[GpuWorker]) -> set[str]:
    """Workers holding sessions (executing, migrating or parked) or running/paused jobs."""
    ids = {w.pk: w.name for w in workers}
    held = set(
        GenerationSession.objects.filter(Q(worker__in=ids) | Q(host_worker__in=ids))
        .exclude(status=GenerationSession.Status.TERMINATED)
        .values_list("worker", "host_worker")
    )
    busy = {ids[pk] for pair in held for pk in pair if pk in ids}
    busy |= {
        ids[pk]
        for pk in Job.objects.filter(
            worker__in=ids, state__in=[Job.State.RUNNING, Job.State.PAUSED]
        ).values_list("worker", flat=True)
    }
    return busy


def _encoder_missing(workers: Iterable[GpuWorker]) -> bool:
    ready = [w for w in workers if w.status == GpuWorker.Status.READY]
    return any(w.holds_sessions and "E" not in w.stage_role for w in ready) and not any(
        w.stage_role == "E" for w in ready
    )


# --- one step per scheduler run -------------------------------------------------------------------


def stage_placement_step(
    *, preset: str, workers: dict[str, GpuWorker], now: datetime, outbox: Outbox
) -> StagePlacement | None:
    """Advance the placement in progress, or plan one when none is; returns a placement recorded by
    this step (``None``: none). ``workers``: the pool's live workers, locked by the run."""
    if not stage_placement_on():
        return None
    if _progress(preset=preset, workers=workers, now=now, outbox=outbox):
        return None
    ready = {name: w for name, w in sorted(workers.items()) if w.status == GpuWorker.Status.READY}
    if not ready:
        return None
    conf = settings.STREAMSERVE
    row = SchedulerState.objects.select_for_update(no_key=True).get_or_create(policy=_state_key(preset))[0]
    pool_change = _encoder_pool_change(ready=ready, busy=_busy(ready.values()), now=now, row=row)
    if pool_change is not None:
        return _encoder_pool_grow(
            preset=preset, ready=ready, change=pool_change, now=now, row=row, outbox=outbox, workers=workers
        )
    shrink = _aux_shrink_step(preset=preset, ready=ready, now=now, row=row, outbox=outbox, workers=workers)
    if shrink is not None:
        return shrink
    trigger = ReplacementTrigger(conf["STAGE_WINDOW_S"], conf["STAGE_THRESHOLD"], conf["STAGE_MIN_OPS"])
    trigger.load_state_dict(row.state.get("trigger", {}))
    last_fire = trigger.state_dict()["last_fire"]
    if (
        row.state.get("bootstrapped")
        and last_fire is not None
        and now.timestamp() - last_fire < trigger.window_s
    ):
        return None  # at most one re-placement per window (§5.3): no need to read the mix
    pipeline, gpu = _pipeline(), _gpu_spec(ready.values())
    mix = live_mix(preset=preset, now=now, window_s=trigger.window_s, pipeline=pipeline, gpu=gpu)
    current = {name: w.stage_role for name, w in ready.items()}
    # Live jobs run on EDC workers, on DC and D workers while an encoder is ready, on ED and D ones
    # while a decoder is: a queued job is unserved when no worker can take it, whatever type Alg. 2
    # would prefer for it.
    has = {"E": "E" in current.values(), "C": "C" in current.values()}
    job_hosts = [r for r in current.values() if "D" in r and all(has[s] for s in "EC" if s not in r)]
    unserved_jobs = 0 if job_hosts else len(mix.pending)
    waiting_for_encoder = mix.queued_sessions if _encoder_missing(ready.values()) else 0
    clock = now.timestamp()
    for t, stage in _stage_ops(preset=preset, since=now - timedelta(seconds=trigger.window_s), until=now):
        trigger.record(t, stage)
    backlog = len(mix.pending) + mix.queued_sessions
    unserved = bool(unserved_jobs or waiting_for_encoder)
    if not row.state.get("bootstrapped"):
        reason = StagePlacement.Reason.BOOTSTRAP
        trigger.load_state_dict({"last_fire": clock})
    elif trigger.should_replace(clock, backlog, unserved):
        reason = StagePlacement.Reason.UNSERVED if unserved else StagePlacement.Reason.SKEW
    else:
        row.state = {**row.state, "trigger": trigger.state_dict()}
        row.save(update_fields=["state", "updated_at"])
        return None
    figures = {
        "throughputs_per_s": {k: round(v, 6) for k, v in trigger.throughputs(clock).items()},
        "window_s": trigger.window_s,
        "threshold": trigger.threshold,
        "min_ops": trigger.min_ops,
        "backlog": backlog,
        "unserved_jobs": unserved_jobs,
        "waiting_for_encoder": waiting_for_encoder,
        "pipeline": pipeline.name,
        "gpu": gpu.name,
        "mix": mix.to_json(),
    }
    row.state = {**row.state, "trigger": trigger.state_dict(), "bootstrapped": True}
    row.save(update_fields=["state", "updated_at"])
    try:
        plan = plan_placement(
            pipeline,
            mix.job_shapes,
            len(ready),
            gpu,
            encode_only_s=mix.encode_only_s,
            stream_shapes=mix.stream_shapes,
        )
    except PlacementError as exc:
        logger.warning("stages.plan_failed preset=%s reason=%s error=%s", preset, reason, exc)
        return None
    figures["plan_roles"] = dict(sorted(Counter(plan.roles).items()))
    # Streams only ever get EDC or DC GPUs (``stream_shapes``), so a D, ED or C worker in the plan is
    # one the jobs justify: the plan's roles go out as they are.
    changes = role_changes(current, list(plan.roles), _busy(ready.values()))
    if not changes:
        logger.info(
            "stages.plan_unchanged preset=%s reason=%s roles=%s", preset, reason, sorted(current.values())
        )
        return None
    placement = StagePlacement.objects.create(
        created_at=now,
        preset=preset,
        reason=reason,
        roles_before=current,
        roles_after={**current, **{w: to for w, _, to in changes}},
        trigger=figures,
    )
    StageRoleChange.objects.bulk_create(
        StageRoleChange(
            placement=placement, worker=ready[w], from_role=old, to_role=new, order=i, created_at=now
        )
        for i, (w, old, new) in enumerate(changes)
    )
    logger.info(
        "stages.placement id=%s preset=%s reason=%s changes=%s",
        placement.pk,
        preset,
        reason,
        ", ".join(f"{w}:{old}->{new}" for w, old, new in changes),
    )
    _progress(preset=preset, workers=workers, now=now, outbox=outbox)
    placement.refresh_from_db()
    return placement


def _progress(*, preset: str, workers: dict[str, GpuWorker], now: datetime, outbox: Outbox) -> bool:
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


# --- the encoders of workers without E: failover, refused prompts, the pool's size -----------------

# The commands that name the encoder a worker without E takes prompt embeddings from.
ENCODER_COMMANDS = (
    WorkerCommand.Kind.START,
    WorkerCommand.Kind.PROMPT,
    WorkerCommand.Kind.SET_ROLE,
    WorkerCommand.Kind.SET_ENCODER,
    WorkerCommand.Kind.JOB_RUN,
)


def current_encoders(workers: Iterable[GpuWorker]) -> dict[str, str]:
    """The encoder worker each of ``workers`` was last told to use (by name): the newest command to
    it that carried an ``encoder`` and was not refused. A worker never told one is absent."""
    ids = {w.pk: w.name for w in workers}
    if not ids:
        return {}
    rows = (
        WorkerCommand.objects.filter(worker__in=ids, kind__in=ENCODER_COMMANDS, payload__has_key="encoder")
        .exclude(status=WorkerCommand.Status.REFUSED)
        # DISTINCT ON (worker): the newest per worker, one index scan per worker's commands.
        .order_by("worker_id", "-created_at")
        .distinct("worker_id")
        .values_list("worker", "payload")
    )
    return {ids[pk]: str((payload.get("encoder") or {}).get("worker", "")) for pk, payload in rows}


def _encoder_lost(worker: GpuWorker, current: str | None, ready_encoders: set[str]) -> str | None:
    """Why ``worker`` needs another encoder, or ``None``: the one it uses is no longer ready, or its
    heartbeat says it waits for a lost (or unknown) one."""
    if current and current not in ready_encoders:
        return f"encoder {current} is no longer ready"
    wait = (worker.telemetry or {}).get("encoder_wait")
    if isinstance(wait, dict) and wait.get("sessions"):
        reason = str(wait.get("reason", ""))
        # "waiting for encoder X's answer" is an encode in flight; anything else (X lost, X's encode
        # failed, no encoder known) will not end by itself.
        if not reason.startswith("waiting for encoder"):
            return f"heartbeat: {reason}"[:500]
    return None


def encoder_failover(*, preset: str, workers: dict[str, GpuWorker], now: datetime, outbox: Outbox) -> dict:
    """Give every ready worker without E whose encoder was lost another one (``set_encoder``, same
    region first), and re-send the prompts such workers refused for lack of an encoder once one is
    ready. Returns what it did for the run's decision record: ``{"encoder_failover": {worker:
    {"from", "to" | "waiting", "reason"}}, "prompts_resent": [prompt ids]}`` (empty keys left out)."""
    dependants = [
        w
        for w in workers.values()
        if w.status == GpuWorker.Status.READY and w.holds_sessions and "E" not in w.stage_role
    ]
    if not dependants:
        return {}
    ready_encoders = {
        w.name for w in workers.values() if w.status == GpuWorker.Status.READY and w.stage_role == "E"
    }
    current = current_encoders(dependants)
    in_flight = set(
        WorkerCommand.objects.filter(
            worker__in=dependants, kind=WorkerCommand.Kind.SET_ENCODER, status=WorkerCommand.Status.SENT
        ).values_list("worker__name", flat=True)
    )
    failover: dict[str, dict] = {}
    for worker in dependants:
        if worker.name in in_flight:
            continue
        why = _encoder_lost(worker, current.get(worker.name), ready_encoders)
        if why is None:
            continue
        entry = {"from": current.get(worker.name) or None, "reason": why}
        try:
            encoder = encoder_for(worker, exclude=current.get(worker.name))
        except EncoderMissing as exc:
            failover[worker.name] = {**entry, "waiting": f"waiting for an encoder: {exc}"}
            continue
        # ``lost`` and ``why`` are for the record (console, audit); the worker reads ``encoder``.
        outbox.command(worker, WorkerCommand.Kind.SET_ENCODER, encoder=encoder, lost=entry["from"], why=why)
        failover[worker.name] = {**entry, "to": encoder["worker"]}
        logger.warning(
            "stages.encoder_failover preset=%s worker=%s from=%s to=%s reason=%s",
            preset,
            worker.name,
            entry["from"],
            encoder["worker"],
            why,
        )
    out: dict = {"encoder_failover": failover} if failover else {}
    resent = _refused_prompts_resend(dependants, outbox)
    if resent:
        out["prompts_resent"] = resent
    return out


def _refused_prompts_resend(dependants: list[GpuWorker], outbox: Outbox) -> list[int]:
    """A prompt a worker without E refused for its encoder — it came without one (none was ready), or
    the one it named could not be used — goes to it again with a ready one (not the one refused) —
    once per refused command (a re-sent prompt refused again is left to the record), and only while
    the session is still on that worker (elsewhere its start or resume carries the whole prompt
    history)."""
    refused = list(
        WorkerCommand.objects.filter(
            worker__in=dependants,
            kind=WorkerCommand.Kind.PROMPT,
            status=WorkerCommand.Status.REFUSED,
            session__worker=F("worker"),
            session__status__in=[GenerationSession.Status.EXECUTING, GenerationSession.Status.MIGRATING],
        )
        # Refused for the encoder: sent without one (none was ready), or the one named was unusable.
        .filter(~Q(payload__has_key="encoder") | Q(reason__icontains="encoder"))
        .exclude(payload__has_key="resent")
        .select_related("worker", "session")
        .order_by("created_at")
    )
    if not refused:
        return []
    # A prompt already re-sent (the payload names the refused command) is not sent twice.
    done = set(
        WorkerCommand.objects.filter(
            kind=WorkerCommand.Kind.PROMPT, payload__resent__in=[str(c.pk) for c in refused]
        ).values_list("payload__resent", flat=True)
    )
    resent: list[int] = []
    for command in refused:
        if str(command.pk) in done:
            continue
        named = (command.payload.get("encoder") or {}).get("worker")
        try:
            encoder = encoder_for(command.worker, exclude=named)
        except EncoderMissing:
            continue
        session = command.session
        payload = {
            k: v for k, v in command.payload.items() if k not in ("id", "kind", "session", "epoch", "encoder")
        }
        outbox.command(
            command.worker,
            WorkerCommand.Kind.PROMPT,
            session=session,
            epoch=session.epoch,
            **payload,
            encoder=encoder,
            resent=str(command.pk),
        )
        resent.append(payload.get("prompt_id"))
        logger.info(
            "stages.prompt_resent session=%s worker=%s prompt=%s refused_command=%s",
            session.pk,
            command.worker.name,
            payload.get("prompt_id"),
            command.pk,
        )
    return resent


def new_worker_role(preset: str) -> str:
    """The role a worker the provisioner starts for ``preset`` gets (``--stages``): E when workers
    without E are live and no E worker is (nor is being started), else the whole pipeline."""
    live = GpuWorker.objects.filter(model_preset=preset, status__in=GpuWorker.LIVE_STATUSES)
    needs = live.filter(stage_role__in=[r for r in STAGE_ROLES if "E" not in r and "D" in r]).exists()
    return "E" if needs and not live.filter(stage_role="E").exists() else "EDC"


def _encoder_pool_change(
    *, ready: dict[str, GpuWorker], busy: set[str], now: datetime, row: SchedulerState
) -> tuple[str, str] | None:
    """One worker to turn into E, and why, when the pool's encoders are too few: none ready while
    workers without E are, or the E workers' reported encode queue averages ``STAGE_ENCODER_QUEUE_MAX``
    or more (at most one growth per trigger window). The worker is an idle session holder, never the last
    one; ``None`` when no change is due or no worker can be spared."""
    encoders = [w for w in ready.values() if w.stage_role == "E"]
    holders = [w for w in ready.values() if w.holds_sessions]
    last = row.state.get("encoder_pool_at")
    if not holders or (last is not None and now.timestamp() - last < settings.STREAMSERVE["STAGE_WINDOW_S"]):
        return None  # at most one growth per trigger window: a refused change is not retried at once
    if not encoders:
        if all("E" in w.stage_role for w in holders):
            return None
        why = "no ready E worker while workers without E serve"
    else:
        queue = sum(w.encoder_load for w in encoders) / len(encoders)
        if queue < settings.STREAMSERVE["STAGE_ENCODER_QUEUE_MAX"]:
            return None
        why = f"E workers' encode queue averages {queue:g} (≥ {settings.STREAMSERVE['STAGE_ENCODER_QUEUE_MAX']})"
    idle = sorted(
        (w for w in holders if w.name not in busy),
        key=lambda w: ("E" in w.stage_role, w.name),  # a DC worker first: EDC keeps serving alone
    )
    if not idle or len(holders) < 2:
        logger.warning("stages.encoder_pool_short no idle worker can become E: %s", why)
        return None
    return idle[0].name, why


def _encoder_pool_grow(
    *,
    preset: str,
    ready: dict[str, GpuWorker],
    change: tuple[str, str],
    now: datetime,
    row: SchedulerState,
    outbox: Outbox,
    workers: dict[str, GpuWorker],
) -> StagePlacement:
    """Record and start a one-worker placement that turns ``change[0]`` into an E worker."""
    name, why = change
    current = {n: w.stage_role for n, w in ready.items()}
    placement = StagePlacement.objects.create(
        created_at=now,
        preset=preset,
        reason=StagePlacement.Reason.ENCODER_POOL,
        roles_before=current,
        roles_after={**current, name: "E"},
        trigger={
            "why": why,
            "encoders": {n: w.encoder_load for n, w in ready.items() if w.stage_role == "E"},
            "encoder_queue_max": settings.STREAMSERVE["STAGE_ENCODER_QUEUE_MAX"],
        },
    )
    StageRoleChange.objects.create(
        placement=placement, worker=ready[name], from_role=current[name], to_role="E", order=0, created_at=now
    )
    row.state = {**row.state, "encoder_pool_at": now.timestamp()}
    row.save(update_fields=["state", "updated_at"])
    logger.info("stages.encoder_pool id=%s preset=%s worker=%s: %s", placement.pk, preset, name, why)
    _progress(preset=preset, workers=workers, now=now, outbox=outbox)
    placement.refresh_from_db()
    return placement


# --- E and C workers the plan no longer needs -------------------------------------------------------


def _aux_shrink_change(
    *, ready: dict[str, GpuWorker], plan_roles: Sequence[str], grown_recently: bool = False
) -> tuple[str, str, str] | None:
    """One idle auxiliary worker to re-place, ``(worker, to_role, why)``, when the plan has fewer E (or
    C) workers than are ready: an E (C) worker whose heartbeat reports an empty encode (decode)
    queue, never the last E while a worker without E holds D, nor the last C while one without C
    does, nor an E worker while the pool grew its encoders within the plan's history
    (``grown_recently``: the growth answered a queue the mix may not show yet). It takes the
    D-carrying role the plan is shortest of against the pool (EDC when none is)."""
    current = Counter(w.stage_role for w in ready.values())
    planned = Counter(plan_roles)
    for stage, service in (("E", "encoder"), ("C", "decoder")):
        if current[stage] <= planned[stage] or (stage == "E" and grown_recently):
            continue
        dependants = [w for w in ready.values() if "D" in w.stage_role and stage not in w.stage_role]
        if dependants and current[stage] <= 1:
            continue
        idle = sorted(
            (w for w in ready.values() if w.stage_role == stage and w.service_load(service) == 0),
            key=lambda w: w.name,
        )
        if not idle:
            continue
        short = {r: planned[r] - current[r] for r in ("EDC", "DC", "ED", "D") if planned[r] > current[r]}
        to_role = max(short, key=lambda r: (short[r], r == "EDC")) if short else "EDC"
        why = f"the plan needs {planned[stage]} {stage} worker(s), {current[stage]} are ready"
        return idle[0].name, to_role, why
    return None


def _aux_shrink_step(
    *,
    preset: str,
    ready: dict[str, GpuWorker],
    now: datetime,
    row: SchedulerState,
    outbox: Outbox,
    workers: dict[str, GpuWorker],
) -> StagePlacement | None:
    """At most once per trigger window, with E or C workers ready: plan from the live mix and, when
    the plan needs fewer of them, re-place one idle one (``_aux_shrink_change``) as a one-change
    placement (reason ``aux_shrink``). The §5.3 trigger needs a backlog to fire, so without this an
    encoder the pool grew, or a decoder a job mix asked for, would stay when nothing waits."""
    if not any(w.stage_role in ("E", "C") for w in ready.values()):
        return None
    window = settings.STREAMSERVE["STAGE_WINDOW_S"]
    last = row.state.get("aux_shrink_at")
    if last is not None and now.timestamp() - last < window:
        return None
    row.state = {**row.state, "aux_shrink_at": now.timestamp()}
    row.save(update_fields=["state", "updated_at"])
    pipeline, gpu = _pipeline(), _gpu_spec(ready.values())
    mix = live_mix(preset=preset, now=now, window_s=window, pipeline=pipeline, gpu=gpu)
    try:
        plan = plan_placement(
            pipeline,
            mix.job_shapes,
            len(ready),
            gpu,
            encode_only_s=mix.encode_only_s,
            stream_shapes=mix.stream_shapes,
        )
    except PlacementError:
        return None
    grown = row.state.get("encoder_pool_at")
    grown_recently = grown is not None and now.timestamp() - grown < HISTORY_WINDOWS * window
    change = _aux_shrink_change(ready=ready, plan_roles=plan.roles, grown_recently=grown_recently)
    if change is None:
        return None
    name, to_role, why = change
    current = {n: w.stage_role for n, w in ready.items()}
    placement = StagePlacement.objects.create(
        created_at=now,
        preset=preset,
        reason=StagePlacement.Reason.AUX_SHRINK,
        roles_before=current,
        roles_after={**current, name: to_role},
        trigger={"why": why, "plan_roles": dict(sorted(Counter(plan.roles).items())), "mix": mix.to_json()},
    )
    StageRoleChange.objects.create(
        placement=placement,
        worker=ready[name],
        from_role=current[name],
        to_role=to_role,
        order=0,
        created_at=now,
    )
    logger.info(
        "stages.aux_shrink id=%s preset=%s worker=%s to=%s: %s", placement.pk, preset, name, to_role, why
    )
    _progress(preset=preset, workers=workers, now=now, outbox=outbox)
    placement.refresh_from_db()
    return placement
