"""Running sessions move across regions when the saving beats the switching cost (docs/regions.md,
"Running sessions move when it pays").

Once a slot (beat task "region forecast", after the parked moves), ``running_sessions_move`` reads
the regions' ready capacity and load from PostgreSQL and the routing plan stored by this slot, asks
``scheduling.core.regions.moves.running_moves`` — the rule the simulator's TORTA uses — which
executing sessions move, and starts each move as an ordinary live migration (``migration_start``:
``migrate_out`` on the source worker, ``migrate_in`` on a ready worker of the target region, the
state over torch.distributed between them; ownership flips when the target reports). The
``Migration`` row carries both regions and the rule's estimate (saving and switching cost, ms);
the session's ``region`` becomes the target's at once, so the scheduler's next run counts it there.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, replace

import numpy as np
from django.conf import settings
from django.db import transaction
from django.utils import timezone

from gpu.models import GpuWorker, Region
from scheduling.core.regions.moves import (
    MoveSettings,
    PastMove,
    RegionMove,
    RegionNow,
    RunningSession,
    running_moves,
)
from scheduling.core.regions.transport import CostWeights
from scheduling.live.moves import migration_start
from scheduling.live.outbox import Outbox, redis_client, scheduler_lock
from scheduling.live.regions import PLAN_KEY, ParkedMove, parked_sessions_reroute
from scheduling.live.worker_profiles import default_gpu_type, profile_for
from scheduling.models import Migration
from sessions.models import GenerationSession

log = logging.getLogger(__name__)

Status = GenerationSession.Status
MOVE_REASON = "cross-region"
_DEFAULT_USD_PER_SESSION_H = 1.0  # as the router's price scale when no live worker has a price


@dataclass(frozen=True)
class StartedMove:
    move: RegionMove
    migration: int
    source_worker: str
    target_worker: str


def move_settings() -> MoveSettings:
    """The rule's settings from ``STREAMSERVE`` and the default GPU profile (chunk compute at K; a
    chunk is due every ``SLO_MS``, as one a second of video in the simulator)."""
    config = settings.STREAMSERVE
    spec = profile_for(default_gpu_type())
    pairs = {tuple(key.split(":")): float(gbps) for key, gbps in config["REGION_WAN_GBPS_PAIRS"].items()}
    return MoveSettings(
        rtt_budget_ms=config["REGION_RTT_BUDGET_MS"],
        chunk_ms=spec.latency_ms(spec.capacity),
        chunk_period_s=config["SLO_MS"] / 1000.0,
        horizon_s=config["REGION_MOVE_HORIZON_S"],
        limit=config["REGION_MOVES_PER_SLOT"],
        wan_gbps=config["REGION_WAN_GBPS"],
        wan_gbps_pairs=pairs,
        cooldown_s=config["REGION_MOVE_COOLDOWN_S"],
    )


def _stored_plan(names: list[str]) -> tuple[list[str], np.ndarray] | None:
    """The plan this slot stored (``region_plan``), when it is for these regions."""
    raw = redis_client().get(PLAN_KEY)
    planned = json.loads(raw) if raw else {}
    if planned.get("regions") != names:
        return None
    return planned["origins"], np.array(planned["plan"])


def _excess(rows: dict[str, Region], names: list[str]) -> dict[tuple[str, str], float]:
    """Each origin's load routed to each region beyond the plan's share of that origin's routed load
    (negative: below it), as ``parked_sessions_reroute`` computes it; a session with a cross-region
    migration under way counts in its target region (its ``region`` flips when the migration ends)."""
    stored = _stored_plan(names)
    if stored is None:
        return {}
    origins, plan = stored
    by_pk = {r.pk: name for name, r in rows.items()}
    placed = np.zeros(plan.shape)
    live = GenerationSession.objects.exclude(status=Status.TERMINATED).filter(
        origin__in=origins, region__isnull=False
    )
    bound_for = dict(
        Migration.objects.filter(
            outcome=Migration.Outcome.PENDING, cross_region=True, session__in=live
        ).values_list("session_id", "target_region_id")
    )
    for sid, origin, region_id, load in live.values_list("pk", "origin", "region_id", "load"):
        region_id = bound_for.get(sid) or region_id
        if region_id in by_pk:
            placed[origins.index(origin), names.index(by_pk[region_id])] += load
    excess = placed - plan * placed.sum(axis=1, keepdims=True)
    return {(o, r): float(excess[i, j]) for i, o in enumerate(origins) for j, r in enumerate(names)}


def _regions_now(
    rows: dict[str, Region], workers: list[GpuWorker], residents: dict[int, list[GenerationSession]]
) -> dict[str, RegionNow]:
    """Each region with a row: its ready capacity and load, when its booting workers cover its
    overload, its price per load unit in the router's ms-equivalents, and its free session slots."""
    now = timezone.now()
    slot_prices = [float(w.price_per_hour) / w.capacity for w in workers]
    slot_price = float(np.mean(slot_prices)) if slot_prices and max(slot_prices) > 0 else None
    w_price = CostWeights().price
    out = {}
    for name, row in rows.items():
        mine = [w for w in workers if _region_of(w, rows) == name]
        ready = [w for w in mine if w.status == GpuWorker.Status.READY]
        capacity = float(sum(w.capacity for w in ready))
        on_ready = [s for w in ready for s in residents.get(w.pk, [])]
        load = float(sum(s.load for s in on_ready))
        free = sum(
            max(0, int(min(profile_for(w.gpu_type).session_limit(), 1e9)) - len(residents.get(w.pk, [])))
            for w in ready
        )
        relief = None
        if load > capacity:
            covered = 0.0
            for w in sorted(
                (w for w in mine if w.status == GpuWorker.Status.PROVISIONING and w.expected_ready_at),
                key=lambda w: w.expected_ready_at,
            ):
                covered += w.capacity
                if covered >= load - capacity - 1e-9:
                    relief = max(0.0, (w.expected_ready_at - now).total_seconds())
                    break
        out[name] = RegionNow(
            capacity=capacity,
            load=load,
            price_ms=w_price * row.price_multiplier * (slot_price or _DEFAULT_USD_PER_SESSION_H),
            rtt_ms={o: float(v) for o, v in row.rtt_ms.items()},
            free_sessions=free,
            relief_s=relief,
            sessions=len(on_ready),
        )
    return out


def _region_of(worker: GpuWorker, rows: dict[str, Region]) -> str:
    if worker.region_id is None:
        return Region.DEFAULT_NAME
    return next((name for name, r in rows.items() if r.pk == worker.region_id), Region.DEFAULT_NAME)


def slot_moves() -> tuple[list[ParkedMove], list[StartedMove]]:
    """The slot's moves after its forecast: parked sessions first, then running ones, within one
    budget of ``REGION_MOVES_PER_SLOT`` (the running moves get what the parked ones left)."""
    parked = parked_sessions_reroute()
    return parked, running_sessions_move(spent=len(parked))


def running_sessions_move(*, spent: int = 0) -> list[StartedMove]:
    """Once a slot: start the moves ``running_moves`` chooses (at most ``REGION_MOVES_PER_SLOT``
    over all served models, less the ``spent`` moves of parked sessions this slot: one budget for
    both); returns them. Runs under the scheduler's lock, so no decision of the scheduler places or
    migrates these sessions at the same time, and locks workers then sessions in primary-key order
    as a scheduler run does."""
    config = move_settings()
    config = replace(config, limit=max(0, config.limit - spent))
    if config.limit == 0 or Region.objects.count() < 2:
        return []  # nothing can move: no lock taken
    started: list[StartedMove] = []
    with scheduler_lock():
        for preset in settings.STREAMSERVE["SERVED_MODELS"]:
            if len(started) >= config.limit:
                break
            started += _move_pool(preset, config, config.limit - len(started))
    return started


def _move_pool(preset: str, config: MoveSettings, limit: int) -> list[StartedMove]:
    outbox = Outbox()
    started: list[StartedMove] = []
    with transaction.atomic():
        rows = {r.name: r for r in Region.objects.order_by("name")}
        if len(rows) < 2:
            return []
        workers = list(
            GpuWorker.objects.select_for_update(no_key=True)
            .filter(model_preset=preset, status__in=GpuWorker.LIVE_STATUSES)
            .order_by("pk")
        )
        by_pk = {w.pk: w for w in workers}
        residents: dict[int, list[GenerationSession]] = {}
        running = list(
            GenerationSession.objects.select_for_update(no_key=True)
            .filter(model_name=preset, status__in=(Status.EXECUTING, Status.MIGRATING), worker__in=workers)
            .order_by("pk")
        )
        # A migrating session runs on its source until the flip, but its load is bound for the target:
        # counted there, so the next slot does not move another session for load that already left.
        bound_for = dict(
            Migration.objects.filter(
                outcome=Migration.Outcome.PENDING,
                session__in=[s for s in running if s.status == Status.MIGRATING],
                target__in=workers,
            ).values_list("session_id", "target_id")
        )
        for s in running:
            residents.setdefault(bound_for.get(s.pk, s.worker_id), []).append(s)
        regions = _regions_now(rows, workers, residents)
        candidates = [
            RunningSession(
                id=str(s.pk),
                origin=s.origin,
                region=_region_of(by_pk[s.worker_id], rows),
                load=s.load,
                state_bytes=float(profile_for(by_pk[s.worker_id].gpu_type).state_bytes),
            )
            for s in running
            if s.status == Status.EXECUTING
            and s.origin
            and by_pk[s.worker_id].status == GpuWorker.Status.READY
            and _region_of(by_pk[s.worker_id], rows) in rows
        ]
        past = _last_moves(candidates, rows)
        candidates = [replace(c, last_move=past.get(c.id)) for c in candidates]
        names = sorted(rows)
        moves = running_moves(regions, candidates, replace(config, limit=limit), excess=_excess(rows, names))
        sessions = {str(s.pk): s for s in running}
        for move in moves:
            session = sessions[move.session]
            target = _target_worker(workers, residents, rows, move.target, session.load)
            if target is None:
                continue
            migration = migration_start(
                session=session,
                source=by_pk[session.worker_id],
                target=target,
                decision=None,
                reason=MOVE_REASON,
                outbox=outbox,
                parked=False,
            )
            if migration is None:
                continue
            Migration.objects.filter(pk=migration.pk).update(
                cross_region=True,
                source_region=rows.get(move.source),
                target_region=rows.get(move.target),
                estimated_saving_ms=move.saving_ms,
                switch_cost_ms=move.switch_cost_ms,
            )
            residents.setdefault(target.pk, []).append(session)
            started.append(StartedMove(move, migration.pk, by_pk[session.worker_id].name, target.name))
            log.info(
                "running session %s moves from region %s (%s) to %s (%s): %s, saving %.0f ms > switch %.0f ms"
                " (charged %.0f ms)",
                move.session,
                move.source,
                by_pk[session.worker_id].name,
                move.target,
                target.name,
                move.why,
                move.saving_ms,
                move.switch_cost_ms,
                move.charged_ms,
            )
        transaction.on_commit(outbox.send)
    return started


def _last_moves(candidates: list[RunningSession], rows: dict[str, Region]) -> dict[str, PastMove]:
    """Each candidate's last cross-region move that succeeded (the move rule's hysteresis): how long
    ago it ended, the region it left and the switching cost it was charged."""
    names = {r.pk: name for name, r in rows.items()}
    now = timezone.now()
    out: dict[str, PastMove] = {}
    done = (
        Migration.objects.filter(
            session_id__in=[c.id for c in candidates],
            cross_region=True,
            outcome=Migration.Outcome.SUCCEEDED,
            finished_at__isnull=False,
        )
        .order_by("session_id", "-finished_at")
        .distinct("session_id")
        .values_list("session_id", "finished_at", "source_region_id", "switch_cost_ms")
    )
    for sid, finished, source_id, cost in done:
        out[str(sid)] = PastMove(
            age_s=(now - finished).total_seconds(),
            source=names.get(source_id, Region.DEFAULT_NAME),
            switch_cost_ms=float(cost or 0.0),
        )
    return out


def _target_worker(
    workers: list[GpuWorker],
    residents: dict[int, list[GenerationSession]],
    rows: dict[str, Region],
    region: str,
    load: float,
) -> GpuWorker | None:
    """The target region's ready worker with memory for one more session, least utilised after it."""
    best, best_key = None, None
    for w in workers:
        if w.status != GpuWorker.Status.READY or _region_of(w, rows) != region:
            continue
        mine = residents.get(w.pk, [])
        if len(mine) + 1 > profile_for(w.gpu_type).session_limit():
            continue
        key = ((sum(s.load for s in mine) + load) / w.capacity, w.name)
        if best_key is None or key < best_key:
            best, best_key = w, key
    return best
