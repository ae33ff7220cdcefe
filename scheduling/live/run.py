"""One closed-loop decision on live state: PostgreSQL and Redis → the decision pipeline → apply.

``scheduler_run`` is what the Celery tasks call, one run at a time cluster-wide (a Redis lock). Per
served model pool, in one transaction with the pool's rows locked, ``_run_pool``:

1. reads the pipeline's inputs (``_pipeline_inputs``): the pool's ``Snapshot`` (the one the
   simulator builds from its own state), the regions' layout, the jobs in flight, the predictive
   floor from the region forecast slot and, asked only with several regions, the idle regions;
2. runs the pipeline the simulator runs (``scheduling.core.pipeline.decision_run``: partition by
   region, job demand, floor, each region's policy — its state loaded from and saved to its
   ``SchedulerState`` row, ``_RegionPolicies`` —, spill to a near region, regions to zero);
3. applies its result: re-routed sessions (``regions.sessions_reroute``), encoder failover
   (``stages.encoders``), each region's decision recorded with its inputs and applied
   (``_record_and_apply``, ``apply``), then the stage placement (``stages.placement``); the commands
   go out after commit (``outbox``).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import replace
from typing import Any

from django.conf import settings
from django.db import transaction
from django.db.models import Max
from django.utils import timezone

from contracts import tracing
from gpu.models import GpuWorker, Region
from scheduling.core.pipeline import DecisionInputs, JobDemand, RegionDecision, decision_run
from scheduling.core.policy import Policy, make_policy
from scheduling.core.types import (
    POLICY_EVENT_KINDS,
    Event,
    EventKind,
    GpuTypeSpec,
    GpuView,
    SessionView,
    Snapshot,
)
from scheduling.live.apply import Pool, decision_apply
from scheduling.live.jobs import jobs_backlog
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
from scheduling.live.tenants import tenant_shares
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
            attributes = {
                "scheduler.trigger": str(trigger),
                "scheduler.preset": preset,
                "session.id": session_id,
            }
            with tracing.span(tracing.SCHEDULER_DECISION, attributes=attributes):
                recorded = _run_pool(
                    preset=preset, trigger=trigger, session_id=session_id, was_active=was_active
                )
                tracing.attributes_set({"scheduler.decision_ids": recorded})
            decisions += recorded
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
    snapshot = Snapshot.build(
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
    return replace(snapshot, scale_out_delay_s=_scale_out_delays(serving, profiles))


def _scale_out_delays(workers: Sequence[GpuWorker], profiles: dict[str, GpuTypeSpec]) -> dict[str, float]:
    """The delay the platform predicts for its next scale-out, by GPU type: that of its newest
    worker of the type, measured (ready − requested) once it is ready, else the scale plan's
    estimate it was given (``expected_ready_at``). Boot-aware spares read it (issue 27)."""
    newest: dict[str, GpuWorker] = {}
    for w in workers:
        # Keyed like the snapshot's GpuView: a type without a profile runs as the default type.
        gpu_type = w.gpu_type if w.gpu_type in profiles else default_gpu_type()
        if (w.ready_at or w.expected_ready_at) and (
            gpu_type not in newest or w.requested_at > newest[gpu_type].requested_at
        ):
            newest[gpu_type] = w
    return {
        gpu_type: max(0.0, ((w.ready_at or w.expected_ready_at) - w.requested_at).total_seconds())
        for gpu_type, w in newest.items()
    }


def _pipeline_inputs(
    pool: Pool, config: SchedulerConfig, event: Event, layout: RegionLayout
) -> DecisionInputs:
    """What the pool's decision run starts from, read from the rows and Redis."""
    return DecisionInputs(
        snapshot=_snapshot(pool, config, event.time),
        event=event,
        layout=layout,
        jobs=_job_demand(pool.preset),
        floor_load=region_floor_load() if settings.STREAMSERVE["REGION_FORECAST_FLOOR"] else None,
        idle_forecast=region_idle_forecast,
        region_minimum=settings.STREAMSERVE["REGION_MIN_GPUS"],
        tenants=tenant_shares(sessions=pool.sessions.values(), now=timezone.now()),
    )


def _layout(pool: Pool, session_id: str | None) -> RegionLayout:
    """The regions of the pool's workers and sessions; a departed session, no longer in the pool,
    keeps the region its row names, where its policy observes the departure."""
    layout = region_layout(sessions=list(pool.sessions.values()), workers=list(pool.workers.values()))
    if session_id is None or session_id in layout.session_region:
        return layout
    name = GenerationSession.objects.filter(pk=session_id).values_list("region__name", flat=True).first()
    return replace(layout, session_region={**layout.session_region, session_id: name or Region.DEFAULT_NAME})


def _job_demand(preset: str) -> JobDemand:
    """The pool's jobs in flight (``jobs_backlog``); a live job takes one of a GPU's K slots."""
    backlog = jobs_backlog(preset)
    return JobDemand(
        open_jobs=backlog.open_jobs,
        holders=backlog.holders,
        slots_per_gpu=gpu_profiles()[default_gpu_type()].capacity,
    )


class _RegionPolicies:
    """The pipeline's policy provider on live state: each region's policy object, its internal state
    (detector windows, cooldowns) loaded from and saved to a ``SchedulerState`` row between runs."""

    def __init__(self, config: SchedulerConfig, preset: str):
        self.config = config
        self.preset = preset
        self.rows: dict[str, SchedulerState] = {}
        self.policies: dict[str, Policy] = {}

    def __call__(self, regions: Sequence[str]) -> dict[str, Policy]:
        options: dict[str, Any] = {"cooldown_s": self.config.scale_in_cooldown_s}
        if settings.STREAMSERVE["SPARE_POLICY"] != "off":
            # Only when on: a policy by dotted path need not know the spare options.
            options["spares"] = settings.STREAMSERVE["SPARE_POLICY"]
            options["spare_margin_z"] = settings.STREAMSERVE["SPARE_MARGIN_Z"]
            options["spare_min"] = settings.STREAMSERVE["SPARE_MIN_SESSIONS"]
        if self.config.target_utilization is not None:
            options["rho_hat"] = self.config.target_utilization
        for region in sorted(regions):  # rows locked in one order, like every multi-row locker
            self.rows[region] = SchedulerState.objects.select_for_update(no_key=True).get_or_create(
                policy=_state_key(self.config.policy, self.preset, region)
            )[0]
        for region, row in self.rows.items():
            self.policies[region] = make_policy(self.config.policy, **options)
            if row.state:
                self.policies[region].load_state_dict(row.state)
        return self.policies

    def save(self) -> None:
        for region, row in self.rows.items():
            row.state = self.policies[region].state_dict()
            row.save(update_fields=["state", "updated_at"])


def _state_key(policy: str, preset: str, region: str) -> str:
    """Where a region's policy state persists; the local region keeps the key it had before regions."""
    return f"{policy}@{preset}" if region == Region.DEFAULT_NAME else f"{policy}@{preset}@{region}"


def _run_pool(*, preset: str, trigger: EventKind, session_id: str | None, was_active: bool) -> list[int]:
    """One decision run of the pool (the module docstring's three steps): one decision per region,
    each region's TurboServe placing on, rebalancing over and scaling its own workers. Returns the
    recorded decisions."""
    started = time.perf_counter()
    outbox = Outbox()
    recorded: list[int] = []
    with transaction.atomic():
        config = SchedulerConfig.load()
        now = timezone.now()
        pool = _pool_locked(preset)
        if session_id is not None and session_id not in pool.sessions and trigger != EventKind.DEPART:
            session_id = None
        kind = trigger if trigger in POLICY_EVENT_KINDS else EventKind.TICK
        event = Event(time=now.timestamp(), kind=kind, session=session_id, was_active=was_active)
        layout = _layout(pool, session_id)
        policies = _RegionPolicies(config, preset)
        run = decision_run(_pipeline_inputs(pool, config, event, layout), policies)
        policies.save()
        sessions_reroute(sessions=pool.sessions, rerouted=dict(run.rerouted), layout=layout)
        # Workers without E whose encoder was lost get another, and prompts they refused for lack of
        # one go again (docs/stages.md, "Encoders"); recorded in the first region's decision.
        encoders = encoder_failover(preset=preset, workers=pool.workers, now=now, outbox=outbox)
        for region, part in run.regions.items():
            record_id = _record_and_apply(
                pool=Pool(
                    preset=preset,
                    workers={n: w for n, w in pool.workers.items() if layout.gpu_region[n] == region},
                    sessions=pool.sessions,
                    region=layout.row(region),
                ),
                region=region,
                part=part,
                trigger=trigger,
                config=config,
                outbox=outbox,
                started=started,
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
    part: RegionDecision,
    trigger: EventKind,
    config: SchedulerConfig,
    outbox: Outbox,
    started: float,
    extra_inputs: dict | None = None,
) -> int | None:
    """Record one region's part of the run with its inputs — among them the predictive floor's F
    (``floor_load``, None: off), the sessions re-routed into it and the GPUs the idle-region rule
    releases (``released_to_zero``) — and apply its decision; a tick that changed nothing is not kept
    (returns ``None``). ``extra_inputs``: what the run did besides the decision (encoder failover),
    kept with it."""
    snapshot, decision, event = part.snapshot, part.decision, part.event
    rerouted = list(part.rerouted_in)
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
            "floor_load": snapshot.floor_load,
            # The spare rule's inputs, target and why (issue 27; None: the policy has no headroom).
            "spares": decision.signals.spares.to_json() if decision.signals.spares is not None else None,
            "released_to_zero": list(part.released_to_zero),
            "gpus": {g: {"status": v.status, "load": snapshot.gpu_load[g]} for g, v in snapshot.gpus.items()},
            **(extra_inputs or {}),
        },
        outputs=decision.to_json(),
    )
    commands_before = len(outbox.commands)
    applied = decision_apply(decision=decision, record=record, pool=pool, config=config, outbox=outbox)
    # The decision's inputs and outcome on its trace (one event per region: a run may decide several).
    tracing.event_add(
        "scheduler.region_decision",
        {
            "region": region,
            "decision.id": record.pk,
            "inputs.sessions": len(snapshot.sessions),
            "inputs.active_sessions": record.active_sessions,
            "inputs.gpus": len(pool.workers),
            "inputs.rho_max": decision.signals.rho_max,
            "outcome.target_budget": decision.target_budget,
            "outcome.placements_changed": applied.placements,
            "outcome.add_gpus": decision.add_gpus,
            "outcome.drain": list(decision.drain),
            "outcome.release": list(decision.release),
            "outcome.commands": len(outbox.commands) - commands_before,
        },
    )
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
