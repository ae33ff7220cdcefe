from __future__ import annotations

from django.contrib import admin, messages

from sessions import services
from sessions.models import (
    ChunkLatencyRollup,
    ChunkRecord,
    GenerationSession,
    Job,
    Prompt,
    SessionEvent,
    Tenant,
    TenantMembership,
)


class ReadOnlyAdmin(admin.ModelAdmin):
    """Audit tables are written by the platform only."""

    def has_add_permission(self, request):
        return False

    def has_change_permission(self, request, obj=None):
        return False

    def has_delete_permission(self, request, obj=None):
        return False


class PromptInline(admin.TabularInline):
    model = Prompt
    extra = 0
    readonly_fields = ["text", "from_chunk", "created_at"]
    can_delete = False

    def has_add_permission(self, request, obj=None):
        return False


@admin.register(GenerationSession)
class GenerationSessionAdmin(admin.ModelAdmin):
    list_display = [
        "id",
        "owner",
        "tenant",
        "model_name",
        "resolution",
        "status",
        "activity",
        "state_location",
        "worker",
        "chunks_generated",
        "created_at",
        "last_active_at",
    ]
    list_filter = ["status", "activity", "state_location", "model_name", "tenant", "worker"]
    search_fields = ["id", "owner__username", "prompts__text"]
    date_hierarchy = "created_at"
    list_select_related = ["owner", "tenant", "worker"]
    readonly_fields = [f.name for f in GenerationSession._meta.fields]
    inlines = [PromptInline]
    actions = ["terminate_sessions"]

    def has_add_permission(self, request):
        return False

    @admin.action(description="Terminate selected sessions (recorded as depart events)")
    def terminate_sessions(self, request, queryset):
        count = 0
        for session in queryset.exclude(status=GenerationSession.Status.TERMINATED):
            services.session_terminate(session=session, reason=f"admin:{request.user.username}")
            count += 1
        self.message_user(request, f"Terminated {count} session(s).", messages.SUCCESS)


@admin.register(SessionEvent)
class SessionEventAdmin(ReadOnlyAdmin):
    list_display = ["at", "session", "kind", "detail"]
    list_filter = ["kind"]
    search_fields = ["session__id"]
    date_hierarchy = "at"


@admin.register(ChunkRecord)
class ChunkRecordAdmin(ReadOnlyAdmin):
    list_display = [
        "created_at",
        "session",
        "chunk_index",
        "worker",
        "batch_size",
        "generation_ms",
        "delivery_ms",
    ]
    list_filter = ["worker", "batch_size"]
    search_fields = ["session__id"]
    date_hierarchy = "created_at"
    list_select_related = ["worker"]
    show_full_result_count = False  # COUNT(*) over a huge table is what makes admin pages slow


@admin.register(ChunkLatencyRollup)
class ChunkLatencyRollupAdmin(ReadOnlyAdmin):
    list_display = ["minute", "worker_name", "gpu_type", "count", "max_generation_ms"]
    list_filter = ["gpu_type", "worker_name"]
    date_hierarchy = "minute"


@admin.register(Job)
class JobAdmin(ReadOnlyAdmin):
    """Jobs change through their API and the dispatcher only (epochs, commands, the result file)."""

    list_display = [
        "id", "owner", "tenant", "kind", "model_name", "state", "worker", "steps_done", "steps", "deadline",
    ]  # fmt: skip
    list_filter = ["state", "kind", "model_name", "tenant"]
    search_fields = ["id", "owner__username", "prompt"]
    date_hierarchy = "submitted_at"


class TenantMembershipInline(admin.TabularInline):
    model = TenantMembership
    extra = 1
    autocomplete_fields = ["user"]
    fields = ["user", "is_default", "created_at"]
    readonly_fields = ["created_at"]


@admin.register(Tenant)
class TenantAdmin(admin.ModelAdmin):
    """Teams sharing the pool: weight (fair share), priority class, quotas, members (docs/tenants.md)."""

    list_display = [
        "name",
        "weight",
        "priority_class",
        "gpu_seconds_per_day",
        "gpu_seconds_per_month",
        "max_live_sessions",
        "max_queued_jobs",
        "gpu_quota_enforcement",
        "member_count",
    ]
    list_filter = ["priority_class", "gpu_quota_enforcement"]
    search_fields = ["name", "members__username"]
    inlines = [TenantMembershipInline]

    @admin.display(description="members")
    def member_count(self, tenant: Tenant) -> int:
        return tenant.memberships.count()

    def has_delete_permission(self, request, obj=None):
        # Sessions and jobs keep the tenant they were charged to (PROTECT): a tenant is never deleted.
        return False
