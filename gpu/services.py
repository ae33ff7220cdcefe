"""Writes to the GPU pool: worker lifecycle transitions and the cost ledger."""

from __future__ import annotations

import logging
from datetime import datetime, timedelta
from decimal import Decimal

from django.db import transaction
from django.db.models import Max
from django.utils import timezone

from gpu.models import CostLedgerEntry, GpuWorker

logger = logging.getLogger(__name__)
Status = GpuWorker.Status

LEDGER_INTERVAL = timedelta(minutes=1)


class TransitionError(Exception):
    """A lifecycle transition that the worker's current status does not allow."""


def _transition(worker: GpuWorker, *, allowed_from: tuple[str, ...], to: str, **fields) -> GpuWorker:
    """Compare-and-set status change; raises TransitionError when another writer got there first."""
    updated = GpuWorker.objects.filter(pk=worker.pk, status__in=allowed_from).update(status=to, **fields)
    if updated != 1:
        current = GpuWorker.objects.filter(pk=worker.pk).values_list("status", flat=True).first()
        raise TransitionError(f"worker {worker.name} cannot go {current} → {to}")
    worker.refresh_from_db()
    return worker


def worker_mark_ready(*, worker: GpuWorker, at: datetime | None = None) -> GpuWorker:
    at = at or timezone.now()
    return _transition(
        worker, allowed_from=(Status.PROVISIONING,), to=Status.READY, ready_at=at, last_heartbeat=at
    )


def worker_drain(*, worker: GpuWorker) -> GpuWorker:
    """No new sessions go to a draining worker; the scheduler moves its residents away. Idempotent."""
    if worker.status == Status.DRAINING:
        return worker
    return _transition(worker, allowed_from=(Status.READY,), to=Status.DRAINING)


def worker_release(*, worker: GpuWorker, at: datetime | None = None) -> GpuWorker:
    at = at or timezone.now()
    return _transition(
        worker,
        allowed_from=(Status.PROVISIONING, Status.READY, Status.DRAINING),
        to=Status.RELEASED,
        released_at=at,
    )


def worker_fail(*, worker: GpuWorker, at: datetime | None = None) -> GpuWorker:
    """A worker that died or never came up; billing stops now (the provider stops charging)."""
    at = at or timezone.now()
    return _transition(
        worker,
        allowed_from=(Status.PROVISIONING, Status.READY, Status.DRAINING),
        to=Status.FAILED,
        released_at=at,
    )


def _floor_minute(moment: datetime) -> datetime:
    return moment.replace(second=0, microsecond=0)


def ledger_accrue(*, until: datetime | None = None) -> int:
    """Write the ledger's closed one-minute intervals for every worker up to ``until`` (default: now).

    A worker is billed from ``requested_at`` to ``released_at`` (or now). Only minutes that are over
    (or that contain the release) are written, so every row is final; rows are idempotent through the
    (worker, interval_start) unique constraint. Returns the number of rows written.
    """
    until = until or timezone.now()
    horizon = _floor_minute(until)
    written = 0
    last_end = dict(
        CostLedgerEntry.objects.values("worker_id")
        .annotate(last=Max("interval_end"))
        .values_list("worker_id", "last")
    )
    workers = GpuWorker.objects.filter(requested_at__lt=horizon).only(
        "pk", "gpu_type", "price_per_hour", "requested_at", "released_at"
    )
    for worker in workers.iterator():
        billed_from = max(worker.requested_at, last_end.get(worker.pk) or worker.requested_at)
        billed_to = min(worker.released_at or horizon, horizon)
        if billed_to <= billed_from:
            continue
        rows = []
        minute = _floor_minute(billed_from)
        per_second = Decimal(worker.price_per_hour) / Decimal(3600)
        while minute < billed_to:
            start = max(minute, billed_from)
            end = min(minute + LEDGER_INTERVAL, billed_to)
            seconds = (end - start).total_seconds()
            if seconds > 0:
                rows.append(
                    CostLedgerEntry(
                        worker_id=worker.pk,
                        gpu_type=worker.gpu_type,
                        interval_start=start,
                        interval_end=end,
                        gpu_seconds=seconds,
                        cost_usd=(per_second * Decimal(str(seconds))).quantize(Decimal("0.000001")),
                    )
                )
            minute += LEDGER_INTERVAL
        with transaction.atomic():
            CostLedgerEntry.objects.bulk_create(rows, ignore_conflicts=True, batch_size=1000)
        written += len(rows)
    return written


def worker_register(
    *,
    name: str,
    host: str,
    device: str,
    preset: str,
    gpu_type: str,
    capacity: int,
    memory_bytes: int,
    migration_address: str,
) -> GpuWorker:
    """A worker process announces itself (model loaded): adopt the provisioner's row or create one.

    A worker started by hand (no provisioner row) is registered as provider ``static``.
    """
    now = timezone.now()
    with transaction.atomic():
        worker = GpuWorker.objects.select_for_update().filter(name=name).first()
        if worker is None:
            worker = GpuWorker.objects.create(
                name=name,
                host=host,
                device=device,
                gpu_type=gpu_type,
                capacity=capacity,
                model_preset=preset,
                provider="static",
                status=Status.PROVISIONING,
                requested_at=now,
            )
        if worker.status not in (Status.PROVISIONING, Status.READY):
            raise TransitionError(f"worker {name} is {worker.status}; start it under a new name")
        worker.host = host
        worker.device = device
        worker.device_index = int(device.split(":")[1]) if device.startswith("cuda:") else None
        worker.model_preset = preset
        worker.gpu_type = gpu_type
        worker.capacity = capacity
        worker.memory_bytes = memory_bytes
        worker.migration_address = migration_address
        worker.last_heartbeat = now
        worker.save()
    if worker.status == Status.PROVISIONING:
        worker = worker_mark_ready(worker=worker, at=now)
    return worker


def worker_undrain(*, worker: GpuWorker) -> GpuWorker:
    return _transition(worker, allowed_from=(Status.DRAINING,), to=Status.READY)


def worker_heartbeat(*, worker_id: int, telemetry: dict) -> None:
    """Store the latest telemetry sample (NVML on GPUs; host figures where NVML is absent)."""
    devices = telemetry.get("devices") or []
    device = devices[0] if devices else {}
    host = telemetry.get("host") or {}
    now = timezone.now()
    GpuWorker.objects.filter(pk=worker_id, status__in=GpuWorker.LIVE_STATUSES).update(
        last_heartbeat=now,
        telemetry_at=now,
        telemetry=telemetry,
        utilization_pct=device.get("utilization_pct", host.get("cpu_percent")),
        memory_used_bytes=device.get("memory_used_bytes", host.get("memory_used_bytes")),
        power_watts=device.get("power_w"),
        temperature_c=device.get("temperature_c"),
    )
