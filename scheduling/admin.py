from __future__ import annotations

from django.contrib import admin

from scheduling.models import (
    Migration,
    ScalingAction,
    SchedulerConfig,
    SchedulerDecision,
    StagePlacement,
    StageRoleChange,
)
from sessions.admin import ReadOnlyAdmin


@admin.register(SchedulerConfig)
class SchedulerConfigAdmin(admin.ModelAdmin):
    list_display = [
        "policy",
        "min_gpus",
        "max_gpus",
        "target_utilization",
        "slo_ms",
        "queue_max",
        "updated_at",
    ]

    def has_add_permission(self, request):
        return not SchedulerConfig.objects.exists()

    def has_delete_permission(self, request, obj=None):
        return False


@admin.register(SchedulerDecision)
class SchedulerDecisionAdmin(ReadOnlyAdmin):
    list_display = [
        "decided_at",
        "trigger",
        "policy",
        "active_sessions",
        "budget",
        "target_budget",
        "rho_max",
        "volatility_level",
        "rho_hat",
        "placements_changed",
        "duration_ms",
    ]
    list_filter = ["trigger", "policy", "volatility_level"]
    date_hierarchy = "decided_at"


@admin.register(Migration)
class MigrationAdmin(ReadOnlyAdmin):
    list_display = [
        "started_at",
        "session",
        "source",
        "target",
        "state_bytes",
        "reason",
        "outcome",
        "duration_ms",
    ]
    list_filter = ["outcome", "reason"]
    search_fields = ["session__id", "source__name", "target__name"]
    date_hierarchy = "started_at"
    list_select_related = ["source", "target"]


@admin.register(ScalingAction)
class ScalingActionAdmin(ReadOnlyAdmin):
    list_display = ["created_at", "direction", "from_budget", "to_budget", "gpu_type", "reason", "outcome"]
    list_filter = ["direction", "outcome", "gpu_type"]
    date_hierarchy = "created_at"


class StageRoleChangeInline(admin.TabularInline):
    model = StageRoleChange
    fields = [
        "order",
        "worker",
        "from_role",
        "to_role",
        "status",
        "reason",
        "load_ms",
        "sent_at",
        "answered_at",
    ]
    readonly_fields = fields
    extra = 0
    can_delete = False

    def has_add_permission(self, request, obj=None):
        return False


@admin.register(StagePlacement)
class StagePlacementAdmin(ReadOnlyAdmin):
    list_display = ["created_at", "preset", "reason", "status", "finished_at"]
    list_filter = ["reason", "status", "preset"]
    date_hierarchy = "created_at"
    inlines = [StageRoleChangeInline]
