"""What a live stage plan is made from, read from the rows: the one-shot jobs of the recent trigger
windows and the queued ones, the streams' chunks and prompt encodes (``live_mix``), the stage ops the
§5.3 trigger counts (``stage_ops``), and the pool's state (busy workers, a missing encoder)."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from datetime import datetime, timedelta

from django.conf import settings
from django.db.models import Count, Q

from gpu.models import GpuWorker
from scheduling.core.stages.placement import PlacementError, preferred_type, stream_fits
from scheduling.core.stages.stage_profiles import GPUS, GpuSpec, PipelineProfile, Shape, get_gpu, get_pipeline
from scheduling.models import WorkerCommand
from sessions.models import ChunkRecord, GenerationSession, Job, Prompt

# The plan sees the requests of the last few trigger windows, as the simulator's re-placement does.
HISTORY_WINDOWS = 5
# A prompt encode's cost does not depend on the output size (encode is 2·P·text_len FLOPs).
STREAM_SHAPE = Shape(64, 64, 1, 1)
# Bounds the plan's input (Alg. 2 looks at every request once): beyond it, the streams' chunks are
# counted at a common scale.
MAX_STREAM_CHUNKS = 2048


def stage_pipeline() -> PipelineProfile:
    return get_pipeline(settings.STREAMSERVE["STAGE_PIPELINE"])


def stage_gpu(workers: Iterable[GpuWorker]) -> GpuSpec:
    """The analytic spec of the pool's GPUs: the first worker's type where the profiles know it (a
    live pool of one preset is of one type in practice), else ``STAGE_GPU``."""
    for worker in workers:
        if worker.gpu_type.lower() in GPUS:
            return get_gpu(worker.gpu_type)
    return get_gpu(settings.STREAMSERVE["STAGE_GPU"])


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


def stage_ops(*, preset: str, since: datetime, until: datetime) -> list[tuple[float, str]]:
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


def busy_workers(workers: Iterable[GpuWorker]) -> set[str]:
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


def encoder_missing(workers: Iterable[GpuWorker]) -> bool:
    ready = [w for w in workers if w.status == GpuWorker.Status.READY]
    return any(w.holds_sessions and "E" not in w.stage_role for w in ready) and not any(
        w.stage_role == "E" for w in ready
    )
