"""Reads of sessions and chunk records, including the per-chunk latency audit."""

from __future__ import annotations

import bisect
from datetime import timedelta

from django.conf import settings
from django.db.models import Aggregate, Count, F, FloatField, Max, OuterRef, Q, QuerySet, Subquery, Sum
from django.db.models.functions import Extract, Trunc
from django.urls import reverse
from django.utils import timezone

from contracts.http.timerange import TimeRange
from gpu.selectors import region_name
from sessions.models import (
    LATENCY_BUCKETS_MS,
    ChunkLatencyRollup,
    ChunkRecord,
    GenerationSession,
    Job,
    SessionEvent,
)


def sessions_visible_to(user) -> QuerySet[GenerationSession]:
    """Staff see every session; everyone else only their own (others' are 404, not 403)."""
    qs = GenerationSession.objects.select_related("worker", "host_worker", "owner", "region", "tenant")
    return qs if user.is_staff else qs.filter(owner=user)


class PercentileCont(Aggregate):
    """PostgreSQL's exact ``percentile_cont(p) WITHIN GROUP (ORDER BY expr)``."""

    function = "percentile_cont"
    template = "%(function)s(%(percentile)s) WITHIN GROUP (ORDER BY %(expressions)s)"
    output_field = FloatField()

    def __init__(self, expression, percentile: float, **extra):
        if not 0 <= percentile <= 1:
            raise ValueError("percentile must be within [0, 1]")
        super().__init__(expression, percentile=float(percentile), **extra)


def _slo_ms(slo_ms: float | None) -> float:
    return float(slo_ms if slo_ms is not None else settings.STREAMSERVE["SLO_MS"])


def latency_buckets(*, time_range: TimeRange, slo_ms: float | None = None, source: str = "auto") -> dict:
    """Per-chunk generation latency over [start, end) per bucket: count, p50, p95, p99, max, SLO pass rate;
    each bucket and the totals also ``by_region`` (a chunk's region is its worker's, the local
    region's for a worker without one, like the cost audit's).

    ``source``: ``raw`` computes exact percentiles from chunk records; ``rollup`` computes them from
    the per-minute histograms (±7.5 %); ``auto`` uses raw records while the range is inside the raw
    retention window, rollups otherwise.
    """
    slo = _slo_ms(slo_ms)
    if source == "auto":
        oldest_raw = timezone.now() - timedelta(days=settings.STREAMSERVE["CHUNK_RETENTION_DAYS"])
        source = "raw" if time_range.start >= oldest_raw else "rollup"
    if source == "raw":
        buckets = _latency_from_raw(time_range, slo)
        regional = _latency_from_raw(time_range, slo, by_region=True)
    elif source == "rollup":
        buckets = _latency_from_rollups(time_range, slo)
        regional = _latency_from_rollups(time_range, slo, by_region=True)
    else:
        raise ValueError(f"unknown source {source!r}")
    by_bucket: dict = {}
    for row in regional:
        by_bucket.setdefault(row["start"], {})[row.pop("region")] = row
    for bucket in buckets:
        bucket["by_region"] = {
            name: _without_start(row) for name, row in by_bucket.get(bucket["start"], {}).items()
        }
    return {
        "start": time_range.start,
        "end": time_range.end,
        "bucket": time_range.bucket,
        "slo_ms": slo,
        "source": source,
        "buckets": buckets,
        "totals": {
            **_latency_totals(buckets),
            "by_region": {
                name: _latency_totals([b["by_region"][name] for b in buckets if name in b["by_region"]])
                for name in sorted({name for b in buckets for name in b["by_region"]})
            },
        },
    }


def _without_start(row: dict) -> dict:
    return {k: v for k, v in row.items() if k != "start"}


def _latency_totals(buckets: list[dict]) -> dict:
    count = sum(b["count"] for b in buckets)
    passed = sum(b["slo_passed"] for b in buckets)
    return {
        "count": count,
        "slo_passed": passed,
        "slo_pass_rate": (passed / count) if count else None,
        "max_ms": max((b["max_ms"] for b in buckets), default=None),
    }


def _latency_from_raw(time_range: TimeRange, slo: float, *, by_region: bool = False) -> list[dict]:
    keys = ("bucket", "region") if by_region else ("bucket",)
    rows = ChunkRecord.objects.filter(
        created_at__gte=time_range.start, created_at__lt=time_range.end
    ).annotate(bucket=Trunc("created_at", time_range.bucket))
    if by_region:
        rows = rows.annotate(region=region_name("worker__region__name"))
    rows = (
        rows.values(*keys)
        .annotate(
            count=Count("id"),
            p50_ms=PercentileCont("generation_ms", 0.50),
            p95_ms=PercentileCont("generation_ms", 0.95),
            p99_ms=PercentileCont("generation_ms", 0.99),
            max_ms=Max("generation_ms"),
            delivery_p99_ms=PercentileCont("delivery_ms", 0.99),
            slo_passed=Count("id", filter=Q(generation_ms__lte=slo)),
        )
        .order_by(*keys)
    )
    return [{"start": r.pop("bucket"), **r} for r in rows]


def histogram_percentile(histogram: list[int], percentile: float) -> float | None:
    """Percentile from bucket counts over LATENCY_BUCKETS_MS, interpolating linearly inside a bucket.

    Bucket ``i`` holds latencies in [bounds[i-1], bounds[i]) — PostgreSQL's ``width_bucket`` convention.
    """
    total = sum(histogram)
    if total == 0:
        return None
    rank = percentile * total
    cumulative = 0
    for i, n in enumerate(histogram):
        if n and cumulative + n >= rank:
            lower = LATENCY_BUCKETS_MS[i - 1] if i > 0 else 0.0
            upper = LATENCY_BUCKETS_MS[i] if i < len(LATENCY_BUCKETS_MS) else LATENCY_BUCKETS_MS[-1]
            return lower + (upper - lower) * ((rank - cumulative) / n)
        cumulative += n
    return LATENCY_BUCKETS_MS[-1]


def latency_bucket_index(latency_ms: float) -> int:
    """Same as PostgreSQL's ``width_bucket(latency_ms, bounds)``."""
    return bisect.bisect_right(LATENCY_BUCKETS_MS, latency_ms)


def _latency_from_rollups(time_range: TimeRange, slo: float, *, by_region: bool = False) -> list[dict]:
    rows = (
        ChunkLatencyRollup.objects.filter(minute__gte=time_range.start, minute__lt=time_range.end)
        .annotate(bucket=Trunc("minute", time_range.bucket), region=region_name("worker__region__name"))
        .order_by("bucket", "region")
        .values_list("bucket", "region", "count", "max_generation_ms", "histogram")
    )
    merged: dict = {}
    for bucket, region, count, max_ms, histogram in rows:
        key = (bucket, region) if by_region else (bucket, None)
        entry = merged.setdefault(key, {"count": 0, "max_ms": 0.0, "histogram": [0] * len(histogram)})
        entry["count"] += count
        entry["max_ms"] = max(entry["max_ms"], max_ms)
        entry["histogram"] = [a + b for a, b in zip(entry["histogram"], histogram, strict=True)]
    # Conservative at bucket resolution: only buckets whose upper bound is within the SLO pass.
    passing_buckets = bisect.bisect_right(LATENCY_BUCKETS_MS, slo)
    out = []
    for (bucket, region), entry in merged.items():
        hist = entry["histogram"]
        out.append(
            {
                "start": bucket,
                **({"region": region} if by_region else {}),
                "count": entry["count"],
                "p50_ms": histogram_percentile(hist, 0.50),
                "p95_ms": histogram_percentile(hist, 0.95),
                "p99_ms": histogram_percentile(hist, 0.99),
                "max_ms": entry["max_ms"],
                "delivery_p99_ms": None,
                "slo_passed": sum(hist[:passing_buckets]),
            }
        )
    return out


def session_chunk_summary(session: GenerationSession) -> dict:
    agg = session.chunks.aggregate(
        count=Count("id"), total_ms=Sum("generation_ms"), max_ms=Max("generation_ms")
    )
    return agg


def session_end_reason(session: GenerationSession) -> str | None:
    """Why a terminated session ended (its depart event's reason: ``user``, ``queue full (…)``, …)."""
    if session.status != GenerationSession.Status.TERMINATED:
        return None
    return (
        session.events.filter(kind=SessionEvent.Kind.DEPART)
        .order_by("-at", "-id")
        .values_list("detail__reason", flat=True)
        .first()
    )


def sessions_with_idle_reason(sessions: QuerySet[GenerationSession]) -> QuerySet[GenerationSession]:
    """``sessions`` annotated with ``idle_reason``: the reason of each one's latest idle event
    (``no_viewers`` when the viewer rule made it idle; None when its user paused it, or never idle)."""
    latest_idle = SessionEvent.objects.filter(session=OuterRef("pk"), kind=SessionEvent.Kind.IDLE).order_by(
        "-at", "-id"
    )
    return sessions.annotate(idle_reason=Subquery(latest_idle.values("detail__reason")[:1]))


def session_idle_reason(session: GenerationSession) -> str | None:
    """Why an idle session is idle when the platform made it so (its idle event's reason:
    ``no_viewers``, ``sessions.viewers``); None when active, ended or paused by its user."""
    if session.activity != GenerationSession.Activity.IDLE or session.is_terminated:
        return None
    return (
        session.events.filter(kind=SessionEvent.Kind.IDLE)
        .order_by("-at", "-id")
        .values_list("detail__reason", flat=True)
        .first()
    )


def session_status_message(session: GenerationSession) -> dict:
    """The ``status`` message clients receive on connect and on every change.

    ``reason`` says why a terminated session ended, so a client refused by admission control (or
    ended by an operator) is told so rather than seeing only ``terminated``; ``idle_reason`` why an
    idle one is idle when nobody paused it (``no_viewers``: it resumes when a viewer connects).
    """
    return {
        "session": str(session.pk),
        "status": session.status,
        "activity": session.activity,
        "queue_position": session.queue_position,
        "worker": session.worker.name if session.worker_id else None,
        "chunks_generated": session.chunks_generated,
        "reason": session_end_reason(session),
        "idle_reason": session_idle_reason(session),
    }


# --- one-shot jobs ------------------------------------------------------------------------------------


def jobs_visible_to(user) -> QuerySet[Job]:
    """Staff see every job; everyone else only their own (others' are 404, not 403). A deleted job
    is nobody's to see (``job_delete``; the audit still counts it)."""
    qs = Job.objects.select_related("worker", "owner", "tenant").filter(deleted_at__isnull=True)
    return qs if user.is_staff else qs.filter(owner=user)


def job_queue(model_names: list[str]) -> QuerySet[Job]:
    """Queued jobs of these models in dispatch order: priority, then earliest deadline (served by
    the partial index ``job_queue_order``)."""
    return Job.objects.filter(state=Job.State.QUEUED, model_name__in=model_names).order_by(
        "-priority", "deadline", "submitted_at", "id"
    )


def job_queue_positions(model_names: list[str]) -> dict:
    """{job id: 1-based place in its model's queue} for every queued job of these models."""
    positions: dict = {}
    counters: dict[str, int] = {}
    for pk, model_name in job_queue(model_names).values_list("pk", "model_name"):
        counters[model_name] = counters.get(model_name, 0) + 1
        positions[pk] = counters[model_name]
    return positions


def job_result_url(job: Job) -> str | None:
    return reverse("job-result", kwargs={"pk": job.pk}) if job.state == Job.State.DONE else None


def job_status_message(job: Job, *, position: int | None) -> dict:
    """What a job socket receives on every change: queued with its position, running step i/n,
    paused, done with the result's URL, failed with the reason, cancelled."""
    return {
        "job": str(job.pk),
        "kind": job.kind,
        "state": job.state,
        "position": position if job.state == Job.State.QUEUED else None,
        "step": job.steps_done,
        "steps": job.steps,
        "worker": job.worker.name if job.worker_id and job.in_flight else None,
        "result_url": job_result_url(job),
        "error": job.error or None,
    }


def job_audit_buckets(*, time_range: TimeRange, kind: str | None = None) -> dict:
    """Jobs that ended (done or failed) in [start, end) per bucket of their end time: count, done,
    latency p50/p95/p99/max (submission → result, done jobs), wait p50 (submission → first
    assignment), and SLO attainment = done by the deadline / ended. Cancelled jobs are the user's
    choice and count in neither."""
    latency = Extract(F("finished_at") - F("submitted_at"), "epoch")
    wait = Extract(F("started_at") - F("submitted_at"), "epoch")
    jobs = Job.objects.filter(
        finished_at__gte=time_range.start,
        finished_at__lt=time_range.end,
        state__in=[Job.State.DONE, Job.State.FAILED],
    )
    if kind:
        jobs = jobs.filter(kind=kind)
    done = Q(state=Job.State.DONE)
    rows = (
        jobs.annotate(bucket=Trunc("finished_at", time_range.bucket))
        .values("bucket")
        .annotate(
            count=Count("id"),
            done=Count("id", filter=done),
            latency_p50_s=PercentileCont(latency, 0.50, filter=done),
            latency_p95_s=PercentileCont(latency, 0.95, filter=done),
            latency_p99_s=PercentileCont(latency, 0.99, filter=done),
            latency_max_s=Max(latency, filter=done),
            wait_p50_s=PercentileCont(wait, 0.50, filter=done),
            slo_met=Count("id", filter=done & Q(finished_at__lte=F("deadline"))),
        )
        .order_by("bucket")
    )
    buckets = []
    for row in rows:
        row = {k: float(v) if k.endswith("_s") and v is not None else v for k, v in row.items()}
        buckets.append({"start": row.pop("bucket"), **row, "slo_attainment": row["slo_met"] / row["count"]})
    count = sum(b["count"] for b in buckets)
    met = sum(b["slo_met"] for b in buckets)
    return {
        "start": time_range.start,
        "end": time_range.end,
        "bucket": time_range.bucket,
        "kind": kind,
        "buckets": buckets,
        "totals": {"count": count, "slo_met": met, "slo_attainment": (met / count) if count else None},
    }
