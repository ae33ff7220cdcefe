"""One closed-loop decision on live state: snapshot from PostgreSQL → ``scheduling.core`` → apply.

``scheduler_run`` is what the Celery tasks call, one run at a time cluster-wide (a Redis lock). It
builds the same ``Snapshot`` the simulator builds, splits it by region
(``scheduling.core.regions.partition``: one region, the local one, when no regions are configured),
asks each region's policy object (its internal state persisted between runs), records each region's
decision with its inputs, applies it (``apply``) in the same transaction, and sends the commands
after commit (``outbox``).
"""

from __future__ import annotations

import logging
import time
from dataclasses import replace
from typing import Any

from django.conf import settings
from django.db import transaction
from django.db.models import Max
from django.utils import timezone

from gpu.models import GpuWorker, Region
from scheduling.core.jobs.backlog import backlog_gpus
from scheduling.core.policy import make_policy
from scheduling.core.regions.partition import decide_by_region, partition_snapshot, regions_to_zero
from scheduling.core.turboserve import TurboServePolicy
from scheduling.core.types import (
    POLICY_EVENT_KINDS,
    Decision,
    Event,
    EventKind,
    GpuTypeSpec,
    GpuView,
    SessionView,
    Snapshot,
)
from scheduling.live.apply import Pool, decision_apply
from scheduling.live.jobs import JobBacklog, jobs_backlog
from scheduling.live.liveness import sessions_recover
from scheduling.live.outbox import Outbox, scheduler_lock
from scheduling.live.regions import (
    RegionLayout,
    region_floor_load,
    region_idle_forecast,
    region_layout,
    sessions_reroute,
)
from scheduling.live.stages.encoders import encoder_failover
from scheduling.live.stages.placement import stage_placement_step
from scheduling.live.worker_profiles import default_gpu_type, gpu_profiles
from scheduling.models import SchedulerConfig, SchedulerDecision, SchedulerState, WorkerCommand
from sessions.models import GenerationSession

logger = logging.getLogger("scheduling.live")

Status = GenerationSession.Status


def scheduler_run(*, trigger: str, session_id: str | None = None, was_active: bool = False) -> list[int]:
    """One closed-loop decision per served model pool; returns the ids of the decisions recorded."""
    trigger = EventKind(trigger)
    with scheduler_lock():
        decisions = []
        for preset in settings.STREAMSERVE["SERVED_MODELS"]:
            decisions += _run_pool(
                preset=preset, trigger=trigger, session_id=session_id, was_active=was_active
            )
        return decisions


def _session_view(
    session: GenerationSession, spec: GpuTypeSpec, now: float, placed_at: dict, gpu_names: dict[int, str]
) -> SessionView:
    """``since`` is when the session entered its current state: its last placement on a GPU (which
    the policy's minimum-residency rule reads) or, waiting, its activation (queue order).
    ``gpu_names``: the pool's workers by primary key, the only GPUs the snapshot knows."""
    gpu = gpu_names.get(session.worker_id) if session.worker_id is not None else None
    if session.status in (Status.EXECUTING, Status.MIGRATING) and gpu is not None:
        state = "executing"
        entered = placed_at.get(session.pk) or session.last_active_at or session.created_at
    elif session.status == Status.SUSPENDED:
        state, gpu = "suspended", None
        entered = session.last_active_at or session.created_at
    else:
        if session.status in (Status.EXECUTING, Status.MIGRATING):
            # Placed on a live worker of another pool (``_orphans_recover`` handled ended ones): the
            # policy cannot act on that GPU, so it sees the session as waiting; the lifecycle's
            # compare-and-set keeps any placement it proposes from applying.
            logger.error(
                "scheduler.orphan session=%s status=%s worker_id=%s is not in pool",
                session.pk,
                session.status,
                session.worker_id,
            )
        state, gpu = "queued", None
        entered = session.last_active_at or session.created_at
    return SessionView(
        id=str(session.pk),
        alpha=int(session.activity == GenerationSession.Activity.ACTIVE),
        state=state,
        load=session.load,
        gpu=gpu,
        state_bytes=int(spec.state_bytes * session.load),
        since=min(entered.timestamp(), now),
    )


def _pool_locked(preset: str) -> Pool:
    # FOR NO KEY UPDATE: chunk-record inserts (FK checks take KEY SHARE) never wait on it.
    # Rows are locked in primary-key order, like every other multi-row locker, so no deadlock.
    workers = {
        w.name: w
        for w in GpuWorker.objects.select_for_update(no_key=True)
        .filter(model_preset=preset, status__in=GpuWorker.LIVE_STATUSES)
        .order_by("pk")
    }
    sessions = _sessions_locked(preset)
    if _orphans_recover(sessions, workers):
        sessions = _sessions_locked(preset)  # re-read the rows the recovery changed (locks are held)
    return Pool(preset=preset, workers=workers, sessions=sessions)


def _sessions_locked(preset: str) -> dict[str, GenerationSession]:
    # The workers are fetched by a second query, after the locks are granted, never joined into the
    # locking one: when a locked row was changed while we waited (a migration flipped ``worker`` to
    # its target), PostgreSQL re-checks the new row version against the *previously* joined worker
    # row (EvalPlanQual), the join no longer matches, and the outer join hands back NULL worker
    # columns: ``status=executing`` with ``worker=None`` (issue 17, defect 7).
    return {
        str(s.pk): s
        for s in GenerationSession.objects.select_for_update(no_key=True)
        .filter(model_name=preset)
        .exclude(status=Status.TERMINATED)
        .order_by("pk")
        .prefetch_related("worker", "host_worker")
    }


def _orphans_recover(sessions: dict[str, GenerationSession], workers: dict[str, GpuWorker]) -> bool:
    """Sessions still executing or migrating on a worker that has ended (failed or released
    before its sessions were recovered) continue elsewhere, as ``workers_check`` would do on its
    next tick; the run must not wait for it. Returns whether anything was recovered."""
    in_pool = {w.pk for w in workers.values()}
    ended = {
        s.worker_id: s.worker
        for s in sessions.values()
        if s.status in (Status.EXECUTING, Status.MIGRATING)
        and s.worker_id not in in_pool
        and s.worker is not None
        and not s.worker.is_live
    }
    recovered = 0
    for lost in ended.values():
        recovered += sessions_recover(worker=lost)
        logger.warning("scheduler.orphans_recovered worker=%s status=%s", lost.name, lost.status)
    return recovered > 0


def _snapshot(pool: Pool, config: SchedulerConfig, clock: float) -> Snapshot:
    profiles = gpu_profiles()
    spec = profiles[default_gpu_type()]
    placed_at = dict(
        WorkerCommand.objects.filter(
            session_id__in=[
                s.pk for s in pool.sessions.values() if s.status in (Status.EXECUTING, Status.MIGRATING)
            ],
            kind__in=["start", "resume", "activate"],
        )
        .values("session_id")
        .annotate(last=Max("created_at"))
        .values_list("session_id", "last")
    )
    # Workers without the diffusion model (stage roles E and C, docs/stages.md) hold no sessions:
    # the policy never sees them, so it neither places on them nor drains or releases them.
    serving = [w for w in pool.workers.values() if w.holds_sessions]
    gpu_names = {w.pk: w.name for w in serving}
    gpu_specs = {w.pk: profiles.get(w.gpu_type, spec) for w in serving}
    views = [
        _session_view(s, gpu_specs.get(s.worker_id, spec), clock, placed_at, gpu_names)
        for s in pool.sessions.values()
    ]
    return Snapshot.build(
        time=clock,
        sessions=views,
        gpus=[
            GpuView(
                id=w.name,
                gpu_type=w.gpu_type if w.gpu_type in profiles else default_gpu_type(),
                status=w.status,
                # A loading worker's ready time is the scale plan's estimate (as in the simulator).
                ready_at=(w.ready_at or w.expected_ready_at).timestamp()
                if (w.ready_at or w.expected_ready_at)
                else None,
                requested_at=w.requested_at.timestamp(),
            )
            for w in serving
        ],
        gpu_types=profiles,
        min_gpus=config.min_gpus,
        max_gpus=config.max_gpus,
    )


def _with_jobs(
    snapshots: dict[str, Snapshot], backlog: JobBacklog, gpu_region: dict[str, str], clock: float
) -> dict[str, Snapshot]:
    """Each region's snapshot gains its one-shot jobs, as the simulator's does: ``job_demand_gpus``
    = the backlog demand (``backlog_gpus``) of the jobs its workers hold — queued ones count in the
    local region — in GPUs of K slots (a live job takes one slot, not a GPU), and ``job_gpus`` = its
    workers holding running or paused jobs."""
    capacity = gpu_profiles()[default_gpu_type()].capacity
    by_region: dict[str, list[tuple[float, str, float]]] = {}
    for name, open_jobs in backlog.open_jobs.items():
        region = gpu_region.get(name, Region.DEFAULT_NAME) if name is not None else Region.DEFAULT_NAME
        by_region.setdefault(region, []).extend(open_jobs)
    return {
        region: replace(
            snap,
            job_demand_gpus=backlog_gpus(by_region.get(region, []), clock) / capacity,
            job_gpus=tuple(sorted(g for g in backlog.holders if g in snap.gpus)),
        )
        for region, snap in snapshots.items()
    }


def _state_key(policy: str, preset: str, region: str) -> str:
    """Where a region's policy state persists; the local region keeps the key it had before regions."""
    return f"{policy}@{preset}" if region == Region.DEFAULT_NAME else f"{policy}@{preset}@{region}"


def _event_region(snapshot: Snapshot, layout: RegionLayout, session_id: str | None) -> str | None:
    """The region whose policy observes the event: the one its session runs in, else its routed one
    (a departed session is no longer in the pool: its row says)."""
    if session_id is None:
        return None
    view = snapshot.sessions.get(session_id)
    if view is not None and view.state == "executing" and view.gpu is not None:
        return layout.gpu_region[view.gpu]
    if session_id in layout.session_region:
        return layout.session_region[session_id]
    name = GenerationSession.objects.filter(pk=session_id).values_list("region__name", flat=True).first()
    return name or Region.DEFAULT_NAME


def _run_pool(*, preset: str, trigger: EventKind, session_id: str | None, was_active: bool) -> list[int]:
    """One decision per region of the pool (``scheduling.core.regions.partition``): each region's
    TurboServe places on, rebalances over and scales its own workers; a session its region cannot
    place goes to the nearest region within its RTT budget that can. Returns the recorded decisions."""
    started = time.perf_counter()
    outbox = Outbox()
    recorded: list[int] = []
    with transaction.atomic():
        config = SchedulerConfig.load()
        now = timezone.now()
        clock = now.timestamp()
        pool = _pool_locked(preset)
        if session_id is not None and session_id not in pool.sessions and trigger != EventKind.DEPART:
            session_id = None
        snapshot = _snapshot(pool, config, clock)
        kind = trigger if trigger in POLICY_EVENT_KINDS else EventKind.TICK
        event = Event(time=clock, kind=kind, session=session_id, was_active=was_active)
        layout = region_layout(sessions=list(pool.sessions.values()), workers=list(pool.workers.values()))
        floors = region_floor_load() if settings.STREAMSERVE["REGION_FORECAST_FLOOR"] else None
        snapshots = partition_snapshot(
            snapshot,
            session_region=layout.session_region,
            gpu_region=layout.gpu_region,
            gpu_limits=layout.gpu_limits,
            default=Region.DEFAULT_NAME,
            # A region at zero decides (and its floor asks for GPUs) once its forecast load is coming.
            include=[r for r, f in (floors or {}).items() if f > 0 and r in layout.gpu_limits],
        )
        snapshots = _with_jobs(snapshots, jobs_backlog(preset), layout.gpu_region, clock)
        state_rows = {
            region: SchedulerState.objects.select_for_update(no_key=True).get_or_create(
                policy=_state_key(config.policy, preset, region)
            )[0]
            for region in sorted(snapshots)
        }
        options: dict[str, Any] = {"cooldown_s": config.scale_in_cooldown_s}
        if config.target_utilization is not None:
            options["rho_hat"] = config.target_utilization
        policies = {}
        for region, row in state_rows.items():
            policies[region] = make_policy(config.policy, **options)
            if row.state:
                policies[region].load_state_dict(row.state)
            if floors is not None and isinstance(policies[region], TurboServePolicy):
                # The predictive floor's input, set before each decision as the simulator's
                # ``turboserve-forecast`` does (not policy state: the forecast slot refreshes it).
                policies[region].floor_load = floors.get(region, 0.0)
        event_region = _event_region(snapshot, layout, session_id)
        decisions, rerouted = decide_by_region(
            policies, snapshots, event, event_region=event_region, alternatives=layout.alternatives
        )
        to_zero: dict[str, list[str]] = {}
        if len(snapshots) > 1:
            # An idle region with a forecast of none scales to zero (TurboServe keeps its last GPU).
            own = decisions
            decisions = regions_to_zero(
                snapshots,
                own,
                idle=region_idle_forecast(),
                minimum=settings.STREAMSERVE["REGION_MIN_GPUS"],
            )
            # The releases the to-zero rule added, so their scale-in says why (not "consolidated").
            to_zero = {
                r: sorted(set(d.release) - set(own[r].release))
                for r, d in decisions.items()
                if d is not own[r]
            }
        for region, row in state_rows.items():
            row.state = policies[region].state_dict()
            row.save(update_fields=["state", "updated_at"])
        sessions_reroute(sessions=pool.sessions, rerouted=rerouted, layout=layout)
        # Workers without E whose encoder was lost get another, and prompts they refused for lack of
        # one go again (docs/stages.md, "Encoders"); recorded in the first region's decision.
        encoders = encoder_failover(preset=preset, workers=pool.workers, now=now, outbox=outbox)
        for region, decision in sorted(decisions.items()):
            ours = region == event_region
            record_id = _record_and_apply(
                pool=Pool(
                    preset=preset,
                    workers={n: w for n, w in pool.workers.items() if layout.gpu_region[n] == region},
                    sessions=pool.sessions,
                    region=layout.row(region),
                ),
                region=region,
                snapshot=snapshots[region],
                decision=decision,
                event=event if ours else Event(time=clock, kind=EventKind.TICK),
                trigger=trigger,
                rerouted=sorted(sid for sid, to in rerouted.items() if to == region),
                config=config,
                outbox=outbox,
                started=started,
                floor_load=getattr(policies[region], "floor_load", None),
                released_to_zero=to_zero.get(region, []),
                extra_inputs=encoders,
            )
            encoders = {}
            if record_id is not None:
                recorded.append(record_id)
        # Stage roles (TridentServe; off unless STAGE_PLACEMENT says otherwise): after the sessions'
        # decisions, on the same locked rows; its set_role commands leave with theirs after commit.
        stage_placement_step(preset=preset, workers=pool.workers, now=now, outbox=outbox)
        transaction.on_commit(outbox.send)
    return recorded


def _record_and_apply(
    *,
    pool: Pool,
    region: str,
    snapshot: Snapshot,
    decision: Decision,
    event: Event,
    trigger: EventKind,
    rerouted: list[str],
    config: SchedulerConfig,
    outbox: Outbox,
    started: float,
    floor_load: float | None,
    released_to_zero: list[str] | None = None,
    extra_inputs: dict | None = None,
) -> int | None:
    """Record one region's decision with its inputs and apply it; a tick that changed nothing is
    not kept (returns ``None``). ``floor_load``: the predictive floor's input F (None: off);
    ``released_to_zero``: the GPUs the idle-region rule releases (``regions_to_zero``);
    ``extra_inputs``: what the run did besides the decision (encoder failover), kept with it."""
    now = timezone.now()
    record = SchedulerDecision.objects.create(
        trigger=trigger,
        session=pool.sessions.get(event.session) if event.session else None,
        decided_at=now,
        policy=config.policy,
        active_sessions=sum(v.alpha for v in snapshot.sessions.values()),
        budget=len(pool.workers),
        rho_max=decision.signals.rho_max,
        volatility=decision.signals.volatility,
        volatility_level=decision.signals.volatility_level,
        lambda_weight=decision.signals.lam,
        rho_hat=decision.signals.rho_hat,
        target_budget=decision.target_budget,
        duration_ms=0.0,
        inputs={
            "preset": pool.preset,
            "region": region,
            "event": {"kind": event.kind, "session": event.session},
            "sessions": len(snapshot.sessions),
            "pending": list(snapshot.pending),
            "rerouted_in": rerouted,
            "floor_load": floor_load,
            "released_to_zero": released_to_zero or [],
            "gpus": {g: {"status": v.status, "load": snapshot.gpu_load[g]} for g, v in snapshot.gpus.items()},
            **(extra_inputs or {}),
        },
        outputs=decision.to_json(),
    )
    commands_before = len(outbox.commands)
    applied = decision_apply(decision=decision, record=record, pool=pool, config=config, outbox=outbox)
    changed = applied.placements
    acted = changed or decision.add_gpus or decision.drain or decision.undrain or decision.release
    sent = len(outbox.commands) > commands_before
    if applied.waiting_for_encoder:
        record.inputs = {**record.inputs, "waiting_for_encoder": applied.waiting_for_encoder}
        record.save(update_fields=["inputs"])
        logger.warning(
            "scheduler.waiting_for_encoder preset=%s sessions=%s",
            pool.preset,
            sorted(applied.waiting_for_encoder),
        )
    if (
        event.kind == EventKind.TICK
        and not acted
        and not sent
        and not applied.queue
        and not rerouted
        and not extra_inputs
    ):
        # Periodic ticks that change nothing are not history: keep the table to real decisions.
        record.delete()
        return None
    record.placements_changed = changed
    record.duration_ms = (time.perf_counter() - started) * 1000.0
    record.save(update_fields=["placements_changed", "duration_ms"])
    logger.info(
        "scheduler.decision id=%s preset=%s region=%s trigger=%s sessions=%d gpus=%d target=%d changed=%d ms=%.2f",
        record.pk,
        pool.preset,
        region,
        trigger,
        len(snapshot.sessions),
        len(pool.workers),
        decision.target_budget,
        changed,
        record.duration_ms,
    )
    return record.pk
