"""Celery entry points of the sessions app: the audit plane's ingester, rollups and retention, and
the viewer rule (beat)."""

from __future__ import annotations

from celery import shared_task
from django.db import close_old_connections

from sessions import ingest, services, viewers


@shared_task(name="sessions.tasks.chunk_records_drain", time_limit=60, soft_time_limit=50, ignore_result=True)
def chunk_records_drain() -> int:
    """Beat: ingest the chunk-record stream's backlog into PostgreSQL; returns the new records."""
    close_old_connections()
    return ingest.chunk_records_drain(client=ingest.records_client())


@shared_task(name="sessions.tasks.chunk_rollup", time_limit=300, soft_time_limit=280, ignore_result=True)
def chunk_rollup() -> int:
    """Beat: per-minute, per-worker latency rollups of closed minutes; returns the rollup rows written."""
    close_old_connections()
    return services.chunk_rollup()


@shared_task(
    name="sessions.tasks.chunk_records_prune", time_limit=300, soft_time_limit=280, ignore_result=True
)
def chunk_records_prune() -> int:
    """Beat: delete raw chunk records past retention whose minute is rolled up; returns the rows deleted."""
    close_old_connections()
    return services.chunk_records_prune()


@shared_task(
    name="sessions.tasks.sessions_viewer_check", time_limit=30, soft_time_limit=25, ignore_result=True
)
def sessions_viewer_check() -> dict[str, int]:
    """Beat (every 2 s): sessions nobody watches go idle after the grace and end after the idle
    timeout (``sessions.viewers``); returns how many did."""
    close_old_connections()
    return viewers.sessions_viewer_check()
