"""Tenants: who a user acts for, membership, and the quotas checked where work is admitted (issue 29).

``tenant_acting_for`` resolves the tenant a request acts for (the one it names, else the user's
default); ``quota_admit_session`` and ``quota_admit_job`` are called inside ``session_create`` and
``job_submit``, under the tenant's row lock, so two concurrent creations cannot both pass a count
quota at limit - 1. A refusal is ``QuotaExceeded``: the quota's name, its value, what is used and
when it resets — the REST views answer it with HTTP 429, the sockets with an ``error`` frame. Work
already admitted is never stopped by a quota: it finishes (a stream keeps streaming).
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import UTC, datetime, timedelta

from django.core.exceptions import ValidationError
from django.db import IntegrityError, transaction
from django.db.models import QuerySet
from django.utils import timezone

from sessions.models import GenerationSession, Job, Tenant, TenantMembership
from sessions.usage import tenant_gpu_seconds


class QuotaExceeded(Exception):
    """A tenant's hard quota is spent: ``quota`` names it, ``limit`` is its value, ``used`` what is
    counted against it, ``resets_at`` when a GPU-second quota starts again (``None`` for a count:
    it frees when work ends)."""

    def __init__(self, *, tenant: Tenant, quota: str, limit: float, used: float, resets_at: datetime | None):
        self.tenant, self.quota, self.limit, self.used, self.resets_at = tenant, quota, limit, used, resets_at
        when = f"; it resets at {resets_at.isoformat()}" if resets_at else "; it frees as work ends"
        super().__init__(
            f"tenant {tenant.name!r} is over its quota {quota} = {limit:g} (used {used:g}){when}"
        )

    def as_dict(self) -> dict:
        """The refusal's fields, as the 429 body and the socket's ``error`` frame carry them."""
        return {
            "tenant": self.tenant.name,
            "quota": self.quota,
            "limit": self.limit,
            "used": round(self.used, 3),
            "resets_at": self.resets_at.isoformat() if self.resets_at else None,
        }


# --- who a request acts for -------------------------------------------------------------------------


def tenant_default() -> Tenant:
    """The tenant of users who belong to no other (created by migration 0009, or here if deleted)."""
    tenant, _ = Tenant.objects.get_or_create(name=Tenant.DEFAULT_NAME)
    return tenant


def tenant_acting_for(*, user, name: str | None = None) -> Tenant:
    """The tenant ``user`` acts for: ``name`` when given (they must belong to it: else a
    ``ValidationError`` on the field ``tenant``), else their default tenant. A user who belongs to
    no tenant yet (created after the migration) joins the default tenant, as their default."""
    if name:
        membership = (
            TenantMembership.objects.select_related("tenant").filter(user=user, tenant__name=name).first()
        )
        if membership is None:
            raise ValidationError({"tenant": f"you are not a member of tenant {name!r}"})
        return membership.tenant
    membership = (
        TenantMembership.objects.select_related("tenant")
        .filter(user=user)
        .order_by("-is_default", "created_at", "pk")
        .first()
    )
    if membership is not None:
        return membership.tenant
    tenant = tenant_default()
    membership_add(tenant=tenant, user=user, is_default=True)
    return tenant


@transaction.atomic
def membership_add(*, tenant: Tenant, user, is_default: bool = False) -> TenantMembership:
    """Make ``user`` a member of ``tenant`` (idempotent); ``is_default`` makes it the tenant they act
    for by default (their previous default stays a membership)."""
    if is_default:
        TenantMembership.objects.filter(user=user, is_default=True).exclude(tenant=tenant).update(
            is_default=False
        )
    try:
        with transaction.atomic():
            membership, created = TenantMembership.objects.get_or_create(
                tenant=tenant, user=user, defaults={"is_default": is_default}
            )
    except IntegrityError:  # a concurrent add of the same membership won the race
        membership, created = TenantMembership.objects.get(tenant=tenant, user=user), False
    if not created and is_default and not membership.is_default:
        membership.is_default = True
        membership.save(update_fields=["is_default"])
    return membership


@transaction.atomic
def membership_remove(*, tenant: Tenant, user) -> bool:
    """``user`` leaves ``tenant``; their sessions and jobs keep the tenant they were charged to.
    Returns whether they were a member."""
    return TenantMembership.objects.filter(tenant=tenant, user=user).delete()[0] > 0


# --- quotas -----------------------------------------------------------------------------------------


def day_start(now: datetime) -> datetime:
    """The UTC day ``now`` falls in starts here; a daily quota resets a day later."""
    return now.astimezone(UTC).replace(hour=0, minute=0, second=0, microsecond=0)


def month_start(now: datetime) -> datetime:
    return day_start(now).replace(day=1)


def next_month(start: datetime) -> datetime:
    return (start + timedelta(days=32)).replace(day=1)


@dataclass(frozen=True)
class GpuQuotaState:
    """Where a tenant stands against its GPU-second quotas now: the first one spent (``None``: none)."""

    spent: QuotaExceeded | None
    enforcement: str

    @property
    def hard_over(self) -> bool:
        return self.spent is not None and self.enforcement == Tenant.Enforcement.HARD

    @property
    def over(self) -> bool:
        return self.spent is not None


def gpu_quota_state(*, tenant: Tenant, now: datetime | None = None) -> GpuQuotaState:
    """The tenant's GPU-seconds charged today and this month (UTC) against its quotas."""
    now = now or timezone.now()
    day, month = day_start(now), month_start(now)
    checks = (
        ("gpu_seconds_per_day", tenant.gpu_seconds_per_day, day, day + timedelta(days=1)),
        ("gpu_seconds_per_month", tenant.gpu_seconds_per_month, month, next_month(month)),
    )
    for quota, limit, since, resets in checks:
        if limit is None:
            continue
        used = tenant_gpu_seconds(tenant=tenant, since=since, until=now)
        if used >= limit:
            spent = QuotaExceeded(tenant=tenant, quota=quota, limit=limit, used=used, resets_at=resets)
            return GpuQuotaState(spent=spent, enforcement=tenant.gpu_quota_enforcement)
    return GpuQuotaState(spent=None, enforcement=tenant.gpu_quota_enforcement)


def _locked(tenant: Tenant) -> Tenant:
    # The tenant's row is the lock of its count quotas: two creations cannot both count limit - 1.
    return Tenant.objects.select_for_update().get(pk=tenant.pk)


def _check_count(tenant: Tenant, quota: str, limit: int | None, used: int) -> None:
    if limit is not None and used >= limit:
        raise QuotaExceeded(tenant=tenant, quota=quota, limit=limit, used=used, resets_at=None)


def _check_gpu(tenant: Tenant) -> None:
    state = gpu_quota_state(tenant=tenant)
    if state.hard_over:
        raise state.spent  # type: ignore[misc]


def quota_admit_session(*, tenant: Tenant) -> None:
    """Raise ``QuotaExceeded`` when a new session of ``tenant`` would pass a hard quota (its live
    sessions, or GPU-seconds spent under hard enforcement). Call it inside the creating transaction."""
    tenant = _locked(tenant)
    live = GenerationSession.objects.filter(tenant=tenant).exclude(status=GenerationSession.Status.TERMINATED)
    _check_count(tenant, "max_live_sessions", tenant.max_live_sessions, live.count())
    _check_gpu(tenant)


def quota_admit_job(*, tenant: Tenant) -> None:
    """Raise ``QuotaExceeded`` when a new job of ``tenant`` would pass a hard quota (its queued jobs,
    or GPU-seconds spent under hard enforcement). Call it inside the submitting transaction."""
    tenant = _locked(tenant)
    queued = Job.objects.filter(tenant=tenant, state=Job.State.QUEUED)
    _check_count(tenant, "max_queued_jobs", tenant.max_queued_jobs, queued.count())
    _check_gpu(tenant)


# --- reads ------------------------------------------------------------------------------------------


def tenants_visible_to(user) -> QuerySet[Tenant]:
    """Staff see every tenant; a member only those they belong to (others are 404, not 403)."""
    qs = Tenant.objects.all()
    return qs if user.is_staff else qs.filter(memberships__user=user).distinct()


def quota_report(*, tenant: Tenant, now: datetime | None = None) -> dict:
    """Each quota with its value (null: unlimited), what counts against it now and when it resets."""
    now = now or timezone.now()
    day, month = day_start(now), month_start(now)
    live = GenerationSession.objects.filter(tenant=tenant).exclude(status=GenerationSession.Status.TERMINATED)
    return {
        "gpu_quota_enforcement": tenant.gpu_quota_enforcement,
        "gpu_seconds_per_day": {
            "limit": tenant.gpu_seconds_per_day,
            "used": tenant_gpu_seconds(tenant=tenant, since=day, until=now),
            "resets_at": day + timedelta(days=1),
        },
        "gpu_seconds_per_month": {
            "limit": tenant.gpu_seconds_per_month,
            "used": tenant_gpu_seconds(tenant=tenant, since=month, until=now),
            "resets_at": next_month(month),
        },
        "max_live_sessions": {"limit": tenant.max_live_sessions, "used": live.count()},
        "max_queued_jobs": {
            "limit": tenant.max_queued_jobs,
            "used": Job.objects.filter(tenant=tenant, state=Job.State.QUEUED).count(),
        },
    }
