"""GPU workers and the cost ledger derived from their lifecycles."""

from __future__ import annotations

from decimal import Decimal

from django.db import models
from django.db.models import Q


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
            models.CheckConstraint(name="gpuworker_price_nonnegative", condition=Q(price_per_hour__gte=0)),
        ]

    def __str__(self) -> str:
        return f"{self.name} ({self.gpu_type}, {self.status})"

    @property
    def is_live(self) -> bool:
        return self.status in self.LIVE_STATUSES


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
