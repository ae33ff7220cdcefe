"""Celery entry points of the GPU pool: the cost ledger's periodic accrual (beat)."""

from __future__ import annotations

from celery import shared_task
from django.db import close_old_connections

from gpu import services


@shared_task(name="gpu.tasks.ledger_accrue", time_limit=300, soft_time_limit=280, ignore_result=True)
def ledger_accrue() -> int:
    """Beat: write the cost ledger's closed minutes; returns the ledger rows written."""
    close_old_connections()
    return services.ledger_accrue()
