"""Reads of the scheduler's records for the audit: cross-region moves, stage placements and their
role changes."""

from __future__ import annotations

from collections import Counter, defaultdict
from typing import Any

from django.db.models import Count, Q, Sum
from django.db.models.functions import Trunc

from contracts.http.timerange import TimeRange
from gpu.selectors import region_name
from scheduling.models import Migration, StagePlacement

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


def stage_placement_audit(
    *, time_range: TimeRange, preset: str | None = None, status: str | None = None
) -> dict[str, Any]:
    """Stage placements made in ``[start, end)`` (oldest first) with each worker's role change, the
    trigger's figures, and totals by outcome."""
    placements = (
        StagePlacement.objects.filter(created_at__gte=time_range.start, created_at__lt=time_range.end)
        .prefetch_related("changes__worker")
        .order_by("created_at", "id")
    )
    if preset is not None:
        placements = placements.filter(preset=preset)
    if status is not None:
        placements = placements.filter(status=status)
    rows = []
    by_status: Counter[str] = Counter()
    changes_by_status: Counter[str] = Counter()
    for p in placements:
        by_status[p.status] += 1
        changes = []
        for c in sorted(p.changes.all(), key=lambda c: c.order):
            changes_by_status[c.status] += 1
            changes.append(
                {
                    "worker": c.worker.name,
                    "from_role": c.from_role,
                    "to_role": c.to_role,
                    "order": c.order,
                    "status": c.status,
                    "reason": c.reason,
                    "load_ms": c.load_ms,
                    "created_at": c.created_at,
                    "sent_at": c.sent_at,
                    "answered_at": c.answered_at,
                }
            )
        rows.append(
            {
                "id": p.pk,
                "created_at": p.created_at,
                "finished_at": p.finished_at,
                "preset": p.preset,
                "reason": p.reason,
                "status": p.status,
                "roles_before": p.roles_before,
                "roles_after": p.roles_after,
                "trigger": p.trigger,
                "changes": changes,
            }
        )
    return {
        "start": time_range.start,
        "end": time_range.end,
        "placements": rows,
        "totals": {
            "placements": len(rows),
            "by_status": dict(sorted(by_status.items())),
            "changes_by_status": dict(sorted(changes_by_status.items())),
        },
    }
