"""The provisioner contract: how the scheduler grows and shrinks the GPU pool.

A provisioner turns a scaling decision into running worker processes (or pods, or hand-started
machines) and keeps the ``GpuWorker`` rows honest about them. Every backend has the same three
entry points, all synchronous, all returning a JSON-serialisable result for the audit trail
(``ScalingAction.provisioner_result``):

``request(count=n, gpu_type=..., preset=...) -> RequestResult``
    Scale-out. Creates up to ``n`` ``GpuWorker`` rows with ``status=provisioning``,
    ``requested_at=now`` (billing starts: boot and model load are paid for), ``provider``,
    ``external_id``, a unique ``name``, ``capacity``, ``price_per_hour``, ``gpu_type``,
    ``model_preset`` and ``device``, and starts each worker. The worker adopts its row by name,
    loads its model and marks itself ready (``gpu.services.worker_mark_ready``); the provisioner
    does not wait for that. A backend that cannot supply all ``n`` grants fewer and says why in
    ``RequestResult.shortfall``; a start that fails leaves a ``failed`` row (zero billed time) and an
    entry in ``errors``. Never raises for a refused or failed start.

``release(worker) -> ReleaseResult``
    Scale-in, after the scheduler has drained the worker (moved or offloaded its sessions). Stops
    the process/pod (graceful first) and calls ``gpu.services.worker_release``. Idempotent: a
    worker already released or failed is reported as such. When the backend cannot stop it (an API
    error), the row stays live (it is still billed) and ``ReleaseResult.ok`` is false.

``reconcile(now) -> ReconcileResult``
    Called by the scheduler's periodic tick. Marks ``failed`` (``gpu.services.worker_fail``) every
    live worker of this backend whose process/pod died, and every worker still ``provisioning``
    ``provision_timeout_s`` after its request (stopping what is left of it). A worker that failed
    while provisioning is replaced by a fresh request of the same type and preset, unless the
    backend has already seen ``max_retries`` consecutive provisioning failures of that type and
    preset (since the last one became ready, within ``retry_window_s``): then the failure is
    reported in ``exhausted`` and the scheduler decides. A worker that dies after becoming ready is
    only reported; the scheduler re-places its sessions and its autoscaler asks for capacity. A
    replacement joins the failed worker's region. An instance built with ``regions`` considers only
    the workers of those regions (the tick builds one per backend in use, each with the regions
    that name it: ``registry.provisioners_by_backend``). It
    also stops leftovers: processes/pods still running for rows already released or failed; and
    orphans (``stop_orphans``): this deployment's workers that no row tracks at all.

Backends implement four hooks: ``plan`` (which workers to create), ``start``, ``stop`` and
``probe``. Configuration comes from ``settings.STREAMSERVE`` first and then the environment, and a
malformed value raises ``ImproperlyConfigured`` naming it.
"""

from __future__ import annotations

import logging
import secrets
import zlib
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass, field
from datetime import datetime, timedelta
from decimal import Decimal
from functools import partial
from typing import Any

from django.conf import settings
from django.core.exceptions import ImproperlyConfigured
from django.db import IntegrityError, connection, transaction
from django.db.models import Count, Max, Q, QuerySet
from django.utils import timezone

from contracts.catalog.presets import DEFAULT_PRESET
from gpu.models import GpuWorker
from gpu.services import TransitionError, worker_fail, worker_release

logger = logging.getLogger("gpu.provisioners")
Status = GpuWorker.Status

# Workers of these statuses may still have a process/pod that the backend should stop.
ENDED_STATUSES = (Status.RELEASED, Status.FAILED)
# An ended worker's process/Pod is left this long to exit by itself before it counts as a leftover.
LEFTOVER_GRACE_S = 30.0


class ProvisionerError(Exception):
    """A backend could not start or stop a worker; the message says why in operator terms."""


def new_worker_name(prefix: str, *parts: str) -> str:
    """A unique, DNS-1123-safe worker name (also a valid Pod name): ``prefix-part-1a2b3c``."""
    cleaned = [p.lower().replace(":", "").replace("_", "-").replace(".", "-") for p in parts if p]
    return "-".join([prefix, *cleaned, secrets.token_hex(3)])[:63]


@dataclass(frozen=True)
class WorkerRef:
    """A worker as the audit trail names it."""

    id: int
    name: str
    device: str
    gpu_type: str
    external_id: str

    @classmethod
    def of(cls, worker: GpuWorker) -> WorkerRef:
        return cls(worker.pk, worker.name, worker.device, worker.gpu_type, worker.external_id)


@dataclass(frozen=True)
class WorkerSpec:
    """One worker a backend's ``plan`` decided to create."""

    name: str
    device: str
    gpu_type: str
    host: str = "localhost"
    device_index: int | None = None


@dataclass
class RequestResult:
    provider: str
    requested: int
    gpu_type: str | None
    preset: str
    started: list[WorkerRef] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    shortfall: str = ""
    # > 0: refused by the backoff after repeated provisioning failures; ask again after this long.
    retry_after_s: float = 0.0

    @property
    def worker_ids(self) -> list[int]:
        return [ref.id for ref in self.started]

    @property
    def ok(self) -> bool:
        return len(self.started) == self.requested and not self.errors

    def as_dict(self) -> dict[str, Any]:
        return {"action": "request", **asdict(self), "granted": len(self.started), "ok": self.ok}


@dataclass
class ReleaseResult:
    provider: str
    worker: WorkerRef
    ok: bool
    status: str
    detail: str = ""

    def as_dict(self) -> dict[str, Any]:
        return {"action": "release", **asdict(self)}


@dataclass
class FailedWorker:
    worker: WorkerRef
    was: str
    reason: str


@dataclass
class ReconcileResult:
    provider: str
    checked: int = 0
    failed: list[FailedWorker] = field(default_factory=list)
    replacements: list[RequestResult] = field(default_factory=list)
    exhausted: list[str] = field(default_factory=list)
    stopped_leftovers: list[str] = field(default_factory=list)
    # Processes/Pods of this deployment that no row tracks (not a pool change: no re-plan).
    stopped_orphans: list[str] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)

    @property
    def changed(self) -> bool:
        """Whether the pool changed: the scheduler records a result and re-plans only then."""
        return bool(self.failed or self.replacements or self.stopped_leftovers)

    def summary(self) -> str:
        """One line for an operator: what reconcile found and what it did (``runplatform`` prints
        it at start, where a previous platform's leftovers show up)."""
        parts = [f"reconcile {self.provider}: {self.checked} worker row(s) checked"]
        if self.failed:
            parts.append("failed " + ", ".join(f"{f.worker.name} ({f.was}: {f.reason})" for f in self.failed))
        if self.replacements:
            parts.append(f"{sum(len(r.started) for r in self.replacements)} replacement(s) requested")
        if self.stopped_leftovers:
            parts.append("stopped leftover process(es) of ended rows " + ", ".join(self.stopped_leftovers))
        if self.stopped_orphans:
            parts.append("stopped stray process(es) no row tracks " + ", ".join(self.stopped_orphans))
        if self.exhausted:
            parts.append("retries exhausted " + ", ".join(self.exhausted))
        if self.errors:
            parts.append("errors " + "; ".join(self.errors))
        if len(parts) == 1:
            parts.append("nothing to do")
        return "; ".join(parts)

    def as_dict(self) -> dict[str, Any]:
        return {
            "action": "reconcile",
            "provider": self.provider,
            "checked": self.checked,
            "failed": [asdict(f) for f in self.failed],
            "replacements": [r.as_dict() for r in self.replacements],
            "exhausted": self.exhausted,
            "stopped_leftovers": self.stopped_leftovers,
            "stopped_orphans": self.stopped_orphans,
            "errors": self.errors,
        }


@dataclass(frozen=True)
class Probe:
    """What a backend saw of a worker's process/pod: alive or not, and a human-readable detail."""

    alive: bool
    detail: str = ""


class Provisioner(ABC):
    """Base class of every backend; see the module docstring for the contract."""

    #: The backend name, stored in ``GpuWorker.provider``.
    name: str = ""
    #: Default provisioning timeout (boot + model load) of this backend, seconds.
    default_timeout_s: float = 300.0

    def __init__(
        self,
        *,
        provision_timeout_s: float | None = None,
        max_retries: int | None = None,
        retry_window_s: float | None = None,
        backoff_s: float | None = None,
        default_capacity: int | None = None,
        prices: dict[str, Decimal] | None = None,
        regions: Iterable[int | None] | None = None,
    ) -> None:
        conf = settings.STREAMSERVE
        # The regions (ids; None: the local region) whose workers this instance reconciles and
        # replaces; None: every worker of this backend (``served``).
        self.regions = None if regions is None else frozenset(regions)
        if provision_timeout_s is None:
            provision_timeout_s = conf["PROVISION_TIMEOUT_S"]
        self.provision_timeout_s = float(
            provision_timeout_s if provision_timeout_s is not None else self.default_timeout_s
        )
        self.max_retries = int(max_retries if max_retries is not None else conf["PROVISION_MAX_RETRIES"])
        self.retry_window_s = float(
            retry_window_s if retry_window_s is not None else conf["PROVISION_RETRY_WINDOW_S"]
        )
        self.backoff_s = float(backoff_s if backoff_s is not None else conf["PROVISION_BACKOFF_S"])
        self.default_capacity = int(
            default_capacity if default_capacity is not None else conf["WORKER_CAPACITY"]
        )
        self.prices = prices if prices is not None else conf["GPU_PRICES"]
        if self.provision_timeout_s <= 0 or self.max_retries < 0 or self.default_capacity < 1:
            raise ImproperlyConfigured(
                "PROVISION_TIMEOUT_S must be > 0, PROVISION_MAX_RETRIES >= 0 and WORKER_CAPACITY >= 1"
            )

    # ------------------------------------------------------------------ backend hooks

    @abstractmethod
    def plan(self, *, count: int, gpu_type: str | None, preset: str) -> tuple[list[WorkerSpec], str]:
        """Up to ``count`` workers to create now, and why fewer if fewer (empty string otherwise)."""

    @abstractmethod
    def start(self, worker: GpuWorker) -> str:
        """Start the worker of this (already saved, provisioning) row; return its ``external_id``.

        Raises ProvisionerError with an operator-readable message when it cannot.
        """

    @abstractmethod
    def stop(self, worker: GpuWorker) -> str:
        """Stop the worker's process/pod (graceful first); return what happened.

        Stopping something already gone is not an error. Raises ProvisionerError when the backend
        cannot stop it (the worker keeps running and keeps being billed).
        """

    @abstractmethod
    def probe(self, workers: list[GpuWorker]) -> dict[int, Probe]:
        """Liveness of each worker's process/pod, keyed by ``worker.pk`` (batched where possible)."""

    def stop_orphans(self, now: datetime) -> list[str]:
        """Stop this deployment's worker processes/Pods that no row tracks; describe each stopped.

        Called at the end of ``reconcile``. An orphan is a worker the backend started whose row is
        gone or ended long ago (or that a row no longer names): it still holds a device and, once
        its row is gone, nothing else would ever stop it. Backends that cannot enumerate their
        workers keep this default. Raises ``ProvisionerError`` when the enumeration fails.
        """
        return []

    # ------------------------------------------------------------------ the contract

    def request(
        self,
        *,
        count: int,
        gpu_type: str | None = None,
        preset: str = DEFAULT_PRESET,
        capacity: int | None = None,
        price_per_hour: Decimal | float | str | None = None,
        before_start: Callable[[list[GpuWorker]], None] | None = None,
    ) -> RequestResult:
        """Scale-out (the module docstring). ``before_start`` sees the committed provisioning rows
        before any process starts: the scaler writes each worker's part of the scale plan there,
        so a worker that boots fast already finds it (docs/scaleout.md)."""
        if count < 0:
            raise ValueError(f"count must be >= 0, got {count}")
        result = RequestResult(provider=self.name, requested=count, gpu_type=gpu_type, preset=preset)
        if count == 0:
            return result
        # Plan and create the rows under a per-backend advisory lock, so that two concurrent
        # requests never pick the same CUDA index or static name; commit before starting anything,
        # so that a worker that boots fast finds its row (when not inside an outer transaction).
        workers: list[GpuWorker] = []
        with transaction.atomic():
            with connection.cursor() as cursor:
                cursor.execute("SELECT pg_advisory_xact_lock(%s)", [self._lock_key()])
            if gpu_type is not None:
                remaining, failures = self.backoff_remaining(
                    gpu_type=gpu_type, preset=preset, now=timezone.now()
                )
                if remaining > 0:
                    result.retry_after_s = round(remaining, 3)
                    result.shortfall = (
                        f"backing off: {failures} consecutive provisioning failures of {gpu_type}/{preset}; "
                        f"next attempt allowed in {remaining:.0f}s"
                    )
                    logger.warning(
                        "provision.backoff provider=%s gpu_type=%s preset=%s failures=%d remaining_s=%.0f",
                        self.name,
                        gpu_type,
                        preset,
                        failures,
                        remaining,
                    )
                    return result
            specs, shortfall = self.plan(count=count, gpu_type=gpu_type, preset=preset)
            result.shortfall = shortfall
            for spec in specs[:count]:
                try:
                    with transaction.atomic():
                        workers.append(
                            GpuWorker.objects.create(
                                name=spec.name,
                                host=spec.host,
                                device=spec.device,
                                device_index=spec.device_index,
                                gpu_type=spec.gpu_type,
                                capacity=capacity or self.default_capacity,
                                price_per_hour=self._price(spec.gpu_type, price_per_hour),
                                model_preset=preset,
                                provider=self.name,
                                status=Status.PROVISIONING,
                                requested_at=timezone.now(),
                            )
                        )
                except IntegrityError:
                    result.errors.append(f"{spec.name}: a worker of that name already exists")
        if shortfall:
            logger.warning(
                "provision.shortfall provider=%s requested=%d granted=%d reason=%r",
                self.name,
                count,
                len(workers),
                shortfall,
            )
        if before_start is not None and workers:
            try:
                before_start(workers)
            except Exception:
                # A worker without a plan loads from its own storage: a slower start, not none.
                logger.exception("provision.before_start_failed provider=%s", self.name)
        for worker in workers:
            try:
                worker.external_id = self.start(worker)
            except ProvisionerError as exc:
                message = f"{worker.name}: {exc}"
                result.errors.append(message)
                logger.error(
                    "provision.start_failed provider=%s worker=%s error=%r",
                    self.name,
                    worker.name,
                    str(exc),
                    extra={"worker": worker.name},
                )
                self._fail(worker, at=timezone.now())
                continue
            worker.save(update_fields=["external_id"])
            result.started.append(WorkerRef.of(worker))
            logger.info(
                "provision.started provider=%s worker=%s device=%s gpu_type=%s preset=%s external_id=%s",
                self.name,
                worker.name,
                worker.device,
                worker.gpu_type,
                preset,
                worker.external_id,
                extra={"worker": worker.name},
            )
        return result

    def release(self, worker: GpuWorker) -> ReleaseResult:
        worker.refresh_from_db()
        ref = WorkerRef.of(worker)
        if worker.status in ENDED_STATUSES:
            return ReleaseResult(
                self.name, ref, ok=True, status=worker.status, detail=f"already {worker.status}"
            )
        try:
            detail = self.stop(worker)
        except ProvisionerError as exc:
            logger.error(
                "provision.release_failed provider=%s worker=%s error=%r",
                self.name,
                worker.name,
                str(exc),
                extra={"worker": worker.name},
            )
            return ReleaseResult(self.name, ref, ok=False, status=worker.status, detail=str(exc))
        try:
            worker = worker_release(worker=worker)
        except TransitionError:
            # The worker deregistered itself on SIGTERM (or was failed meanwhile): already ended.
            worker.refresh_from_db()
        logger.info(
            "provision.released provider=%s worker=%s status=%s detail=%r",
            self.name,
            worker.name,
            worker.status,
            detail,
            extra={"worker": worker.name},
        )
        return ReleaseResult(
            self.name, ref, ok=worker.status in ENDED_STATUSES, status=worker.status, detail=detail
        )

    def reconcile(self, now: datetime | None = None) -> ReconcileResult:
        now = now or timezone.now()
        result = ReconcileResult(provider=self.name)
        live = list(self.served().filter(status__in=GpuWorker.LIVE_STATUSES))
        ended = self._recently_ended(now)
        result.checked = len(live)
        # One probe for both (one Pod list call per tick on Kubernetes).
        probes = self._probe_safely(live + ended, result)
        failed_provisioning: list[GpuWorker] = []
        for worker in live:
            probe = probes.get(worker.pk)
            reason = ""
            if probe is not None and not probe.alive:
                reason = probe.detail or "process is gone"
            elif worker.status == Status.PROVISIONING and now - worker.requested_at > timedelta(
                seconds=self.provision_timeout_s
            ):
                waited = (now - worker.requested_at).total_seconds()
                reason = f"still provisioning {waited:.0f}s after the request (timeout {self.provision_timeout_s:.0f}s)"
                if probe is not None and probe.detail:
                    reason += f"; {probe.detail}"
            if not reason:
                continue
            was = worker.status
            # Fail first (compare-and-set), then stop: a worker that became ready in between is
            # left alone rather than killed.
            if not self._fail(worker, at=now):
                continue
            self._stop_quietly(worker, result)
            result.failed.append(FailedWorker(WorkerRef.of(worker), was=was, reason=reason))
            logger.warning(
                "provision.worker_failed provider=%s worker=%s was=%s reason=%r",
                self.name,
                worker.name,
                was,
                reason,
                extra={"worker": worker.name},
            )
            if was == Status.PROVISIONING:
                failed_provisioning.append(worker)
        for worker in failed_provisioning:
            self._retry(worker, now=now, result=result)
        self._stop_leftovers(ended, probes, result=result)
        try:
            result.stopped_orphans = self.stop_orphans(now)
        except ProvisionerError as exc:
            result.errors.append(f"orphans: {exc}")
        return result

    def release_all(self) -> list[ReleaseResult]:
        """Release every live worker of this backend (platform shutdown, tests)."""
        live = self.served().filter(status__in=GpuWorker.LIVE_STATUSES)
        return [self.release(worker) for worker in live]

    # ------------------------------------------------------------------ shared machinery

    def served(self) -> QuerySet[GpuWorker]:
        """This backend's workers in the regions this instance serves (all of them without ``regions``)."""
        workers = GpuWorker.objects.filter(provider=self.name)
        if self.regions is None:
            return workers
        ids = [pk for pk in self.regions if pk is not None]
        in_scope = Q(region__in=ids)
        if None in self.regions:
            in_scope |= Q(region__isnull=True)
        return workers.filter(in_scope)

    def _lock_key(self) -> int:
        """A stable 32-bit key for pg_advisory_xact_lock, one per backend."""
        return zlib.crc32(f"streamserve.provisioner.{self.name}".encode())

    def _price(self, gpu_type: str, explicit: Decimal | float | str | None) -> Decimal:
        if explicit is not None:
            return Decimal(str(explicit))
        return self.prices.get(gpu_type, Decimal(0))

    def _fail(self, worker: GpuWorker, *, at: datetime) -> bool:
        try:
            worker_fail(worker=worker, at=max(at, worker.requested_at))
        except TransitionError:
            # Released or failed by someone else meanwhile (the scheduler, the worker itself).
            return False
        return True

    def _probe_safely(self, workers: list[GpuWorker], result: ReconcileResult) -> dict[int, Probe]:
        if not workers:
            return {}
        try:
            return self.probe(workers)
        except ProvisionerError as exc:
            # Without a probe we cannot tell dead from alive: only the provisioning timeout applies.
            result.errors.append(f"probe: {exc}")
            logger.error("provision.probe_failed provider=%s error=%r", self.name, str(exc))
            return {}

    def _stop_quietly(self, worker: GpuWorker, result: ReconcileResult) -> None:
        try:
            self.stop(worker)
        except ProvisionerError as exc:
            result.errors.append(f"{worker.name}: stop: {exc}")

    def _failure_streak(self, *, gpu_type: str, preset: str, now: datetime) -> tuple[int, datetime | None]:
        """Provisioning failures of this type and preset since the last one became ready, and when
        the latest ended.

        Derived from the rows (no hidden state), so it survives control-plane restarts; the
        (status, gpu_type) index narrows the scan.
        """
        since = now - timedelta(seconds=self.retry_window_s)
        same_kind = GpuWorker.objects.filter(provider=self.name, gpu_type=gpu_type, model_preset=preset)
        last_ready = same_kind.filter(ready_at__isnull=False).aggregate(at=Max("ready_at"))["at"]
        if last_ready is not None and last_ready > since:
            since = last_ready
        streak = same_kind.filter(
            status=Status.FAILED, ready_at__isnull=True, requested_at__gte=since
        ).aggregate(n=Count("pk"), last=Max("released_at"))
        return streak["n"], streak["last"]

    def consecutive_failures(self, *, gpu_type: str, preset: str, now: datetime) -> int:
        return self._failure_streak(gpu_type=gpu_type, preset=preset, now=now)[0]

    def backoff_remaining(self, *, gpu_type: str, preset: str, now: datetime) -> tuple[float, int]:
        """Seconds before a new request of this kind may start, and the failure streak.

        Past ``max_retries`` consecutive failures, requests (from the autoscaler, which would
        otherwise ask again every tick) are refused for ``PROVISION_BACKOFF_S`` doubled per further
        failure, capped at the retry window; then one attempt is let through.
        """
        failures, last = self._failure_streak(gpu_type=gpu_type, preset=preset, now=now)
        if failures <= self.max_retries or last is None:
            return 0.0, failures
        wait = min(self.backoff_s * 2 ** (failures - self.max_retries - 1), self.retry_window_s)
        return max((last - now).total_seconds() + wait, 0.0), failures

    def _retry(self, worker: GpuWorker, *, now: datetime, result: ReconcileResult) -> None:
        failures = self.consecutive_failures(gpu_type=worker.gpu_type, preset=worker.model_preset, now=now)
        if failures > self.max_retries:
            message = (
                f"{worker.name}: {failures} consecutive provisioning failures of {worker.gpu_type}/"
                f"{worker.model_preset} (max retries {self.max_retries}); not replacing"
            )
            result.exhausted.append(message)
            logger.error(
                "provision.retries_exhausted provider=%s worker=%s failures=%d",
                self.name,
                worker.name,
                failures,
                extra={"worker": worker.name},
            )
            return
        replacement = self.request(
            count=1,
            gpu_type=worker.gpu_type,
            preset=worker.model_preset,
            capacity=worker.capacity,
            price_per_hour=worker.price_per_hour,
            before_start=partial(_inherit, worker),
        )
        result.replacements.append(replacement)
        logger.info(
            "provision.retry provider=%s worker=%s attempt=%d replacement=%s",
            self.name,
            worker.name,
            failures,
            ",".join(r.name for r in replacement.started) or "-",
            extra={"worker": worker.name},
        )

    def _recently_ended(self, now: datetime) -> list[GpuWorker]:
        """Released/failed rows whose process/Pod may still run: ended within the retry window,
        but not in the last ``LEFTOVER_GRACE_S`` (a worker that deregistered itself is still
        exiting)."""
        return list(
            self.served()
            .filter(
                status__in=ENDED_STATUSES,
                released_at__gte=now - timedelta(seconds=self.retry_window_s),
                released_at__lte=now - timedelta(seconds=LEFTOVER_GRACE_S),
            )
            .exclude(external_id="")
        )

    def _stop_leftovers(
        self, ended: list[GpuWorker], probes: dict[int, Probe], *, result: ReconcileResult
    ) -> None:
        """Stop processes/Pods still running for ended rows (e.g. failed by the heartbeat timeout)."""
        for worker in ended:
            probe = probes.get(worker.pk)
            if probe is None or not probe.alive:
                continue
            try:
                self.stop(worker)
            except ProvisionerError as exc:
                result.errors.append(f"{worker.name}: stop leftover: {exc}")
                continue
            result.stopped_leftovers.append(worker.name)
            logger.warning(
                "provision.leftover_stopped provider=%s worker=%s status=%s",
                self.name,
                worker.name,
                worker.status,
                extra={"worker": worker.name},
            )


def _inherit(old: GpuWorker, workers: list[GpuWorker]) -> None:
    """A replacement keeps the failed worker's region and stage role (``--stages``)."""
    GpuWorker.objects.filter(pk__in=[w.pk for w in workers]).update(
        region=old.region_id, stage_role=old.stage_role
    )
    for worker in workers:
        worker.stage_role = old.stage_role
