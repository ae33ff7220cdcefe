"""The operator console's reads (one cluster snapshot) and its audited actions.

The snapshot is what `/console/` renders first and what the `/ws/console/` consumer pushes every
interval: the workers with their telemetry and load against K, session counts, the GPU budget against
the autoscaler's latest target, the last minute's worst and p99 chunk latency against the SLO, the
cost rate, each region's GPUs, sessions and cost rate with each origin's load against its forecast
(docs/regions.md), one-shot jobs per state and per worker, each worker's stage role
(docs/stages.md), and a merged timeline of decisions, migrations, scaling actions, stage placements
and operator actions.

Console actions wrap the owning apps' services and add an admin ``LogEntry`` naming the operator, so
every change made from the console is in one audit trail next to the admin's own history.
"""

from __future__ import annotations

from collections import Counter
from datetime import timedelta
from decimal import Decimal
from typing import Any

from django.conf import settings
from django.contrib.admin.models import CHANGE, LogEntry
from django.contrib.contenttypes.models import ContentType
from django.core.cache import cache
from django.core.exceptions import ValidationError
from django.db import connection, transaction
from django.db.models import Count, Max, Q, Sum
from django.utils import timezone

from contracts.http.timerange import TimeRange
from gpu import selectors as pool_selectors
from gpu import services as gpu_services
from gpu.models import GpuWorker, HostCache, Region
from scheduling.api import SchedulerConfigSerializer
from scheduling.live.regions import origin_demand
from scheduling.live.stages.encoders import current_encoders
from scheduling.models import (
    Migration,
    ScalingAction,
    SchedulerConfig,
    SchedulerDecision,
    StagePlacement,
    StageRoleChange,
    WorkerCommand,
)
from scheduling.selectors import region_moves_audit
from sessions import services as session_services
from sessions.models import ChunkRecord, GenerationSession, Job, Tenant
from sessions.selectors import PercentileCont, job_queue_positions, sessions_with_idle_reason
from sessions.usage import tenants_gpu_seconds

Status = GenerationSession.Status

LATENCY_WINDOW = timedelta(minutes=1)
TIMELINE_LENGTH = 30
SESSION_LIST_LENGTH = 100
# Workers listed on the console: the live ones plus those released or failed in the last few minutes,
# so an operator sees a worker go away instead of it vanishing between two snapshots.
RECENTLY_GONE = timedelta(minutes=5)
# Ended jobs the console counts: the last hour's (the audit has the history).
RECENT_JOBS = timedelta(hours=1)


def _iso(moment) -> str | None:
    return moment.isoformat() if moment else None


def _encoder_sources(workers) -> dict[int, dict[str, Any]]:
    """Per live worker that holds sessions without E: ``{"worker", "wait", "failover"}`` — the
    encoder it was last told to use, the reason its heartbeat gives for waiting (``encoder_wait``),
    and its last ``set_encoder`` (from, to, why, outcome, when)."""
    dependants = [
        w
        for w in workers
        if w.status in GpuWorker.LIVE_STATUSES and w.holds_sessions and "E" not in w.stage_role
    ]
    if not dependants:
        return {}
    current = current_encoders(dependants)
    last = {
        c.worker_id: c
        for c in WorkerCommand.objects.filter(worker__in=dependants, kind=WorkerCommand.Kind.SET_ENCODER)
        .order_by("worker_id", "-created_at")
        .distinct("worker_id")
    }
    out: dict[int, dict[str, Any]] = {}
    for w in dependants:
        wait = (w.telemetry or {}).get("encoder_wait")
        command = last.get(w.pk)
        out[w.pk] = {
            "worker": current.get(w.name) or None,
            "wait": wait.get("reason") if isinstance(wait, dict) else None,
            "failover": None
            if command is None
            else {
                "from": command.payload.get("lost"),
                "to": (command.payload.get("encoder") or {}).get("worker"),
                "why": command.payload.get("why", ""),
                "status": command.status,
                "at": _iso(command.created_at),
            },
        }
    return out


def _workers(now) -> list[dict[str, Any]]:
    workers = (
        GpuWorker.objects.filter(
            Q(status__in=GpuWorker.LIVE_STATUSES) | Q(released_at__gte=now - RECENTLY_GONE)
        )
        .annotate(
            resident=Count("sessions", filter=Q(sessions__status__in=[Status.EXECUTING, Status.MIGRATING])),
            resident_load=Sum(
                "sessions__load", filter=Q(sessions__status__in=[Status.EXECUTING, Status.MIGRATING])
            ),
        )
        .select_related("region")
        .order_by("name")
    )
    parked = dict(
        GenerationSession.objects.filter(status=Status.SUSPENDED, host_worker__isnull=False)
        .values("host_worker")
        .annotate(n=Count("id"))
        .values_list("host_worker", "n")
    )
    jobs_held: dict[int, dict[str, int]] = {}
    for worker_id, job_state, n in (
        Job.objects.filter(state__in=[Job.State.RUNNING, Job.State.PAUSED], worker__isnull=False)
        .values("worker", "state")
        .annotate(n=Count("id"))
        .values_list("worker", "state", "n")
    ):
        jobs_held.setdefault(worker_id, {})[job_state] = n
    sources = _encoder_sources(workers)
    out = []
    for w in workers:
        load = float(w.resident_load or 0.0)
        out.append(
            {
                "id": w.pk,
                "name": w.name,
                "status": w.status,
                "gpu_type": w.gpu_type,
                "region": w.region.name if w.region else Region.DEFAULT_NAME,
                "device": w.device,
                "host": w.host,
                "capacity": w.capacity,
                # Stages it hosts (docs/stages.md); an E worker's encoder load, a C worker's decoder
                # load, from its heartbeat.
                "stage_role": w.stage_role,
                "encoder": (w.telemetry or {}).get("encoder") if w.stage_role == "E" else None,
                "decoder": (w.telemetry or {}).get("decoder") if w.stage_role == "C" else None,
                # A worker without E: the encoder it uses, what it waits for, its last failover.
                "encoder_source": sources.get(w.pk),
                "sessions": w.resident,
                "parked": parked.get(w.pk, 0),
                "jobs": {
                    "running": jobs_held.get(w.pk, {}).get(Job.State.RUNNING, 0),
                    "paused": jobs_held.get(w.pk, {}).get(Job.State.PAUSED, 0),
                },
                "load": round(load, 3),
                "load_ratio": round(load / w.capacity, 3) if w.capacity else None,
                "utilization_pct": w.utilization_pct,
                "memory_used_bytes": w.memory_used_bytes,
                "memory_bytes": w.memory_bytes or None,
                "power_watts": w.power_watts,
                "temperature_c": w.temperature_c,
                "price_per_hour": float(w.price_per_hour),
                "last_heartbeat": _iso(w.last_heartbeat),
                "telemetry_at": _iso(w.telemetry_at),
                "requested_at": _iso(w.requested_at),
                # Scale-out phases (docs/scaleout.md): seconds from the request to each one.
                "phases": _phases(w),
                "weights_source": w.weights_source or None,
                "weights_source_detail": w.weights_source_detail or None,
                "expected_ready_at": _iso(w.expected_ready_at),
            }
        )
    return out


def _since(start, moment) -> float | None:
    return round((moment - start).total_seconds(), 3) if moment and start else None


def _phases(w: GpuWorker) -> dict[str, float | None]:
    return {
        "process_up_s": _since(w.requested_at, w.process_up_at),
        "weights_complete_s": _since(w.requested_at, w.weights_complete_at),
        "ready_s": _since(w.requested_at, w.ready_at),
        "expected_ready_s": _since(w.requested_at, w.expected_ready_at),
    }


def _scaling_detail(s: ScalingAction) -> str:
    detail = f"reason: {s.reason}" + (f", GPU type {s.gpu_type}" if s.gpu_type else "")
    chains = (s.plan or {}).get("chains") or []
    if chains:
        detail += "; plan: " + ", ".join(" → ".join([c["source"], *c["targets"]]) for c in chains)
    if s.expected_ready_at:
        detail += f"; expected ready in {_since(s.created_at, s.expected_ready_at):.1f} s"
    if s.ready_at:
        detail += f"; all ready in {_since(s.created_at, s.ready_at):.1f} s"
    sources = sorted({p.get("source") for p in (s.phases or {}).values() if p.get("source")})
    if sources:
        detail += f"; weights from {', '.join(sources)}"
    return detail


def _latency(now, slo_ms: float) -> dict[str, Any]:
    figures = ChunkRecord.objects.filter(created_at__gte=now - LATENCY_WINDOW, created_at__lte=now).aggregate(
        count=Count("id"),
        worst_ms=Max("generation_ms"),
        p99_ms=PercentileCont("generation_ms", 0.99),
        slo_passed=Count("id", filter=Q(generation_ms__lte=slo_ms)),
    )
    return {
        "window_s": LATENCY_WINDOW.total_seconds(),
        "count": figures["count"],
        "worst_ms": figures["worst_ms"],
        "p99_ms": figures["p99_ms"],
        "slo_ms": slo_ms,
        "slo_pass_rate": (figures["slo_passed"] / figures["count"]) if figures["count"] else None,
    }


# Lists in a decision's ``outputs`` that name actions it took, with how the timeline words them.
DECISION_ACTIONS = (
    ("assign", "placed"),
    ("migrations", "migrated"),
    ("suspend", "suspended"),
    ("queue", "queued"),
    ("drain", "drained"),
    ("undrain", "undrained"),
    ("release", "released"),
    ("add_gpus", "GPUs requested"),
)
# Periodic ticks run every few seconds; those that changed nothing would bury everything else.
DECISIONS_SCANNED = 300


def _decision_actions(decision: SchedulerDecision) -> list[str]:
    outputs = decision.outputs if isinstance(decision.outputs, dict) else {}
    return [f"{len(outputs[key])} {words}" for key, words in DECISION_ACTIONS if outputs.get(key)]


def _decision_item(d: SchedulerDecision) -> dict[str, Any] | None:
    actions = _decision_actions(d)
    if d.trigger == SchedulerDecision.Trigger.TICK and not actions and d.budget == d.target_budget:
        return None
    event = d.inputs.get("event") if isinstance(d.inputs, dict) else None
    cause = d.trigger.replace("_", " ")
    if isinstance(event, dict) and event.get("session"):
        cause += f", session {str(event['session'])[:8]}"
    signals = [f"budget {d.budget} → target {d.target_budget}", f"{d.active_sessions} active"]
    if d.rho_max is not None:
        signals.append(f"ρmax {d.rho_max:.2f}")
    if d.rho_hat is not None:
        signals.append(f"ρ̂ {d.rho_hat:.2f}")
    spares = d.inputs.get("spares") if isinstance(d.inputs, dict) else None
    if isinstance(spares, dict) and spares.get("target") is not None:
        signals.append(f"spare target {spares['target']:.1f} ({spares.get('policy')}: {spares.get('why')})")
    signals.append(f"{d.duration_ms:.1f} ms")
    return {
        "kind": "decision",
        "at": d.decided_at,
        "title": f"Decision ({cause}): " + (", ".join(actions) if actions else "no change"),
        "detail": ", ".join(signals),
    }


def _timeline(limit: int = TIMELINE_LENGTH) -> list[dict[str, Any]]:
    items: list[dict[str, Any]] = []
    decisions = 0
    for d in SchedulerDecision.objects.order_by("-decided_at", "-id")[:DECISIONS_SCANNED]:
        item = _decision_item(d)
        if item is not None:
            items.append(item)
            decisions += 1
            if decisions >= limit:
                break
    for m in Migration.objects.select_related("source", "target").order_by("-started_at", "-id")[:limit]:
        items.append(
            {
                "kind": "migration",
                "at": m.started_at,
                "title": f"Migration {m.source.name} → {m.target.name} ({m.outcome})",
                "detail": f"session {str(m.session_id)[:8]}, reason: {m.reason}"
                + (f", {m.duration_ms:.0f} ms" if m.duration_ms is not None else "")
                + (f", error: {m.error}" if m.error else ""),
            }
        )
    for s in ScalingAction.objects.order_by("-created_at", "-id")[:limit]:
        items.append(
            {
                "kind": "scaling",
                "at": s.created_at,
                "title": f"{s.get_direction_display().capitalize()} {s.from_budget} → {s.to_budget} ({s.outcome})",
                "detail": _scaling_detail(s),
            }
        )
    for p in StagePlacement.objects.prefetch_related("changes__worker").order_by("-created_at", "-id")[
        :limit
    ]:
        items.append(_placement_item(p))
    audited = ContentType.objects.get_for_models(GpuWorker, GenerationSession, SchedulerConfig).values()
    for entry in (
        LogEntry.objects.filter(content_type__in=list(audited))
        .select_related("user", "content_type")
        .order_by("-action_time")[:limit]
    ):
        items.append(
            {
                "kind": "operator",
                "at": entry.action_time,
                "title": f"{entry.user.get_username()}: {entry.get_change_message()}",
                "detail": f"{entry.content_type.name if entry.content_type else 'object'} {entry.object_repr}",
            }
        )
    items.sort(key=lambda item: item["at"], reverse=True)
    return [{**item, "at": _iso(item["at"])} for item in items[:limit]]


def _placement_item(p: StagePlacement) -> dict[str, Any]:
    """A stage placement as the timeline words it, like a scaling action: what changed, its outcome,
    and the trigger's figures that made it."""
    changes = sorted(p.changes.all(), key=lambda c: c.order)
    done = sum(1 for c in changes if c.status == StageRoleChange.Status.APPLIED)
    words = "Stage placement" if p.reason == StagePlacement.Reason.BOOTSTRAP else "Stage re-placement"
    moves = ", ".join(
        f"{c.worker.name} {c.from_role}→{c.to_role} ({c.status}{': ' + c.reason if c.reason else ''})"
        for c in changes
    )
    figures = p.trigger if isinstance(p.trigger, dict) else {}
    rates = figures.get("throughputs_per_s") or {}
    detail = f"reason: {p.get_reason_display()}; {moves}"
    if rates:
        detail += "; ops/s " + " ".join(f"{k} {v:.2f}" for k, v in sorted(rates.items()))
    if figures.get("backlog") is not None:
        detail += f"; backlog {figures['backlog']}"
    return {
        "kind": "placement",
        "at": p.created_at,
        "title": f"{words} of {p.preset}: {done}/{len(changes)} workers changed role ({p.status})",
        "detail": detail,
    }


def _sessions(limit: int = SESSION_LIST_LENGTH) -> list[dict[str, Any]]:
    rows = (
        sessions_with_idle_reason(GenerationSession.objects.exclude(status=Status.TERMINATED))
        .select_related("owner", "worker", "host_worker", "region", "tenant")
        .order_by("-created_at")[:limit]
    )
    return [
        {
            "id": str(s.id),
            "owner": s.owner.get_username(),
            "tenant": s.tenant.name if s.tenant else Tenant.DEFAULT_NAME,
            "model": s.model_name,
            "resolution": s.resolution,
            "status": s.status,
            "activity": s.activity,
            # "no_viewers": idle because nobody watched it (sessions.viewers); a viewer resumes it.
            "idle_reason": s.idle_reason if s.activity == GenerationSession.Activity.IDLE else None,
            "worker": s.worker.name if s.worker else None,
            "host_worker": s.host_worker.name if s.host_worker else None,
            "origin": s.origin,
            "region": s.region.name if s.region else None,
            "queue_position": s.queue_position,
            "chunks_generated": s.chunks_generated,
            "load": s.load,
            "created_at": _iso(s.created_at),
        }
        for s in rows
    ]


def _jobs(now, limit: int = SESSION_LIST_LENGTH) -> dict[str, Any]:
    """One-shot jobs: how many in each state (the ended ones over the last hour), and those in flight
    with their place in line, step and worker."""
    counts = dict(
        Job.objects.filter(Q(state__in=Job.IN_FLIGHT) | Q(finished_at__gte=now - RECENT_JOBS))
        .values("state")
        .annotate(n=Count("id"))
        .values_list("state", "n")
    )
    positions = job_queue_positions(list(settings.STREAMSERVE["SERVED_MODELS"]))
    rows = (
        Job.objects.filter(state__in=Job.IN_FLIGHT)
        .select_related("owner", "worker")
        .order_by("-priority", "deadline", "submitted_at")[:limit]
    )
    return {
        "by_state": {state: counts.get(state, 0) for state in Job.State.values},
        "list": [
            {
                "id": str(j.pk),
                "owner": j.owner.get_username(),
                "kind": j.kind,
                "model": j.model_name,
                "resolution": j.resolution,
                "frames": j.frames,
                "state": j.state,
                "position": positions.get(j.pk),
                "steps_done": j.steps_done,
                "steps": j.steps,
                "worker": j.worker.name if j.worker else None,
                "priority": j.priority,
                "deadline": _iso(j.deadline),
            }
            for j in rows
        ],
    }


MOVES_WINDOW = timedelta(hours=1)


# The console's tenant usage window: recent enough to be live, short enough for a cheap scan (BRIN).
TENANT_USAGE_WINDOW = timedelta(minutes=5)


def _tenants(now) -> list[dict[str, Any]]:
    """Each tenant (docs/tenants.md): weight, open and waiting sessions, queued jobs, GPU-seconds
    charged over the last five minutes and its share of them against its weight's share."""
    open_sessions = Counter()
    waiting = Counter()
    for tenant_name, status, n in (
        GenerationSession.objects.exclude(status=Status.TERMINATED)
        .order_by()
        .values_list("tenant__name", "status")
        .annotate(n=Count("pk"))
    ):
        name = tenant_name or Tenant.DEFAULT_NAME
        open_sessions[name] += n
        if status == Status.QUEUED:
            waiting[name] += n
    jobs = Counter()
    for name, n in (
        Job.objects.filter(state=Job.State.QUEUED)
        .order_by()
        .values_list("tenant__name")
        .annotate(n=Count("pk"))
    ):
        jobs[name or Tenant.DEFAULT_NAME] += n
    used = tenants_gpu_seconds(since=now - TENANT_USAGE_WINDOW, until=now)
    rows = {t.name: t for t in Tenant.objects.all()}
    names = sorted(set(rows) | set(open_sessions) | set(used))
    total_used = sum(used.values())
    total_weight = sum(rows[n].weight if n in rows else 1.0 for n in names)
    return [
        {
            "name": name,
            "weight": rows[name].weight if name in rows else 1.0,
            "weight_share": round((rows[name].weight if name in rows else 1.0) / total_weight, 4),
            "sessions": open_sessions[name],
            "queued": waiting[name],
            "jobs_queued": jobs[name],
            "gpu_seconds_5m": round(used.get(name, 0.0), 3),
            "share_5m": round(used.get(name, 0.0) / total_used, 4) if total_used else None,
        }
        for name in names
    ]


def _regions(live: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per region: its live GPUs by type against its limits, ready slots, load on them, live
    sessions routed there, the cost rate of its live workers, and its cross-region moves of running
    sessions started over the last hour (``region_moves_audit``: out, in, and the rule's estimated
    saving against the switching cost of the moves out). Regions with a row are listed; the local
    region (no row needed) also when it holds a worker, a session or a move."""
    rows = {r.name: r for r in Region.objects.all()}
    now = timezone.now()
    moves = region_moves_audit(time_range=TimeRange(start=now - MOVES_WINDOW, end=now, bucket="hour"))
    moved = moves["totals"]["by_region"]
    sessions = dict(
        GenerationSession.objects.exclude(status=Status.TERMINATED)
        .values(region_label=pool_selectors.region_name())
        .annotate(n=Count("id"))
        .values_list("region_label", "n")
    )
    out = []
    for name in sorted(set(rows) | {w["region"] for w in live} | set(sessions) | set(moved)):
        mine = [w for w in live if w["region"] == name]
        region = rows.get(name)
        figures = moved.get(name, {})
        out.append(
            {
                "name": name,
                "price_multiplier": region.price_multiplier if region else 1.0,
                "gpus": len(mine),
                "gpus_by_type": dict(Counter(w["gpu_type"] for w in mine)),
                "gpu_limits": region.gpu_limits if region else {},
                "slots": sum(w["capacity"] for w in mine if w["status"] == GpuWorker.Status.READY),
                "load": round(sum(w["load"] for w in mine), 3),
                "sessions": sessions.get(name, 0),
                "cost_rate_per_hour": float(
                    sum((Decimal(str(w["price_per_hour"])) for w in mine), Decimal(0))
                ),
                "moves_out": figures.get("moves_out", 0),
                "moves_in": figures.get("moves_in", 0),
                "move_saving_ms": round(figures.get("estimated_saving_ms", 0.0), 1),
                "move_switch_cost_ms": round(figures.get("switch_cost_ms", 0.0), 1),
            }
        )
    return out


def _parameter_pool() -> dict[str, Any]:
    """Where each model's weights live (BlitzScale §5.3) and the host caches holding them."""
    models = pool_selectors.parameter_pool()
    for model in models:
        for copy in model["copies"]:
            copy["last_used_at"] = _iso(copy["last_used_at"])
    caches = [
        {
            "name": c.name,
            "host": c.host,
            "status": c.status,
            "capacity_bytes": c.capacity_bytes,
            "used_bytes": c.used or 0,
            "pinned": c.pinned,
            "last_heartbeat": _iso(c.last_heartbeat),
        }
        for c in HostCache.objects.filter(status=HostCache.Status.LIVE).annotate(
            used=Sum("holdings__weights_bytes")
        )
    ]
    return {
        "models": models,
        "host_caches": caches,
        "host_copies_bound": settings.STREAMSERVE["POOL_HOST_COPIES"],
    }


def cluster_snapshot(*, now=None, include_timeline: bool = True) -> dict[str, Any]:
    """Everything the console shows at one instant, as JSON-ready values."""
    now = now or timezone.now()
    config = SchedulerConfig.load()
    workers = _workers(now)
    live = [w for w in workers if w["status"] in GpuWorker.LIVE_STATUSES]
    counts = dict(
        GenerationSession.objects.exclude(status=Status.TERMINATED)
        .values("status")
        .annotate(n=Count("id"))
        .values_list("status", "n")
    )
    latest = (
        SchedulerDecision.objects.order_by("-decided_at", "-id").only("target_budget", "decided_at").first()
    )
    cost_rate = sum((Decimal(str(w["price_per_hour"])) for w in live), Decimal(0))
    snapshot: dict[str, Any] = {
        "at": _iso(now),
        "workers": workers,
        "sessions": {
            # "active" on the console means holding a GPU slot: executing, or mid-migration.
            "active": counts.get(Status.EXECUTING, 0) + counts.get(Status.MIGRATING, 0),
            "executing": counts.get(Status.EXECUTING, 0),
            "migrating": counts.get(Status.MIGRATING, 0),
            "suspended": counts.get(Status.SUSPENDED, 0),
            "queued": counts.get(Status.QUEUED, 0),
        },
        "budget": {
            "live": len(live),
            "by_status": {s: sum(1 for w in live if w["status"] == s) for s in GpuWorker.LIVE_STATUSES},
            "target": latest.target_budget if latest else None,
            "target_at": _iso(latest.decided_at) if latest else None,
            "min_gpus": config.min_gpus,
            "max_gpus": config.max_gpus,
        },
        "capacity": {
            "slots": sum(w["capacity"] for w in live if w["status"] == GpuWorker.Status.READY),
            "load": round(sum(w["load"] for w in live), 3),
        },
        "latency": _latency(now, config.slo_ms),
        "cost_rate_per_hour": float(cost_rate),
        "config": {
            "policy": config.policy,
            "min_gpus": config.min_gpus,
            "max_gpus": config.max_gpus,
            "target_utilization": config.target_utilization,
            "slo_ms": config.slo_ms,
            "queue_max": config.queue_max,
            "updated_at": _iso(config.updated_at),
        },
        "session_list": _sessions(),
        "jobs": _jobs(now),
        "regions": _regions(live),
        "tenants": _tenants(now),
        "origins": origin_demand(),
        "parameter_pool": _parameter_pool(),
    }
    if include_timeline:
        snapshot["timeline"] = _timeline()
    return snapshot


def snapshot_cache_key() -> str:
    # Keyed by database too: a development server and a test run on one machine share Redis.
    return f"console:snapshot:{connection.settings_dict['NAME']}"


def shared_snapshot(*, max_age_s: float, fresh: bool = False) -> dict[str, Any]:
    """A snapshot at most ``max_age_s`` old (≥ 1 s granularity), computed once for all consoles.

    ``fresh`` (after an operator's action) computes a new one and shares it, so the next periodic
    pushes do not show the cluster as it was before the action.
    """
    key = snapshot_cache_key()
    snapshot = None if fresh else cache.get(key)
    if snapshot is None:
        snapshot = cluster_snapshot()
        cache.set(key, snapshot, timeout=max(1, round(max_age_s)))
    return snapshot


# --- Actions ---------------------------------------------------------------------------------


def _log(*, user, obj, message: str) -> LogEntry:
    return LogEntry.objects.create(
        user=user,
        content_type=ContentType.objects.get_for_model(obj, for_concrete_model=False),
        object_id=str(obj.pk),
        object_repr=str(obj)[:200],
        action_flag=CHANGE,
        change_message=message,
    )


@transaction.atomic
def console_worker_drain(*, user, worker: GpuWorker) -> GpuWorker:
    """Drain a worker on an operator's request. Raises ``gpu.services.TransitionError`` if not ready."""
    before = worker.status
    worker = gpu_services.worker_drain(worker=worker)
    if before != worker.status:
        _log(user=user, obj=worker, message=f"Drained from the console ({before} → {worker.status}).")
    return worker


@transaction.atomic
def console_session_terminate(*, user, session: GenerationSession) -> GenerationSession:
    """Terminate a session on an operator's request (its depart event names the operator)."""
    before = session.status
    session = session_services.session_terminate(session=session, reason=f"operator:{user.get_username()}")
    if before != session.status:
        _log(user=user, obj=session, message=f"Terminated from the console (was {before}).")
    return session


CONFIG_FIELDS = ("min_gpus", "max_gpus", "target_utilization")


@transaction.atomic
def console_config_update(*, user, changes: dict[str, Any]) -> SchedulerConfig:
    """Set autoscaler bounds and target utilisation; validation is the REST serializer's.

    Raises ``django.core.exceptions.ValidationError`` with per-field messages on bad input.
    """
    unknown = sorted(set(changes) - set(CONFIG_FIELDS))
    if unknown:
        raise ValidationError({name: "cannot be changed from the console" for name in unknown})
    config = SchedulerConfig.objects.select_for_update().get(pk=SchedulerConfig.load().pk)
    before = {name: getattr(config, name) for name in CONFIG_FIELDS}
    serializer = SchedulerConfigSerializer(config, data=changes, partial=True)
    if not serializer.is_valid():
        raise ValidationError(
            {field: [str(e) for e in errors] for field, errors in serializer.errors.items()}
        )
    config = serializer.save()
    diff = [
        f"{name} {before[name]!r} → {getattr(config, name)!r}"
        for name in CONFIG_FIELDS
        if before[name] != getattr(config, name)
    ]
    if diff:
        _log(user=user, obj=config, message="Scheduler config from the console: " + ", ".join(diff) + ".")
    return config
