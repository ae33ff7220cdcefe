"""Weighted fair share between tenants: the order in which waiting sessions are offered the GPUs.

A tenant's fair share of the pool is its weight over the sum of the weights. Its standing is the
GPU-seconds charged to it over a recent window (``usage``, measured from the audit's records by the
control plane) per unit of weight: the tenant that has used least per unit of weight is the furthest
under its share and goes first. Within a tenant, sessions keep their arrival order (FCFS). Sessions
of a tenant over a GPU-second quota (``spare_only``) go last, after every other tenant's, and never
count as demand that scales the pool out (``Snapshot.spare_only``, read by the autoscaler): they run
on capacity the others leave.

Ordering each decision by the standing is a feedback loop, not a one-shot split: a tenant admitted
ahead uses GPU-seconds, which pushes it back in the next decision's order, so over a run in which two
tenants keep the pool saturated, their GPU-seconds approach the ratio of their weights.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

DEFAULT_TENANT = "default"


@dataclass(frozen=True)
class TenantShares:
    """What fair share needs to know: each session's tenant (a session not named belongs to
    ``DEFAULT_TENANT``), each tenant's weight (missing: 1) and GPU-seconds over the window (missing:
    none), and the tenants whose work runs on spare capacity only (over a GPU-second quota)."""

    session_tenant: Mapping[str, str] = field(default_factory=dict)
    weights: Mapping[str, float] = field(default_factory=dict)
    usage: Mapping[str, float] = field(default_factory=dict)
    spare_only: frozenset[str] = frozenset()

    def tenant_of(self, session: str) -> str:
        return self.session_tenant.get(session, DEFAULT_TENANT)

    def standing(self, tenant: str) -> float:
        """GPU-seconds used per unit of weight: lower is further under the fair share."""
        return self.usage.get(tenant, 0.0) / self.weights.get(tenant, 1.0)


def fair_order(pending: Sequence[str], shares: TenantShares) -> tuple[str, ...]:
    """``pending`` (arrival order) reordered: tenants on spare capacity last, then the furthest under
    its share first (ties: the tenant whose first session arrived first); FCFS within a tenant."""
    by_tenant: dict[str, list[str]] = {}
    for sid in pending:
        by_tenant.setdefault(shares.tenant_of(sid), []).append(sid)
    if len(by_tenant) <= 1 and not shares.spare_only:
        return tuple(pending)
    arrival = {tenant: i for i, tenant in enumerate(by_tenant)}
    tenants = sorted(by_tenant, key=lambda t: (t in shares.spare_only, shares.standing(t), arrival[t]))
    return tuple(sid for tenant in tenants for sid in by_tenant[tenant])


def spare_only_sessions(sessions: Sequence[str], shares: TenantShares) -> frozenset[str]:
    """The sessions of tenants over a GPU-second quota: demand the pool never scales out for."""
    if not shares.spare_only:
        return frozenset()
    return frozenset(sid for sid in sessions if shares.tenant_of(sid) in shares.spare_only)
