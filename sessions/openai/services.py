"""OpenAI's requests as one-shot jobs: the mapping of ``size`` and ``seconds`` to the model's
resolution and frames, submission through ``sessions.jobs``, and the image request's wait.

Validation is the jobs system's (``job_spec_build``: the catalogue, the served models, the prompt,
the bounds); its field names are translated to OpenAI's parameters (``resolution`` → ``size``,
``frames`` → ``seconds``), so an error names what the client sent.
"""

from __future__ import annotations

import time
from decimal import ROUND_HALF_UP, Decimal, InvalidOperation

from django.conf import settings
from django.core.exceptions import ValidationError
from django.db import transaction
from django.utils import timezone

from contracts.catalog import PRESETS, ModelPreset
from sessions import jobs
from sessions.models import Job, Tenant

# The jobs system's field → OpenAI's parameter.
PARAMS = {"resolution": "size", "frames": "seconds"}
# Longer is no clip (and its frame count would not fit a Decimal's precision).
MAX_SECONDS = 999_999
# OpenAI's default clip length (the SDK's docs: "Defaults to 4 seconds").
DEFAULT_SECONDS = Decimal(4)
# How often the image request looks at its jobs: first soon (a small image takes a fraction of a
# second), then every half second at most.
FIRST_POLL_S, MAX_POLL_S = 0.05, 0.5


class ImagesTimedOut(Exception):
    """The images were not ready within ``OPENAI_IMAGES_TIMEOUT_S`` (their jobs are cancelled)."""


class ImageFailed(Exception):
    """One of the images failed or was cancelled (the others are cancelled)."""

    def __init__(self, job: Job) -> None:
        super().__init__(job.error or f"image job {job.pk} was {job.state}")
        self.job = job


def frames_bounds(preset: ModelPreset) -> tuple[int, int]:
    """The fewest and most frames of a video of this model: the jobs' bounds (2..``JOB_MAX_FRAMES``)
    within the model's own (``max_job_frames``), in whole latent frames."""
    unit = preset.job_frame_unit
    most = settings.STREAMSERVE["JOB_MAX_FRAMES"]
    if preset.max_job_frames is not None:
        most = min(most, preset.max_job_frames)
    return max(2, unit), most // unit * unit


def seconds_to_frames(preset: ModelPreset, seconds: Decimal) -> int:
    """``seconds`` × the model's fps, rounded half up to a whole number of latent frames; a 400
    naming ``seconds`` (with the accepted range in seconds) outside the jobs' frame bounds."""
    unit = preset.job_frame_unit
    low, high = frames_bounds(preset)
    latent = (seconds * preset.fps / unit).quantize(Decimal(1), rounding=ROUND_HALF_UP)
    frames = int(latent) * unit
    if not low <= frames <= high:
        raise ValidationError(
            {
                "seconds": f"{preset.name} makes videos of {low / preset.fps:g} to {high / preset.fps:g} "
                f"seconds ({preset.fps} fps, in steps of {unit / preset.fps:g} s); got {seconds}"
            }
        )
    return frames


def frames_to_seconds(job: Job) -> str:
    """The clip's length as OpenAI writes it ("4"), from its frames at its model's fps."""
    preset = PRESETS.get(job.model_name)
    if job.kind != Job.Kind.VIDEO or preset is None:
        return "0"
    return f"{job.frames / preset.fps:g}"


def parse_seconds(value: object) -> Decimal:
    """``"4"``, ``"2.5"`` or a JSON number; a 400 naming ``seconds`` otherwise."""
    if isinstance(value, bool) or not isinstance(value, str | int | float):
        raise ValidationError({"seconds": 'must be a number of seconds, as a string ("4") or a number'})
    try:
        seconds = Decimal(str(value).strip())
    except InvalidOperation:
        seconds = Decimal("NaN")
    if not seconds.is_finite() or not 0 < seconds <= MAX_SECONDS:
        raise ValidationError({"seconds": f"must be a positive number of seconds, got {value!r}"})
    return seconds


def _spec(
    *,
    kind: str,
    model_name: str,
    prompt: str,
    size: str | None,
    frames: int | None,
    seed: int | None = None,
    slo_s: float | None = None,
) -> jobs.JobSpec:
    try:
        return jobs.job_spec_build(
            kind=kind,
            prompt=prompt,
            model_name=model_name,
            resolution=size,
            frames=frames,
            steps=None,
            seed=seed,
            slo_s=slo_s,
            deadline=None,
            priority=0,
            now=timezone.now(),
        )
    except ValidationError as exc:
        raise ValidationError(
            {PARAMS.get(field, field): messages for field, messages in exc.message_dict.items()}
        ) from exc


def served_preset(model_name: str) -> ModelPreset:
    """The model's catalogue entry; a 400 naming ``model`` unless this deployment serves it."""
    served = settings.STREAMSERVE["SERVED_MODELS"]
    preset = PRESETS.get(model_name)
    if preset is None or preset.name not in served:
        raise ValidationError({"model": f"{model_name!r} is not served here; served: {', '.join(served)}"})
    return preset


def video_submit(
    *,
    owner,
    model_name: str,
    prompt: str,
    size: str | None,
    seconds: Decimal | None,
    tenant: Tenant | None = None,
) -> Job:
    """``POST /v1/videos``: one video job of ``seconds`` (``parse_seconds``; default 4) × fps
    frames, for ``tenant`` (default: the owner's). Raises ``jobs.JobLimit``,
    ``tenants.QuotaExceeded``."""
    preset = served_preset(model_name)
    frames = seconds_to_frames(preset, DEFAULT_SECONDS if seconds is None else seconds)
    spec = _spec(kind=Job.Kind.VIDEO, model_name=model_name, prompt=prompt, size=size, frames=frames)
    return jobs.job_submit(owner=owner, spec=spec, tenant=tenant)


@transaction.atomic
def images_submit(
    *,
    owner,
    model_name: str,
    prompt: str,
    size: str | None,
    n: int,
    seed: int | None,
    tenant: Tenant | None = None,
) -> list[Job]:
    """``n`` image jobs in one transaction: all or none pass the per-user limit (``jobs.JobLimit``).
    Each is its own job (the dispatcher puts images of one size on one worker, whose engine
    batches them: docs/jobs.md); ``seed`` makes them ``seed``, ``seed + 1`` …; the client waits,
    so their deadline is ``OPENAI_IMAGES_TIMEOUT_S``."""
    slo_s = settings.STREAMSERVE["OPENAI_IMAGES_TIMEOUT_S"]
    submitted = []
    for index in range(n):
        spec = _spec(
            kind=Job.Kind.IMAGE,
            model_name=model_name,
            prompt=prompt,
            size=size,
            frames=None,
            seed=None if seed is None else seed + index,
            slo_s=slo_s,
        )
        submitted.append(jobs.job_submit(owner=owner, spec=spec, tenant=tenant))
    return submitted


def images_wait(*, job_ids: list, timeout_s: float) -> list[Job]:
    """The jobs, in order, once all are done. Polls PostgreSQL (outside any transaction, so each
    read sees the workers' committed reports); raises ``ImageFailed`` or ``ImagesTimedOut`` after
    cancelling the others, which nobody will fetch."""
    deadline = time.monotonic() + timeout_s
    interval = FIRST_POLL_S
    while True:
        found = {job.pk: job for job in Job.objects.filter(pk__in=job_ids)}
        ordered = [found[pk] for pk in job_ids]
        ended_badly = next((j for j in ordered if j.state in (Job.State.FAILED, Job.State.CANCELLED)), None)
        if ended_badly is not None:
            images_cancel(ordered)
            raise ImageFailed(ended_badly)
        if all(job.state == Job.State.DONE for job in ordered):
            return ordered
        left = deadline - time.monotonic()
        if left <= 0:
            images_cancel(ordered)
            raise ImagesTimedOut(f"the images were not ready within {timeout_s:g} s")
        time.sleep(min(interval, left))
        interval = min(interval * 2, MAX_POLL_S)


def images_cancel(submitted: list[Job]) -> None:
    for job in submitted:
        if job.in_flight:
            jobs.job_cancel(job=job)
