"""The pool's auxiliary workers (E and C): the encoder pool grown when its encoders are too few or
too busy, an idle E or C worker the plan no longer needs re-placed, and the role a newly provisioned
worker gets. Each change is a one-change placement that ``changes`` applies."""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Sequence
from datetime import datetime

from django.conf import settings

from gpu.models import STAGE_ROLES, GpuWorker
from scheduling.core.stages.placement import PlacementError, plan_placement
from scheduling.live.outbox import Outbox
from scheduling.live.stages.changes import progress_changes
from scheduling.live.stages.mix import HISTORY_WINDOWS, live_mix, stage_gpu, stage_pipeline
from scheduling.models import SchedulerState, StagePlacement, StageRoleChange

logger = logging.getLogger("scheduling.live")


def new_worker_role(preset: str) -> str:
    """The role a worker the provisioner starts for ``preset`` gets (``--stages``): E when workers
    without E are live and no E worker is (nor is being started), else the whole pipeline."""
    live = GpuWorker.objects.filter(model_preset=preset, status__in=GpuWorker.LIVE_STATUSES)
    needs = live.filter(stage_role__in=[r for r in STAGE_ROLES if "E" not in r and "D" in r]).exists()
    return "E" if needs and not live.filter(stage_role="E").exists() else "EDC"


def encoder_pool_change(
    *, ready: dict[str, GpuWorker], busy: set[str], now: datetime, row: SchedulerState
) -> tuple[str, str] | None:
    """One worker to turn into E, and why, when the pool's encoders are too few: none ready while
    workers without E are, or the E workers' reported encode queue averages ``STAGE_ENCODER_QUEUE_MAX``
    or more (at most one growth per trigger window). The worker is an idle session holder, never the last
    one; ``None`` when no change is due or no worker can be spared."""
    encoders = [w for w in ready.values() if w.stage_role == "E"]
    holders = [w for w in ready.values() if w.holds_sessions]
    last = row.state.get("encoder_pool_at")
    if not holders or (last is not None and now.timestamp() - last < settings.STREAMSERVE["STAGE_WINDOW_S"]):
        return None  # at most one growth per trigger window: a refused change is not retried at once
    if not encoders:
        if all("E" in w.stage_role for w in holders):
            return None
        why = "no ready E worker while workers without E serve"
    else:
        queue = sum(w.encoder_load for w in encoders) / len(encoders)
        if queue < settings.STREAMSERVE["STAGE_ENCODER_QUEUE_MAX"]:
            return None
        why = f"E workers' encode queue averages {queue:g} (≥ {settings.STREAMSERVE['STAGE_ENCODER_QUEUE_MAX']})"
    idle = sorted(
        (w for w in holders if w.name not in busy),
        key=lambda w: ("E" in w.stage_role, w.name),  # a DC worker first: EDC keeps serving alone
    )
    if not idle or len(holders) < 2:
        logger.warning("stages.encoder_pool_short no idle worker can become E: %s", why)
        return None
    return idle[0].name, why


def encoder_pool_grow(
    *,
    preset: str,
    ready: dict[str, GpuWorker],
    change: tuple[str, str],
    now: datetime,
    row: SchedulerState,
    outbox: Outbox,
    workers: dict[str, GpuWorker],
) -> StagePlacement:
    """Record and start a one-worker placement that turns ``change[0]`` into an E worker."""
    name, why = change
    current = {n: w.stage_role for n, w in ready.items()}
    placement = StagePlacement.objects.create(
        created_at=now,
        preset=preset,
        reason=StagePlacement.Reason.ENCODER_POOL,
        roles_before=current,
        roles_after={**current, name: "E"},
        trigger={
            "why": why,
            "encoders": {n: w.encoder_load for n, w in ready.items() if w.stage_role == "E"},
            "encoder_queue_max": settings.STREAMSERVE["STAGE_ENCODER_QUEUE_MAX"],
        },
    )
    StageRoleChange.objects.create(
        placement=placement, worker=ready[name], from_role=current[name], to_role="E", order=0, created_at=now
    )
    row.state = {**row.state, "encoder_pool_at": now.timestamp()}
    row.save(update_fields=["state", "updated_at"])
    logger.info("stages.encoder_pool id=%s preset=%s worker=%s: %s", placement.pk, preset, name, why)
    progress_changes(preset=preset, workers=workers, now=now, outbox=outbox)
    placement.refresh_from_db()
    return placement


def _aux_shrink_change(
    *, ready: dict[str, GpuWorker], plan_roles: Sequence[str], grown_recently: bool = False
) -> tuple[str, str, str] | None:
    """One idle auxiliary worker to re-place, ``(worker, to_role, why)``, when the plan has fewer E (or
    C) workers than are ready: an E (C) worker whose heartbeat reports an empty encode (decode)
    queue, never the last E while a worker without E holds D, nor the last C while one without C
    does, nor an E worker while the pool grew its encoders within the plan's history
    (``grown_recently``: the growth answered a queue the mix may not show yet). It takes the
    D-carrying role the plan is shortest of against the pool (EDC when none is)."""
    current = Counter(w.stage_role for w in ready.values())
    planned = Counter(plan_roles)
    for stage, service in (("E", "encoder"), ("C", "decoder")):
        if current[stage] <= planned[stage] or (stage == "E" and grown_recently):
            continue
        dependants = [w for w in ready.values() if "D" in w.stage_role and stage not in w.stage_role]
        if dependants and current[stage] <= 1:
            continue
        idle = sorted(
            (w for w in ready.values() if w.stage_role == stage and w.service_load(service) == 0),
            key=lambda w: w.name,
        )
        if not idle:
            continue
        short = {r: planned[r] - current[r] for r in ("EDC", "DC", "ED", "D") if planned[r] > current[r]}
        to_role = max(short, key=lambda r: (short[r], r == "EDC")) if short else "EDC"
        why = f"the plan needs {planned[stage]} {stage} worker(s), {current[stage]} are ready"
        return idle[0].name, to_role, why
    return None


def aux_shrink_step(
    *,
    preset: str,
    ready: dict[str, GpuWorker],
    now: datetime,
    row: SchedulerState,
    outbox: Outbox,
    workers: dict[str, GpuWorker],
) -> StagePlacement | None:
    """At most once per trigger window, with E or C workers ready: plan from the live mix and, when
    the plan needs fewer of them, re-place one idle one (``_aux_shrink_change``) as a one-change
    placement (reason ``aux_shrink``). The §5.3 trigger needs a backlog to fire, so without this an
    encoder the pool grew, or a decoder a job mix asked for, would stay when nothing waits."""
    if not any(w.stage_role in ("E", "C") for w in ready.values()):
        return None
    window = settings.STREAMSERVE["STAGE_WINDOW_S"]
    last = row.state.get("aux_shrink_at")
    if last is not None and now.timestamp() - last < window:
        return None
    row.state = {**row.state, "aux_shrink_at": now.timestamp()}
    row.save(update_fields=["state", "updated_at"])
    pipeline, gpu = stage_pipeline(), stage_gpu(ready.values())
    mix = live_mix(preset=preset, now=now, window_s=window, pipeline=pipeline, gpu=gpu)
    try:
        plan = plan_placement(
            pipeline,
            mix.job_shapes,
            len(ready),
            gpu,
            encode_only_s=mix.encode_only_s,
            stream_shapes=mix.stream_shapes,
        )
    except PlacementError:
        return None
    grown = row.state.get("encoder_pool_at")
    grown_recently = grown is not None and now.timestamp() - grown < HISTORY_WINDOWS * window
    change = _aux_shrink_change(ready=ready, plan_roles=plan.roles, grown_recently=grown_recently)
    if change is None:
        return None
    name, to_role, why = change
    current = {n: w.stage_role for n, w in ready.items()}
    placement = StagePlacement.objects.create(
        created_at=now,
        preset=preset,
        reason=StagePlacement.Reason.AUX_SHRINK,
        roles_before=current,
        roles_after={**current, name: to_role},
        trigger={"why": why, "plan_roles": dict(sorted(Counter(plan.roles).items())), "mix": mix.to_json()},
    )
    StageRoleChange.objects.create(
        placement=placement,
        worker=ready[name],
        from_role=current[name],
        to_role=to_role,
        order=0,
        created_at=now,
    )
    logger.info(
        "stages.aux_shrink id=%s preset=%s worker=%s to=%s: %s", placement.pk, preset, name, to_role, why
    )
    progress_changes(preset=preset, workers=workers, now=now, outbox=outbox)
    placement.refresh_from_db()
    return placement
