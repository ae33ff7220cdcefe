"""Reads of the scheduling history for the audit: stage placements and their role changes."""

from __future__ import annotations

from collections import Counter
from typing import Any

from controlplane.timerange import TimeRange
from scheduling.models import StagePlacement


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
