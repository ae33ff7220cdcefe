"""Reads of the scheduler's records: the audit of cross-region moves."""

from __future__ import annotations

from collections import defaultdict

from django.db.models import Count, Q, Sum
from django.db.models.functions import Trunc

from controlplane.timerange import TimeRange
from gpu.selectors import region_name
from scheduling.models import Migration

_FIELDS = ("moves_out", "moves_in", "succeeded_out", "estimated_saving_ms", "switch_cost_ms")


def _figures() -> dict:
    return {
        "moves_out": 0,
        "moves_in": 0,
        "succeeded_out": 0,
        "estimated_saving_ms": 0.0,
        "switch_cost_ms": 0.0,
    }


def region_move_rows(*, time_range: TimeRange) -> list[dict]:
    """Cross-region moves started in [start, end) per bucket and region, in that order: moves out
    of the region (with how many succeeded, and the rule's estimated saving and switching cost,
    summed) and moves into it. A move's regions are the ones recorded at its start."""
    moves = Migration.objects.filter(
        cross_region=True, started_at__gte=time_range.start, started_at__lt=time_range.end
    ).annotate(bucket=Trunc("started_at", time_range.bucket))
    rows: dict[tuple, dict] = defaultdict(_figures)
    out = (
        moves.annotate(region=region_name("source_region__name"))
        .values("bucket", "region")
        .annotate(
            n=Count("id"),
            ok=Count("id", filter=Q(outcome=Migration.Outcome.SUCCEEDED)),
            saving=Sum("estimated_saving_ms"),
            cost=Sum("switch_cost_ms"),
        )
    )
    for row in out:
        figures = rows[(row["bucket"], row["region"])]
        figures.update(
            moves_out=row["n"],
            succeeded_out=row["ok"],
            estimated_saving_ms=row["saving"] or 0.0,
            switch_cost_ms=row["cost"] or 0.0,
        )
    into = (
        moves.annotate(region=region_name("target_region__name"))
        .values("bucket", "region")
        .annotate(n=Count("id"))
    )
    for row in into:
        rows[(row["bucket"], row["region"])]["moves_in"] = row["n"]
    return [{"bucket": b, "region": r, **rows[(b, r)]} for b, r in sorted(rows)]


def region_moves_audit(*, time_range: TimeRange) -> dict:
    """``region_move_rows`` as buckets with ``by_region``, and totals (``cross_region_moves``: each
    move once) by region."""
    buckets: dict = {}
    totals: dict = {"cross_region_moves": 0, "by_region": defaultdict(_figures)}
    for row in region_move_rows(time_range=time_range):
        entry = buckets.setdefault(
            row["bucket"], {"start": row["bucket"], "cross_region_moves": 0, "by_region": {}}
        )
        figures = {k: row[k] for k in _FIELDS}
        entry["by_region"][row["region"]] = figures
        entry["cross_region_moves"] += row["moves_out"]
        totals["cross_region_moves"] += row["moves_out"]
        for k in _FIELDS:
            totals["by_region"][row["region"]][k] += figures[k]
    return {
        "start": time_range.start,
        "end": time_range.end,
        "bucket": time_range.bucket,
        "buckets": list(buckets.values()),
        "totals": {**totals, "by_region": dict(totals["by_region"])},
    }


REGION_MOVE_CSV_FIELDS = _FIELDS
