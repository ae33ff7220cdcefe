from __future__ import annotations

from django.contrib import admin, messages

from gpu import services
from gpu.models import CostLedgerEntry, GpuWorker, HostCache, Region, WeightHolding


@admin.register(Region)
class RegionAdmin(admin.ModelAdmin):
    list_display = ["name", "price_multiplier", "gpu_limits", "rtt_ms", "provisioner"]
    search_fields = ["name"]


@admin.register(GpuWorker)
class GpuWorkerAdmin(admin.ModelAdmin):
    list_display = [
        "name",
        "status",
        "gpu_type",
        "stage_role",
        "device",
        "host",
        "capacity",
        "price_per_hour",
        "provider",
        "region",
        "utilization_pct",
        "last_heartbeat",
        "requested_at",
        "released_at",
    ]
    list_filter = ["status", "gpu_type", "stage_role", "provider", "model_preset", "region"]
    search_fields = ["name", "host", "external_id"]
    date_hierarchy = "requested_at"
    readonly_fields = [
        "status",
        "requested_at",
        "ready_at",
        "released_at",
        "last_heartbeat",
        "utilization_pct",
        "memory_used_bytes",
        "power_watts",
        "temperature_c",
        "telemetry",
        "telemetry_at",
        "migration_address",
        "process_up_at",
        "weights_complete_at",
        "weights_source",
        "weights_source_detail",
        "weights_plan",
        "expected_ready_at",
    ]
    actions = ["drain_workers"]

    @admin.action(description="Drain selected workers (no new sessions; residents move away)")
    def drain_workers(self, request, queryset):
        drained, refused = 0, []
        for worker in queryset:
            try:
                services.worker_drain(worker=worker)
                drained += 1
            except services.TransitionError as exc:
                refused.append(str(exc))
        self.message_user(request, f"Draining {drained} worker(s).", messages.SUCCESS)
        for reason in refused:
            self.message_user(request, reason, messages.WARNING)


@admin.register(CostLedgerEntry)
class CostLedgerEntryAdmin(admin.ModelAdmin):
    list_display = ["interval_start", "worker", "gpu_type", "gpu_seconds", "cost_usd"]
    list_filter = ["gpu_type"]
    date_hierarchy = "interval_start"
    list_select_related = ["worker"]

    def has_add_permission(self, request):
        return False

    def has_change_permission(self, request, obj=None):
        return False

    def has_delete_permission(self, request, obj=None):
        return False


class WeightHoldingInline(admin.TabularInline):
    model = WeightHolding
    fields = ["model_preset", "state", "host_slot", "weights_bytes", "address", "digest", "last_used_at"]
    readonly_fields = fields
    extra = 0
    can_delete = False


@admin.register(HostCache)
class HostCacheAdmin(admin.ModelAdmin):
    """Host caches are registered by their process (``manage.py hostcache``); read-only here."""

    list_display = ["name", "host", "status", "capacity_bytes", "pinned", "last_heartbeat"]
    list_filter = ["status"]
    readonly_fields = [f.name for f in HostCache._meta.fields]
    inlines = [WeightHoldingInline]

    def has_add_permission(self, request):
        return False


@admin.register(WeightHolding)
class WeightHoldingAdmin(admin.ModelAdmin):
    """The parameter pool: written by workers and host caches through ``gpu.services`` only."""

    list_display = [
        "model_preset",
        "kind",
        "state",
        "worker",
        "cache",
        "host",
        "host_slot",
        "weights_bytes",
        "last_used_at",
    ]
    list_filter = ["model_preset", "kind", "state"]
    list_select_related = ["worker", "cache"]

    def has_add_permission(self, request):
        return False

    def has_change_permission(self, request, obj=None):
        return False
