"""GPU workers and the cost ledger derived from their lifecycles."""

from __future__ import annotations

import math
from decimal import Decimal

from django.core.exceptions import ValidationError
from django.db import models
from django.db.models import Q

from gpu.backends import PROVISIONER_BACKENDS


class WeightsSource(models.TextChoices):
    """Where a worker's weights came from (the recorded source of its ``weights complete`` phase)."""

    DISK = "disk", "local storage"
    HOST_CACHE = "host_cache", "host cache"
    PEER = "peer", "peer GPU"
    INIT = "init", "seeded init"


def validate_gpu_limits(value) -> None:
    """``{"H100": 8, ...}``: GPU type -> the most GPUs of that type the region may hold."""
    if not isinstance(value, dict):
        raise ValidationError("must be an object of GPU type -> count")
    for key, count in value.items():
        if not isinstance(key, str) or not key:
            raise ValidationError(f"GPU type {key!r} must be a non-empty string")
        if isinstance(count, bool) or not isinstance(count, int) or count < 0:
            raise ValidationError(f"gpu_limits.{key}: must be a whole number >= 0, got {count!r}")


def validate_rtt_ms(value) -> None:
    """``{"nyc": 2.0, ...}``: user origin -> round-trip time to this region in milliseconds."""
    if not isinstance(value, dict):
        raise ValidationError("must be an object of origin -> milliseconds")
    for key, ms in value.items():
        if not isinstance(key, str) or not key:
            raise ValidationError(f"origin {key!r} must be a non-empty string")
        if isinstance(ms, bool) or not isinstance(ms, (int, float)) or not math.isfinite(ms) or ms < 0:
            raise ValidationError(f"rtt_ms.{key}: must be a finite number >= 0, got {ms!r}")


def validate_provisioner_name(value: str) -> None:
    """One of the built-in provisioner backends (``gpu.backends``)."""
    if value not in PROVISIONER_BACKENDS:
        raise ValidationError(
            f"provisioner: {value!r} is not a provisioner backend ({', '.join(sorted(PROVISIONER_BACKENDS))})"
        )


class Region(models.Model):
    """A GPU pool's location: its price, its capacity limits and its RTT from each user origin.

    The row of the RTT matrix for this region lives in ``rtt_ms`` (origin -> ms); the known origins
    are the union of the keys over all regions. Workers belong to a region (``GpuWorker.region``).

    The local region (``DEFAULT_NAME``) needs no row: a worker or session whose ``region`` is null is
    in it. A row of that name, when an operator adds one, only gives the local region a price, GPU
    limits and an RTT row. No code path requires the row, so nothing breaks when it is absent — a
    fresh database, or one flushed by transactional tests (a data migration's row would not survive).

    ``provisioner`` names the backend that starts, stops and reconciles the region's workers; empty is
    the ``PROVISIONER`` setting, which also serves the local region without a row
    (``gpu.provisioners.registry.provisioner_for``).
    """

    DEFAULT_NAME = "local"

    name = models.CharField(max_length=64, unique=True)
    price_multiplier = models.FloatField(default=1.0, help_text="multiplies the GPU price in this region")
    gpu_limits = models.JSONField(
        default=dict, blank=True, validators=[validate_gpu_limits], help_text="GPU type -> most GPUs"
    )
    rtt_ms = models.JSONField(
        default=dict, blank=True, validators=[validate_rtt_ms], help_text="user origin -> RTT in ms"
    )
    provisioner = models.CharField(
        max_length=32,
        blank=True,
        default="",
        validators=[validate_provisioner_name],
        help_text="provisioner backend of this region's workers; empty: the PROVISIONER setting",
    )

    class Meta:
        ordering = ["name"]
        constraints = [
            models.CheckConstraint(
                name="region_price_multiplier_positive", condition=Q(price_multiplier__gt=0)
            ),
        ]

    def __str__(self) -> str:
        return self.name


# Stage roles of a worker (TridentServe §6.1; docs/stages.md): the stages it hosts, E (text encoder),
# D (diffusion transformer), C (VAE decoder). EDC is today's monolithic worker.
STAGE_ROLES = ("EDC", "ED", "DC", "D", "E", "C")


class GpuWorker(models.Model):
    """One GPU (or, in development, one CPU process) hosting a model replica.

    Lifecycle: provisioning → ready → draining → released (+ failed). Cost accrues from
    ``requested_at`` (the provisioning request) until ``released_at``: boot and model load are paid.
    """

    class Status(models.TextChoices):
        PROVISIONING = "provisioning"
        READY = "ready"
        DRAINING = "draining"
        RELEASED = "released"
        FAILED = "failed"

    # Statuses in which the worker is billed and may still hold sessions.
    LIVE_STATUSES = (Status.PROVISIONING, Status.READY, Status.DRAINING)

    name = models.CharField(max_length=100, unique=True)
    host = models.CharField(max_length=255, default="localhost")
    device = models.CharField(max_length=32, default="cpu", help_text="torch device, e.g. cpu or cuda:0")
    device_index = models.PositiveSmallIntegerField(null=True, blank=True)
    gpu_type = models.CharField(max_length=64, default="cpu", db_index=True)
    memory_bytes = models.BigIntegerField(default=0)
    capacity = models.PositiveIntegerField(default=4, help_text="K: sessions per worker at the SLO")
    price_per_hour = models.DecimalField(max_digits=10, decimal_places=4, default=Decimal("0"))
    model_preset = models.CharField(max_length=64, default="tiny")
    provider = models.CharField(max_length=32, default="local")
    external_id = models.CharField(max_length=255, blank=True, default="")
    status = models.CharField(max_length=16, choices=Status.choices, default=Status.PROVISIONING)
    requested_at = models.DateTimeField(help_text="When provisioning was requested (billing starts)")
    ready_at = models.DateTimeField(null=True, blank=True)
    released_at = models.DateTimeField(null=True, blank=True)
    last_heartbeat = models.DateTimeField(null=True, blank=True)
    # Where peers reach this worker's migration listener (host:port), advertised at registration.
    migration_address = models.CharField(max_length=255, blank=True, default="")
    # Latest telemetry (NVML on GPUs; CPU figures where NVML is absent).
    utilization_pct = models.FloatField(null=True, blank=True)
    memory_used_bytes = models.BigIntegerField(null=True, blank=True)
    power_watts = models.FloatField(null=True, blank=True)
    temperature_c = models.FloatField(null=True, blank=True)
    telemetry = models.JSONField(default=dict, blank=True)
    telemetry_at = models.DateTimeField(null=True, blank=True)
    # Scale-out phases (BlitzScale §5; docs/scaleout.md): requested_at → process_up_at →
    # weights_complete_at (from weights_source) → ready_at. ``expected_ready_at`` is the scale plan's
    # estimate while the worker loads; ``weights_plan`` is this worker's part of that plan.
    process_up_at = models.DateTimeField(null=True, blank=True)
    weights_complete_at = models.DateTimeField(null=True, blank=True)
    weights_source = models.CharField(
        max_length=16,
        choices=WeightsSource.choices,
        blank=True,
        default="",
        help_text="where the weights came from",
    )
    weights_source_detail = models.CharField(max_length=255, blank=True, default="")
    weights_plan = models.JSONField(default=dict, blank=True)
    expected_ready_at = models.DateTimeField(null=True, blank=True)
    # Null: the local region (see ``Region``).
    region = models.ForeignKey(
        Region, null=True, blank=True, on_delete=models.PROTECT, related_name="workers"
    )
    # The stages this worker hosts, as it last reported them (heartbeat, registration) or as a
    # ``set_role`` it acknowledged set them. An ``E`` worker serves prompt encodings to the others
    # and holds no sessions (docs/stages.md, "Live placement").
    stage_role = models.CharField(
        max_length=3, choices=[(r, r) for r in STAGE_ROLES], default="EDC", help_text="stages it hosts"
    )

    class Meta:
        ordering = ["name"]
        indexes = [models.Index(fields=["status", "gpu_type"])]
        constraints = [
            models.CheckConstraint(
                name="gpuworker_released_has_time",
                condition=~Q(status="released") | Q(released_at__isnull=False),
            ),
            models.CheckConstraint(
                name="gpuworker_ready_has_time",
                condition=~Q(status__in=["ready", "draining"]) | Q(ready_at__isnull=False),
            ),
            models.CheckConstraint(
                name="gpuworker_release_after_request",
                condition=Q(released_at__isnull=True) | Q(released_at__gte=models.F("requested_at")),
            ),
            models.CheckConstraint(name="gpuworker_capacity_positive", condition=Q(capacity__gte=1)),
            models.CheckConstraint(
                name="gpuworker_stage_role_known", condition=Q(stage_role__in=STAGE_ROLES)
            ),
            models.CheckConstraint(name="gpuworker_price_nonnegative", condition=Q(price_per_hour__gte=0)),
            models.CheckConstraint(
                name="gpuworker_weights_complete_has_source",
                condition=Q(weights_complete_at__isnull=True) | ~Q(weights_source=""),
            ),
        ]

    def __str__(self) -> str:
        return f"{self.name} ({self.gpu_type}, {self.status})"

    @property
    def is_live(self) -> bool:
        return self.status in self.LIVE_STATUSES

    @property
    def holds_sessions(self) -> bool:
        """A stream runs where its diffusion model and its decoder are (the causal decoder keeps a
        per-session cache next to the state): EDC or DC, never E or C (nor ED or D)."""
        return "D" in self.stage_role and "C" in self.stage_role

    @property
    def encoder_load(self) -> int:
        """An E worker's queue of prompt encodes, as its last heartbeat reported it."""
        return self.service_load("encoder")

    @property
    def decoder_load(self) -> int:
        """A C worker's queue of job decodes, as its last heartbeat reported it."""
        return self.service_load("decoder")

    def service_load(self, service: str) -> int:
        """The request queue a stage service (``encoder``, ``decoder``) reported in its heartbeat."""
        report = (self.telemetry or {}).get(service) if isinstance(self.telemetry, dict) else None
        queue = report.get("queue") if isinstance(report, dict) else None
        return queue if isinstance(queue, int) and not isinstance(queue, bool) and queue >= 0 else 0


class CostLedgerEntry(models.Model):
    """GPU-seconds and money of one worker over one interval (a minute), from its lifecycle.

    Written by ``gpu.services.ledger_accrue`` for closed minutes; queried by the audit endpoints
    through ``date_trunc`` on ``interval_start``.
    """

    worker = models.ForeignKey(GpuWorker, on_delete=models.PROTECT, related_name="ledger_entries")
    gpu_type = models.CharField(max_length=64)
    interval_start = models.DateTimeField()
    interval_end = models.DateTimeField()
    gpu_seconds = models.FloatField()
    cost_usd = models.DecimalField(max_digits=14, decimal_places=6)

    class Meta:
        ordering = ["interval_start", "worker_id"]
        constraints = [
            models.UniqueConstraint(
                fields=["worker", "interval_start"], name="ledger_one_row_per_worker_interval"
            ),
            models.CheckConstraint(
                name="ledger_interval_ordered", condition=Q(interval_end__gt=models.F("interval_start"))
            ),
            models.CheckConstraint(name="ledger_seconds_nonnegative", condition=Q(gpu_seconds__gte=0)),
        ]
        indexes = [models.Index(fields=["interval_start", "gpu_type"])]
        verbose_name_plural = "cost ledger entries"

    def __str__(self) -> str:
        return f"{self.worker_id} {self.interval_start:%Y-%m-%d %H:%M} {self.gpu_seconds:.0f}s"


class HostCache(models.Model):
    """A host-cache process (``manage.py hostcache``): model weights in host memory, served to peers.

    Lifecycle: live → stopped (it exited) or lost (its heartbeat stopped; ``host_caches_check``).
    Its holdings (``WeightHolding`` rows) go with it, so the pool never names a dead holder.
    """

    class Status(models.TextChoices):
        LIVE = "live"
        STOPPED = "stopped"
        LOST = "lost"

    name = models.CharField(max_length=100, unique=True)
    host = models.CharField(max_length=255, default="localhost")
    # Where peers fetch blocks (host:port of the block server).
    address = models.CharField(max_length=255, blank=True, default="")
    capacity_bytes = models.BigIntegerField(help_text="host memory this cache may fill")
    pinned = models.BooleanField(default=False, help_text="page-locked memory (CUDA hosts)")
    status = models.CharField(max_length=16, choices=Status.choices, default=Status.LIVE)
    started_at = models.DateTimeField()
    last_heartbeat = models.DateTimeField()
    stopped_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        ordering = ["name"]
        constraints = [
            models.CheckConstraint(name="hostcache_capacity_positive", condition=Q(capacity_bytes__gt=0)),
            models.CheckConstraint(
                name="hostcache_ended_has_time",
                condition=Q(status="live") | Q(stopped_at__isnull=False),
            ),
        ]

    def __str__(self) -> str:
        return f"{self.name} ({self.host}, {self.status})"


class WeightHolding(models.Model):
    """One copy of a model's weights in the parameter pool (BlitzScale §5.3).

    Held either in a serving worker's GPU memory (``kind=gpu``, ``worker``) or in a host cache
    (``kind=host``, ``cache``). A copy is ``loading`` until its holder verified every block against
    the manifest's checksums, then ``complete``; only complete copies are offered as sources.

    "O(1) host caching": host copies of one model take a ``host_slot`` in ``[0, POOL_HOST_COPIES)``
    and (model, slot) is unique, so the bound holds under any race between registrations: the
    database refuses the second writer of a slot (``gpu.services.host_copy_register``).
    """

    class Kind(models.TextChoices):
        GPU = "gpu", "GPU memory"
        HOST = "host", "host memory"

    class State(models.TextChoices):
        LOADING = "loading"
        COMPLETE = "complete"

    model_preset = models.CharField(max_length=64)
    kind = models.CharField(max_length=8, choices=Kind.choices)
    state = models.CharField(max_length=16, choices=State.choices, default=State.LOADING)
    worker = models.ForeignKey(
        GpuWorker, null=True, blank=True, on_delete=models.CASCADE, related_name="weight_holdings"
    )
    cache = models.ForeignKey(
        HostCache, null=True, blank=True, on_delete=models.CASCADE, related_name="holdings"
    )
    host = models.CharField(max_length=255)
    # Where peers fetch this copy's blocks (host:port); empty when the holder serves none.
    address = models.CharField(max_length=255, blank=True, default="")
    weights_bytes = models.BigIntegerField(default=0)
    # Digest of the block manifest (every block's checksum): copies with equal digests are identical.
    digest = models.CharField(max_length=64, blank=True, default="")
    host_slot = models.PositiveSmallIntegerField(null=True, blank=True)
    created_at = models.DateTimeField()
    completed_at = models.DateTimeField(null=True, blank=True)
    # Host caches evict the least recently used copy first when memory is bounded.
    last_used_at = models.DateTimeField()

    class Meta:
        ordering = ["model_preset", "kind", "id"]
        indexes = [models.Index(fields=["model_preset", "state"])]
        constraints = [
            models.CheckConstraint(
                name="holding_one_holder_of_its_kind",
                condition=(Q(kind="gpu") & Q(worker__isnull=False) & Q(cache__isnull=True))
                | (Q(kind="host") & Q(cache__isnull=False) & Q(worker__isnull=True)),
            ),
            models.CheckConstraint(
                name="holding_host_copies_have_slot",
                condition=(Q(kind="host") & Q(host_slot__isnull=False))
                | (Q(kind="gpu") & Q(host_slot__isnull=True)),
            ),
            models.CheckConstraint(
                name="holding_complete_has_time",
                condition=Q(state="loading") | Q(completed_at__isnull=False),
            ),
            models.CheckConstraint(name="holding_bytes_nonnegative", condition=Q(weights_bytes__gte=0)),
            # The cluster-wide bound on host copies: one row per (model, slot).
            models.UniqueConstraint(
                fields=["model_preset", "host_slot"],
                condition=Q(kind="host"),
                name="holding_host_slot_unique",
            ),
            models.UniqueConstraint(
                fields=["model_preset", "worker"], condition=Q(kind="gpu"), name="holding_one_per_worker"
            ),
            models.UniqueConstraint(
                fields=["model_preset", "cache"], condition=Q(kind="host"), name="holding_one_per_cache"
            ),
        ]

    def __str__(self) -> str:
        holder = self.worker_id if self.kind == self.Kind.GPU else self.cache_id
        return f"{self.model_preset} {self.kind}:{holder} ({self.state})"
