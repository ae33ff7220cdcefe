"""Whose turn is it? The fair share's inputs read from the rows (issue 29): each session's tenant,
the tenants' weights, their GPU-seconds over ``TENANT_FAIR_SHARE_WINDOW_S`` and those over a
GPU-second quota. The rule itself is pure (``scheduling.core.tenants``), the same in the simulator.
"""

from __future__ import annotations

from collections.abc import Iterable
from datetime import datetime, timedelta

from django.conf import settings

from scheduling.core.tenants import DEFAULT_TENANT, TenantShares
from sessions.models import GenerationSession, Tenant
from sessions.tenants import gpu_quota_state
from sessions.usage import tenants_gpu_seconds


def _has_gpu_quota(tenant: Tenant) -> bool:
    return tenant.gpu_seconds_per_day is not None or tenant.gpu_seconds_per_month is not None


def tenant_shares(*, sessions: Iterable[GenerationSession], now: datetime) -> TenantShares | None:
    """The pool's ``TenantShares``; ``None`` when fair share cannot change a decision (every session
    of one tenant, none over a quota), so a single-team deployment reads nothing more.

    The usage query runs only when sessions of two tenants or more are in the pool: it reads the
    window's chunk records (a BRIN range scan on ``created_at``)."""
    sessions = list(sessions)
    tenant_ids = {s.tenant_id for s in sessions if s.tenant_id is not None}
    rows = {t.pk: t for t in Tenant.objects.filter(pk__in=tenant_ids)}
    default = None
    if any(s.tenant_id is None for s in sessions):
        default = Tenant.objects.filter(name=DEFAULT_TENANT).first()
    present = [*rows.values(), *([default] if default is not None else [])]
    names = {str(s.pk): rows[s.tenant_id].name if s.tenant_id in rows else DEFAULT_TENANT for s in sessions}
    several = len(set(names.values())) > 1
    spare = frozenset(
        t.name for t in present if _has_gpu_quota(t) and gpu_quota_state(tenant=t, now=now).over
    )
    if not several and not spare:
        return None
    usage: dict[str, float] = {}
    if several:
        window = timedelta(seconds=settings.STREAMSERVE["TENANT_FAIR_SHARE_WINDOW_S"])
        usage = tenants_gpu_seconds(since=now - window, until=now)
    return TenantShares(
        session_tenant=names,
        weights={t.name: t.weight for t in present},
        usage=usage,
        spare_only=spare,
    )
