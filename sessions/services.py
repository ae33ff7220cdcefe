"""What users do to their sessions: create, prompt, pause, resume, terminate.

Each records the session event the scheduler and trace export read; ``sessions.lifecycle``
announces it after commit (status to the clients, ``session_event_committed`` to the scheduler),
so nothing is announced that did not commit. Status changes are ``sessions.lifecycle`` transitions.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from datetime import datetime, timedelta

from django.conf import settings
from django.contrib.auth import get_user_model
from django.contrib.postgres.fields import ArrayField
from django.core.exceptions import ValidationError
from django.db import transaction
from django.db.models import Count, F, Func, IntegerField, Max, Min, QuerySet, Sum, Value
from django.db.models import FloatField as _Float
from django.db.models.functions import Coalesce, Trunc
from django.utils import timezone

from contracts.catalog import PRESETS, parse_resolution
from contracts.wire.records import ChunkRow, chunk_deliveries_append
from gpu import selectors as gpu_selectors
from sessions import lifecycle, tenants
from sessions.ingest import records_client
from sessions.lifecycle import event_record
from sessions.models import (
    LATENCY_BUCKETS_MS,
    ChunkLatencyRollup,
    ChunkRecord,
    GenerationSession,
    Prompt,
    SessionEvent,
    Tenant,
)

Status = GenerationSession.Status
Activity = GenerationSession.Activity

MAX_SEED = 2**63 - 1


@dataclass(frozen=True)
class SessionSpec:
    """A validated request for a new session."""

    model_name: str
    width: int
    height: int
    fps: int
    frames_per_chunk: int
    load: float
    seed: int
    prompt: str


def validate_prompt(text: object, *, field: str = "prompt") -> str:
    """A prompt PostgreSQL can store: a non-empty string, bounded, no NUL, no lone surrogate.

    Every entry point (REST, the session socket) comes through here, so none of them can hand the
    database a text it refuses (NUL: ``DataError``; a lone surrogate such as a JSON ``"\\ud800"``:
    ``UnicodeEncodeError``).
    """
    if not isinstance(text, str):
        raise ValidationError({field: "must be a string"})
    if "\x00" in text:
        raise ValidationError({field: "must not contain NUL characters"})
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        raise ValidationError({field: "must be valid Unicode text (it holds a lone surrogate)"}) from None
    cleaned = text.strip()
    if not cleaned:
        raise ValidationError({field: "must not be empty"})
    limit = settings.STREAMSERVE["MAX_PROMPT_CHARS"]
    # The text as sent, as the schema's maxLength counts it: surrounding whitespace is trimmed
    # after, so a schema-invalid request is never accepted (the schema test found one).
    if len(text) > limit:
        raise ValidationError({field: f"must be at most {limit} characters (got {len(text)})"})
    return cleaned


def session_spec_build(
    *, prompt: str, model_name: str, resolution: str | None, seed: int | None
) -> SessionSpec:
    """Validate a creation request against the model catalogue; raise ValidationError per field."""
    errors: dict[str, str] = {}
    preset = PRESETS.get(model_name)
    served = settings.STREAMSERVE["SERVED_MODELS"]
    if preset is None:
        errors["model"] = f"unknown model {model_name!r}; available: {', '.join(sorted(PRESETS))}"
    elif preset.name not in served:
        errors["model"] = f"{preset.name} is not served by this deployment; served: {', '.join(served)}"
        preset = None
    resolution = resolution or (preset.default_resolution if preset else None)
    width = height = 0
    if preset is not None and resolution is not None:
        try:
            width, height = parse_resolution(resolution)
        except ValueError as exc:
            errors["resolution"] = str(exc)
        else:
            canonical = f"{width}x{height}"
            if canonical not in preset.resolutions:
                errors["resolution"] = (
                    f"{canonical} is not supported by {preset.name}; supported: {', '.join(preset.resolutions)}"
                )
            resolution = canonical
    if seed is None:
        seed = random.SystemRandom().randrange(0, 2**31)
    elif isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed <= MAX_SEED:
        errors["seed"] = f"must be an integer between 0 and {MAX_SEED}"
    try:
        prompt = validate_prompt(prompt)
    except ValidationError as exc:
        errors.update({k: v[0] for k, v in exc.message_dict.items()})
    if errors:
        raise ValidationError(errors)
    assert preset is not None and resolution is not None
    return SessionSpec(
        model_name=preset.name,
        width=width,
        height=height,
        fps=preset.fps,
        frames_per_chunk=preset.frames_per_chunk,
        load=preset.load_for(resolution),
        seed=seed,
        prompt=prompt,
    )


class SessionTerminated(Exception):
    """The session has ended: it takes no more prompts, pauses or resumes (start a new session)."""


class LiveSessionLimit(Exception):
    """The owner already holds ``MAX_LIVE_SESSIONS_PER_USER`` sessions that are not terminated."""


def owner_limit_check(
    owner, held: QuerySet, *, setting: str, error: type[Exception], what: str, advice: str
) -> None:
    """Raise ``error`` when ``owner`` already holds ``STREAMSERVE[setting]`` of ``held`` (their
    ``what``, e.g. "live sessions"); the message ends with ``advice``. Call it in a transaction:
    the owner's row is the lock, so two concurrent creations cannot both count limit - 1 (``held``
    is lazy and counted after the lock)."""
    limit = settings.STREAMSERVE[setting]
    get_user_model().objects.select_for_update().get(pk=owner.pk)
    count = held.count()
    if count >= limit:
        raise error(f"you already have {count} {what} (the limit is {limit}); {advice}")


def origin_validate(origin: str | None) -> str:
    """A session's user origin: empty, or one some region has an RTT for (``Region.rtt_ms``)."""
    origin = (origin or "").strip()
    if origin and origin not in gpu_selectors.known_origins():
        known = ", ".join(sorted(gpu_selectors.known_origins())) or "none configured"
        raise ValidationError({"origin": f"unknown origin {origin!r} (known: {known})"})
    return origin


@transaction.atomic
def session_create(
    *, owner, spec: SessionSpec, origin: str = "", tenant: Tenant | None = None
) -> GenerationSession:
    """A new session: it arrives and, since its user is typing into it, becomes active at once.

    ``origin`` (validated by ``origin_validate``) is where its user connects from; the scheduler
    routes the session to a region on its arrival (``scheduling.live.regions``). ``tenant`` is the
    one the owner acts for (``tenants.tenant_acting_for``; default: their default tenant).

    Raises ``LiveSessionLimit`` when the owner already holds ``MAX_LIVE_SESSIONS_PER_USER`` live
    sessions: one user must not fill the queue and the GPUs on their own; ``tenants.QuotaExceeded``
    when the tenant's hard quota is spent.
    """
    origin = origin_validate(origin)
    tenant = tenant or tenants.tenant_acting_for(user=owner)
    tenants.quota_admit_session(tenant=tenant)
    owner_limit_check(
        owner,
        GenerationSession.objects.filter(owner=owner).exclude(status=Status.TERMINATED),
        setting="MAX_LIVE_SESSIONS_PER_USER",
        error=LiveSessionLimit,
        what="live sessions",
        advice="terminate one to start another",
    )
    now = timezone.now()
    session = GenerationSession.objects.create(
        owner=owner,
        tenant=tenant,
        model_name=spec.model_name,
        width=spec.width,
        height=spec.height,
        fps=spec.fps,
        frames_per_chunk=spec.frames_per_chunk,
        load=spec.load,
        seed=spec.seed,
        activity=Activity.ACTIVE,
        last_active_at=now,
        origin=origin,
    )
    Prompt.objects.create(session=session, text=spec.prompt, from_chunk=0)
    event_record(
        session,
        SessionEvent.Kind.ARRIVE,
        at=now,
        load=spec.load,
        model=spec.model_name,
        resolution=session.resolution,
    )
    event_record(session, SessionEvent.Kind.ACTIVE, at=now)
    return session


def _locked(session: GenerationSession) -> GenerationSession:
    return GenerationSession.objects.select_for_update(no_key=True).get(pk=session.pk)


@transaction.atomic
def session_prompt_add(*, session: GenerationSession, text: str) -> Prompt:
    """Add a prompt; it applies from the next chunk the session generates. ``SessionTerminated`` once
    the session has ended."""
    text = validate_prompt(text, field="text")
    session = _locked(session)
    if session.is_terminated:
        raise SessionTerminated("the session is terminated; start a new session")
    prompt = Prompt.objects.create(session=session, text=text, from_chunk=session.chunks_generated)
    event_record(session, SessionEvent.Kind.PROMPT, prompt_id=prompt.pk, from_chunk=prompt.from_chunk)
    return prompt


@transaction.atomic
def session_pause(*, session: GenerationSession, reason: str | None = None) -> GenerationSession:
    """The user went idle (α=0): the scheduler may suspend the session. Idempotent;
    ``SessionTerminated`` once the session has ended. ``reason`` goes into the idle event when the
    platform, not the user, made it idle (``no_viewers``: ``sessions.viewers``)."""
    session = _locked(session)
    if session.is_terminated:
        raise SessionTerminated("the session is terminated; start a new session")
    if session.activity != Activity.IDLE:
        session.activity = Activity.IDLE
        session.save(update_fields=["activity"])
        event_record(session, SessionEvent.Kind.IDLE, **({"reason": reason} if reason else {}))
    return session


@transaction.atomic
def session_resume(*, session: GenerationSession) -> GenerationSession:
    """The user is back (α=1): the scheduler must execute the session. Idempotent;
    ``SessionTerminated`` once the session has ended."""
    session = _locked(session)
    if session.is_terminated:
        raise SessionTerminated("the session is terminated; start a new session")
    if session.activity != Activity.ACTIVE:
        session.activity = Activity.ACTIVE
        session.last_active_at = timezone.now()
        session.save(update_fields=["activity", "last_active_at"])
        event_record(session, SessionEvent.Kind.ACTIVE)
    return session


@transaction.atomic
def session_terminate(*, session: GenerationSession, reason: str = "user") -> GenerationSession:
    """End the session and forget where it ran. Idempotent: terminating twice changes nothing.

    The depart event names the workers that held its state so the scheduler can tell them to free it.
    """
    session = _locked(session)
    if not session.is_terminated:
        lifecycle.session_end(session=session, reason=reason)
    return session


# --- Audit plane: rollups and retention -------------------------------------------------------

ROLLUP_LOOKBACK = timedelta(minutes=10)


def chunk_rollup(*, until: datetime | None = None, since: datetime | None = None) -> int:
    """(Re)compute per-minute, per-worker rollups of chunk records for minutes in [since, until).

    By default a run starts ``ROLLUP_LOOKBACK`` before the newest rolled-up minute (or at the oldest
    chunk record when nothing is rolled up yet), so a gap while beat was down is caught up and chunk
    records written late by a worker's batcher are folded in; rows are upserted. Only closed minutes
    (before ``until``, floored to the minute) are rolled up. Returns the number of rollup rows written.
    """
    until = (until or timezone.now()).replace(second=0, microsecond=0)
    if since is None:
        newest = ChunkLatencyRollup.objects.aggregate(m=Max("minute"))["m"]
        oldest = ChunkRecord.objects.aggregate(m=Min("created_at"))["m"]
        since = (newest - ROLLUP_LOOKBACK) if newest else (oldest or until)
    base = ChunkRecord.objects.filter(created_at__gte=since, created_at__lt=until).annotate(
        minute=Trunc("created_at", "minute")
    )
    bounds = Value(list(LATENCY_BUCKETS_MS), output_field=ArrayField(_Float()))
    per_bucket = (
        base.annotate(
            bucket=Func(F("generation_ms"), bounds, function="width_bucket", output_field=IntegerField())
        )
        .values("minute", "worker_id", "bucket")
        .annotate(n=Count("id"))
    )
    histograms: dict[tuple, list[int]] = {}
    for row in per_bucket:
        hist = histograms.setdefault((row["minute"], row["worker_id"]), [0] * (len(LATENCY_BUCKETS_MS) + 1))
        hist[row["bucket"]] += row["n"]
    sums = base.values("minute", "worker_id", "worker__name", "worker__gpu_type").annotate(
        count=Count("id"),
        sum_generation_ms=Sum("generation_ms"),
        max_generation_ms=Max("generation_ms"),
        sum_delivery_ms=Coalesce(Sum("delivery_ms"), 0.0),
        delivered=Count("delivery_ms"),
    )
    rollups = [
        ChunkLatencyRollup(
            minute=row["minute"],
            worker_id=row["worker_id"],
            worker_name=row["worker__name"] or "(unknown)",
            gpu_type=row["worker__gpu_type"] or "",
            count=row["count"],
            sum_generation_ms=row["sum_generation_ms"],
            max_generation_ms=row["max_generation_ms"],
            sum_delivery_ms=row["sum_delivery_ms"],
            delivered=row["delivered"],
            histogram=histograms[(row["minute"], row["worker_id"])],
        )
        for row in sums
    ]
    ChunkLatencyRollup.objects.bulk_create(
        rollups,
        update_conflicts=True,
        unique_fields=["minute", "worker_name"],
        update_fields=[
            "count",
            "sum_generation_ms",
            "max_generation_ms",
            "sum_delivery_ms",
            "delivered",
            "histogram",
        ],
        batch_size=1000,
    )
    return len(rollups)


def chunk_records_prune(*, now: datetime | None = None, batch_size: int = 10_000) -> int:
    """Delete raw chunk records past the retention window, in batches, once their minute is rolled up.

    Retention: ``CHUNK_RETENTION_DAYS`` (default 14) of raw rows; rollups are kept indefinitely.
    """
    now = now or timezone.now()
    cutoff = now - timedelta(days=settings.STREAMSERVE["CHUNK_RETENTION_DAYS"])
    newest_rollup = ChunkLatencyRollup.objects.aggregate(m=Max("minute"))["m"]
    if newest_rollup is None:
        return 0
    # Rollups cover whole closed minutes up to and including the newest one.
    cutoff = min(cutoff, newest_rollup + timedelta(minutes=1))
    deleted = 0
    while True:
        ids = list(
            ChunkRecord.objects.filter(created_at__lt=cutoff).values_list("id", flat=True)[:batch_size]
        )
        if not ids:
            return deleted
        deleted += ChunkRecord.objects.filter(id__in=ids).delete()[0]


def chunk_deliveries_record(*, deliveries: list[ChunkRow]) -> None:
    """Hand delivery latencies measured by WebSocket consumers to the chunk-record stream.

    Each is a full row (the chunk's header plus ``delivery_ms``), which the ingester
    (``sessions.ingest``) upserts: a delivery measured before the worker's record is ingested lands
    all the same, and one measured after it fills the record's empty ``delivery_ms``. Redis, not
    PostgreSQL: a busy socket's flush costs one pipelined round trip.
    """
    chunk_deliveries_append(records_client(), deliveries)
