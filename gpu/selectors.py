"""Reads of the GPU pool: the cost audit."""

from __future__ import annotations

from collections import defaultdict
from decimal import Decimal

from django.db.models import Sum
from django.db.models.functions import Trunc

from controlplane.timerange import TimeRange
from gpu.models import CostLedgerEntry


def cost_buckets(*, time_range: TimeRange) -> dict:
    """GPU-seconds and money per bucket and per GPU type over [start, end), from the ledger.

    A ledger row belongs to the bucket its interval starts in; rows are at most a minute long,
    so minute, hour and day buckets are exact.
    """
    rows = (
        CostLedgerEntry.objects.filter(
            interval_start__gte=time_range.start, interval_start__lt=time_range.end
        )
        .annotate(bucket=Trunc("interval_start", time_range.bucket))
        .values("bucket", "gpu_type")
        .annotate(gpu_seconds=Sum("gpu_seconds"), cost_usd=Sum("cost_usd"))
        .order_by("bucket", "gpu_type")
    )
    buckets: dict = {}
    totals_by_type: dict[str, dict] = defaultdict(lambda: {"gpu_seconds": 0.0, "cost_usd": Decimal(0)})
    for row in rows:
        entry = buckets.setdefault(
            row["bucket"],
            {"start": row["bucket"], "gpu_seconds": 0.0, "cost_usd": Decimal(0), "by_gpu_type": {}},
        )
        entry["gpu_seconds"] += row["gpu_seconds"]
        entry["cost_usd"] += row["cost_usd"]
        entry["by_gpu_type"][row["gpu_type"]] = {
            "gpu_seconds": row["gpu_seconds"],
            "cost_usd": row["cost_usd"],
        }
        totals_by_type[row["gpu_type"]]["gpu_seconds"] += row["gpu_seconds"]
        totals_by_type[row["gpu_type"]]["cost_usd"] += row["cost_usd"]
    return {
        "start": time_range.start,
        "end": time_range.end,
        "bucket": time_range.bucket,
        "buckets": list(buckets.values()),
        "totals": {
            "gpu_seconds": sum(t["gpu_seconds"] for t in totals_by_type.values()),
            "cost_usd": sum((t["cost_usd"] for t in totals_by_type.values()), Decimal(0)),
            "by_gpu_type": dict(totals_by_type),
        },
    }
