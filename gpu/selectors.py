"""Reads of the GPU pool: the cost audit and the parameter pool."""

from __future__ import annotations

from collections import defaultdict
from decimal import Decimal

from django.db.models import Case, Count, IntegerField, Q, QuerySet, Subquery, Sum, Value, When
from django.db.models.functions import Coalesce, Trunc

from contracts.http.timerange import TimeRange
from gpu.models import CostLedgerEntry, GpuWorker, HostCache, Region, WeightHolding


def region_name(field: str = "region__name") -> Coalesce:
    """A row's region name, the local region's where ``region`` is null (see ``Region``)."""
    return Coalesce(field, Value(Region.DEFAULT_NAME))


def cost_rows(*, time_range: TimeRange) -> list[dict]:
    """Ledger sums per bucket, GPU type and region over [start, end), in that order.

    A ledger row belongs to the bucket its interval starts in; rows are at most a minute long,
    so minute, hour and day buckets are exact. Its region is its worker's (workers never move).
    """
    return list(
        CostLedgerEntry.objects.filter(
            interval_start__gte=time_range.start, interval_start__lt=time_range.end
        )
        .annotate(
            bucket=Trunc("interval_start", time_range.bucket), region=region_name("worker__region__name")
        )
        .values("bucket", "gpu_type", "region")
        .annotate(gpu_seconds=Sum("gpu_seconds"), cost_usd=Sum("cost_usd"))
        .order_by("bucket", "gpu_type", "region")
    )


def _add(figures: dict, row: dict) -> None:
    figures["gpu_seconds"] += row["gpu_seconds"]
    figures["cost_usd"] += row["cost_usd"]


def _figures() -> dict:
    return {"gpu_seconds": 0.0, "cost_usd": Decimal(0)}


def cost_buckets(*, time_range: TimeRange) -> dict:
    """GPU-seconds and money per bucket, by GPU type and by region, from the ledger (``cost_rows``)."""
    buckets: dict = {}
    totals: dict = {**_figures(), "by_gpu_type": defaultdict(_figures), "by_region": defaultdict(_figures)}
    for row in cost_rows(time_range=time_range):
        entry = buckets.setdefault(
            row["bucket"],
            {
                "start": row["bucket"],
                **_figures(),
                "by_gpu_type": defaultdict(_figures),
                "by_region": defaultdict(_figures),
            },
        )
        for figures in (entry, entry["by_gpu_type"][row["gpu_type"]], entry["by_region"][row["region"]]):
            _add(figures, row)
        for figures in (totals, totals["by_gpu_type"][row["gpu_type"]], totals["by_region"][row["region"]]):
            _add(figures, row)
    return {
        "start": time_range.start,
        "end": time_range.end,
        "bucket": time_range.bucket,
        "buckets": [_plain(entry) for entry in buckets.values()],
        "totals": _plain(totals),
    }


def _plain(entry: dict) -> dict:
    return {**entry, "by_gpu_type": dict(entry["by_gpu_type"]), "by_region": dict(entry["by_region"])}


def weight_sources(*, model_preset: str) -> list[dict]:
    """Complete copies of a model's weights held by live holders: the scale planner's sources.

    GPU copies first (the fast path: NVLink/RDMA between GPUs), then host caches; each names its
    holder, host and the address peers fetch blocks from.
    """
    rows = (
        WeightHolding.objects.filter(model_preset=model_preset, state=WeightHolding.State.COMPLETE)
        .filter(
            Q(
                kind=WeightHolding.Kind.GPU,
                worker__status__in=[GpuWorker.Status.READY, GpuWorker.Status.DRAINING],
            )
            | Q(kind=WeightHolding.Kind.HOST, cache__status=HostCache.Status.LIVE)
        )
        .select_related("worker", "cache")
        .order_by("kind", "completed_at", "pk")
    )
    return [
        {
            "holding": h.pk,
            "kind": h.kind,
            "name": h.worker.name if h.kind == WeightHolding.Kind.GPU else h.cache.name,
            "host": h.host,
            "address": h.address,
            "weights_bytes": h.weights_bytes,
            "digest": h.digest,
        }
        for h in rows
    ]


def parameter_pool() -> list[dict]:
    """The pool per model for the operator console: every copy with its holder and state."""
    models: dict[str, dict] = {}
    for h in WeightHolding.objects.select_related("worker", "cache").order_by("model_preset", "kind", "pk"):
        entry = models.setdefault(
            h.model_preset,
            {"model": h.model_preset, "gpu_copies": 0, "host_copies": 0, "loading": 0, "copies": []},
        )
        if h.state == WeightHolding.State.LOADING:
            entry["loading"] += 1
        elif h.kind == WeightHolding.Kind.GPU:
            entry["gpu_copies"] += 1
        else:
            entry["host_copies"] += 1
        entry["copies"].append(
            {
                "kind": h.kind,
                "state": h.state,
                "holder": h.worker.name if h.worker_id else h.cache.name,
                "host": h.host,
                "address": h.address,
                "weights_bytes": h.weights_bytes,
                "digest": h.digest,
                "last_used_at": h.last_used_at,
            }
        )
    return list(models.values())


def known_origins() -> set[str]:
    """The user origins some region has an RTT for (the union of the regions' ``rtt_ms`` keys)."""
    return {origin for row in Region.objects.values_list("rtt_ms", flat=True) for origin in row}


def regions_with_live_workers() -> QuerySet[Region]:
    """Regions annotated with ``live_workers``; the local region's row also counts the workers that
    have no region (null means the local region, see ``Region``)."""
    live = Q(workers__status__in=GpuWorker.LIVE_STATUSES)
    unplaced = (
        GpuWorker.objects.filter(region__isnull=True, status__in=GpuWorker.LIVE_STATUSES)
        .values("region")
        .annotate(n=Count("pk"))
        .values("n")
    )
    local_extra = Case(
        When(name=Region.DEFAULT_NAME, then=Coalesce(Subquery(unplaced[:1]), 0)),
        default=Value(0),
        output_field=IntegerField(),
    )
    return Region.objects.annotate(live_workers=Count("workers", filter=live) + local_extra)
