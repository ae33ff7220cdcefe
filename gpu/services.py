"""Writes to the GPU pool: worker lifecycle transitions and the cost ledger."""

from __future__ import annotations

import logging
from datetime import datetime, timedelta
from decimal import Decimal

from django.conf import settings
from django.db import IntegrityError, transaction
from django.db.models import Max, Sum
from django.utils import timezone

from gpu.models import STAGE_ROLES, CostLedgerEntry, GpuWorker, HostCache, WeightHolding, WeightsSource

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


@transaction.atomic
def worker_release(*, worker: GpuWorker, at: datetime | None = None) -> GpuWorker:
    at = at or timezone.now()
    worker = _transition(
        worker,
        allowed_from=(Status.PROVISIONING, Status.READY, Status.DRAINING),
        to=Status.RELEASED,
        released_at=at,
    )
    holdings_of_worker_drop(worker_id=worker.pk)
    return worker


@transaction.atomic
def worker_fail(*, worker: GpuWorker, at: datetime | None = None) -> GpuWorker:
    """A worker that died or never came up; billing stops now (the provider stops charging).

    Its weights leave the parameter pool in the same transaction: no plan names a dead source.
    """
    at = at or timezone.now()
    worker = _transition(
        worker,
        allowed_from=(Status.PROVISIONING, Status.READY, Status.DRAINING),
        to=Status.FAILED,
        released_at=at,
    )
    holdings_of_worker_drop(worker_id=worker.pk)
    return worker


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
    mark_ready: bool = True,
    stage_role: str | None = None,
) -> GpuWorker:
    """A worker process announces itself: adopt the provisioner's row or create one.

    A worker started by hand (no provisioner row) is registered as provider ``static``. With
    ``mark_ready=False`` this is the scale-out's *process up* phase (its weights still load; the
    row stays provisioning and records ``process_up_at``); by default the model is loaded and the
    worker becomes ready. ``stage_role``: the stages it hosts (``--stages``; ``None`` keeps the row's).
    """
    if stage_role is not None and stage_role not in STAGE_ROLES:
        raise ValueError(f"stage_role: {stage_role!r} is not one of {', '.join(STAGE_ROLES)}")
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
        if stage_role is not None:
            worker.stage_role = stage_role
        worker.last_heartbeat = now
        if worker.process_up_at is None:
            worker.process_up_at = now
        worker.save()
    if mark_ready and worker.status == Status.PROVISIONING:
        worker = worker_mark_ready(worker=worker, at=now)
    return worker


def worker_undrain(*, worker: GpuWorker) -> GpuWorker:
    return _transition(worker, allowed_from=(Status.DRAINING,), to=Status.READY)


def worker_heartbeat(*, worker_id: int, telemetry: dict) -> None:
    """Store the latest telemetry sample (NVML on GPUs; host figures where NVML is absent).

    A stage worker's report also names its role (``"stage_role": "DC"``) and, for an E worker, its
    encoder load (``"encoder": {"queue", "served", "encode_ms_p50"}``, kept in ``telemetry``: the
    encoder choice reads it). The reported role is the truth: it overrides what a ``set_role`` the
    control plane still waits on would set. An unknown role is logged and ignored, never stored.
    """
    devices = telemetry.get("devices") or []
    device = devices[0] if devices else {}
    host = telemetry.get("host") or {}
    now = timezone.now()
    role = telemetry.get("stage_role")
    fields = {}
    if role in STAGE_ROLES:
        fields["stage_role"] = role
    elif role is not None:
        logger.warning("worker.heartbeat worker_id=%s unknown stage_role=%r ignored", worker_id, role)
    GpuWorker.objects.filter(pk=worker_id, status__in=GpuWorker.LIVE_STATUSES).update(
        **fields,
        last_heartbeat=now,
        telemetry_at=now,
        telemetry=telemetry,
        utilization_pct=device.get("utilization_pct", host.get("cpu_percent")),
        memory_used_bytes=device.get("memory_used_bytes", host.get("memory_used_bytes")),
        power_watts=device.get("power_w"),
        temperature_c=device.get("temperature_c"),
    )


# --- scale-out phases (docs/scaleout.md) -----------------------------------------------------------

PHASES = ("process_up", "weights_complete", "ready")


def worker_weights_complete(
    *, worker_id: int, source: str, detail: str = "", at: datetime | None = None
) -> None:
    """Phase 3: every block is in place and verified; ``source`` says where it came from."""
    if source not in WeightsSource.values:
        raise ValueError(f"source must be one of {', '.join(WeightsSource.values)}, got {source!r}")
    GpuWorker.objects.filter(pk=worker_id).update(
        weights_complete_at=at or timezone.now(), weights_source=source, weights_source_detail=detail[:255]
    )


def worker_weights_plan_set(*, worker_id: int, plan: dict, expected_ready_at: datetime | None) -> int:
    """The scale plan's part for one provisioning worker; returns 1 when the row was still waiting."""
    return GpuWorker.objects.filter(pk=worker_id, status=Status.PROVISIONING).update(
        weights_plan=plan, expected_ready_at=expected_ready_at
    )


# --- the parameter pool (BlitzScale §5.3; docs/scaleout.md) ---------------------------------------


class PoolError(Exception):
    """The parameter pool refused a registration; the message says why."""


class HostCopiesExhausted(PoolError):
    """The model already has ``POOL_HOST_COPIES`` host copies in the cluster."""


class HostCacheFull(PoolError):
    """The host cache cannot make room for the model, even after evicting what it may evict."""


def host_copies_bound() -> int:
    return int(settings.STREAMSERVE["POOL_HOST_COPIES"])


def host_cache_register(
    *, name: str, host: str, address: str, capacity_bytes: int, pinned: bool
) -> HostCache:
    """A host-cache process announces itself (or comes back under its name with nothing held)."""
    if capacity_bytes <= 0:
        raise ValueError("capacity_bytes must be positive")
    now = timezone.now()
    with transaction.atomic():
        cache, created = HostCache.objects.select_for_update().get_or_create(
            name=name,
            defaults={
                "host": host,
                "address": address,
                "capacity_bytes": capacity_bytes,
                "pinned": pinned,
                "started_at": now,
                "last_heartbeat": now,
            },
        )
        if not created:
            # A restarted process holds nothing yet: what the old one held is gone with it.
            cache.holdings.all().delete()
            cache.host, cache.address, cache.capacity_bytes, cache.pinned = (
                host,
                address,
                capacity_bytes,
                pinned,
            )
            cache.status, cache.started_at, cache.last_heartbeat, cache.stopped_at = (
                HostCache.Status.LIVE,
                now,
                now,
                None,
            )
            cache.save()
    return cache


def host_cache_heartbeat(*, cache_id: int) -> list[str] | None:
    """The cache is alive; returns the models the pool still lists for it (it frees the others),
    or None when it was declared lost meanwhile (it must register again)."""
    now = timezone.now()
    if not HostCache.objects.filter(pk=cache_id, status=HostCache.Status.LIVE).update(last_heartbeat=now):
        return None
    return list(WeightHolding.objects.filter(cache_id=cache_id).values_list("model_preset", flat=True))


@transaction.atomic
def host_cache_stop(*, cache_id: int, status: str = HostCache.Status.STOPPED) -> bool:
    """The cache exited (or was lost): it leaves the pool with all its copies. Compare-and-set."""
    stopped = HostCache.objects.filter(pk=cache_id, status=HostCache.Status.LIVE).update(
        status=status, stopped_at=timezone.now()
    )
    WeightHolding.objects.filter(cache_id=cache_id).delete()
    return stopped == 1


def host_caches_check(*, now: datetime | None = None) -> list[str]:
    """Declare host caches whose heartbeat stopped lost; their copies leave the pool. Names them."""
    now = now or timezone.now()
    timeout = timedelta(seconds=settings.STREAMSERVE["HEARTBEAT_TIMEOUT_S"])
    lost = []
    for cache in HostCache.objects.filter(status=HostCache.Status.LIVE, last_heartbeat__lt=now - timeout):
        if host_cache_stop(cache_id=cache.pk, status=HostCache.Status.LOST):
            lost.append(cache.name)
            logger.error("hostcache.lost cache=%s last_heartbeat=%s", cache.name, cache.last_heartbeat)
    return lost


def _evictable(cache: HostCache, model_preset: str) -> list[WeightHolding]:
    """Copies this cache may drop to make room, in eviction order: first those whose model has
    another complete copy in the pool (nothing is lost), then the least recently used."""
    others = cache.holdings.exclude(model_preset=model_preset)
    elsewhere = set(
        WeightHolding.objects.filter(state=WeightHolding.State.COMPLETE)
        .exclude(cache=cache)
        .values_list("model_preset", flat=True)
    )
    return sorted(others, key=lambda h: (h.model_preset not in elsewhere, h.last_used_at, h.pk))


def host_copy_register(
    *, cache: HostCache, model_preset: str, weights_bytes: int, address: str = ""
) -> WeightHolding:
    """Reserve a host copy of ``model_preset`` in ``cache`` (state loading).

    Raises ``HostCopiesExhausted`` when the cluster already holds the configured number of host
    copies and ``HostCacheFull`` when the cache cannot make room; evicts (LRU, copies held
    elsewhere first) when it can. Race-safe: the cache row is locked for the capacity account,
    and the cluster-wide bound is the (model, slot) unique constraint, not a count read earlier.
    """
    if weights_bytes < 0:
        raise ValueError("weights_bytes must be >= 0")
    now = timezone.now()
    with transaction.atomic():
        cache = HostCache.objects.select_for_update().get(pk=cache.pk)
        if cache.status != HostCache.Status.LIVE:
            raise PoolError(f"host cache {cache.name} is {cache.status}")
        existing = cache.holdings.filter(model_preset=model_preset).first()
        if existing is not None:
            return existing
        if weights_bytes > cache.capacity_bytes:
            raise HostCacheFull(
                f"{model_preset} needs {weights_bytes} bytes; cache {cache.name} holds {cache.capacity_bytes}"
            )
        bound = host_copies_bound()
        taken = set(
            WeightHolding.objects.filter(model_preset=model_preset, kind=WeightHolding.Kind.HOST).values_list(
                "host_slot", flat=True
            )
        )
        if len([s for s in taken if s < bound]) >= bound:
            raise HostCopiesExhausted(
                f"{model_preset} already has {bound} host cop{'y' if bound == 1 else 'ies'}"
            )
        used = cache.holdings.aggregate(total=Sum("weights_bytes"))["total"] or 0
        evicted = []
        for victim in _evictable(cache, model_preset):
            if used + weights_bytes <= cache.capacity_bytes:
                break
            used -= victim.weights_bytes
            evicted.append(victim.model_preset)
            victim.delete()
        if used + weights_bytes > cache.capacity_bytes:
            raise HostCacheFull(f"cache {cache.name} cannot make room for {model_preset}")
        for slot in range(bound):
            if slot in taken:
                continue
            try:
                with transaction.atomic():  # a savepoint: a lost race on this slot tries the next
                    holding = WeightHolding.objects.create(
                        model_preset=model_preset,
                        kind=WeightHolding.Kind.HOST,
                        cache=cache,
                        host=cache.host,
                        address=address or cache.address,
                        weights_bytes=weights_bytes,
                        host_slot=slot,
                        created_at=now,
                        last_used_at=now,
                    )
            except IntegrityError:
                continue
            if evicted:
                logger.info(
                    "hostcache.evicted cache=%s models=%s for=%s", cache.name, ",".join(evicted), model_preset
                )
            return holding
        # Every free slot was taken by a concurrent registration: roll the evictions back too.
        raise HostCopiesExhausted(
            f"{model_preset} already has {bound} host cop{'y' if bound == 1 else 'ies'}"
        )


def host_copy_evict(*, cache: HostCache, model_preset: str) -> bool:
    """Drop a host copy from the pool (the cache frees its memory at its next heartbeat)."""
    deleted, _ = WeightHolding.objects.filter(cache=cache, model_preset=model_preset).delete()
    return deleted > 0


def worker_holding_register(
    *, worker: GpuWorker, model_preset: str, weights_bytes: int, address: str = ""
) -> WeightHolding:
    """A worker starts loading a model into GPU memory: a loading copy (not offered as a source)."""
    now = timezone.now()
    holding, _ = WeightHolding.objects.update_or_create(
        model_preset=model_preset,
        kind=WeightHolding.Kind.GPU,
        worker=worker,
        defaults={
            "host": worker.host,
            "address": address,
            "weights_bytes": weights_bytes,
            "state": WeightHolding.State.LOADING,
            "completed_at": None,
            "created_at": now,
            "last_used_at": now,
        },
    )
    return holding


def holding_complete(*, holding_id: int, digest: str, address: str | None = None) -> bool:
    """Loading → complete once every block was verified; returns whether it applied (the row may
    have been dropped meanwhile: its holder died or the cache evicted it)."""
    fields: dict = {"state": WeightHolding.State.COMPLETE, "completed_at": timezone.now(), "digest": digest}
    if address is not None:
        fields["address"] = address
    return (
        WeightHolding.objects.filter(pk=holding_id, state=WeightHolding.State.LOADING).update(**fields) == 1
    )


def holding_touch(*, holding_id: int) -> None:
    """The copy served a peer: it is the most recently used (host caches evict LRU first)."""
    WeightHolding.objects.filter(pk=holding_id).update(last_used_at=timezone.now())


def holdings_of_worker_drop(*, worker_id: int) -> int:
    deleted, _ = WeightHolding.objects.filter(worker_id=worker_id).delete()
    return deleted
