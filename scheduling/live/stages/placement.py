"""``stage_placement_step``: one step of the live stage placement per scheduler run of a pool
(the package docstring gives the order)."""

from __future__ import annotations

import logging
from collections import Counter
from datetime import datetime, timedelta

from django.conf import settings

from gpu.models import GpuWorker
from scheduling.core.stages.placement import PlacementError, ReplacementTrigger, plan_placement, role_changes
from scheduling.live.outbox import Outbox
from scheduling.live.stages.auxiliary import aux_shrink_step, encoder_pool_change, encoder_pool_grow
from scheduling.live.stages.changes import progress_changes
from scheduling.live.stages.mix import (
    busy_workers,
    encoder_missing,
    live_mix,
    stage_gpu,
    stage_ops,
    stage_pipeline,
)
from scheduling.models import SchedulerState, StagePlacement, StageRoleChange

logger = logging.getLogger("scheduling.live")


def stage_placement_on() -> bool:
    return settings.STREAMSERVE["STAGE_PLACEMENT"] == "tridentserve"


def _state_key(preset: str) -> str:
    return f"stages@{preset}"


def stage_placement_step(
    *, preset: str, workers: dict[str, GpuWorker], now: datetime, outbox: Outbox
) -> StagePlacement | None:
    """Advance the placement in progress, or plan one when none is; returns a placement recorded by
    this step (``None``: none). ``workers``: the pool's live workers, locked by the run."""
    if not stage_placement_on():
        return None
    if progress_changes(preset=preset, workers=workers, now=now, outbox=outbox):
        return None
    ready = {name: w for name, w in sorted(workers.items()) if w.status == GpuWorker.Status.READY}
    if not ready:
        return None
    conf = settings.STREAMSERVE
    row = SchedulerState.objects.select_for_update(no_key=True).get_or_create(policy=_state_key(preset))[0]
    pool_change = encoder_pool_change(ready=ready, busy=busy_workers(ready.values()), now=now, row=row)
    if pool_change is not None:
        return encoder_pool_grow(
            preset=preset, ready=ready, change=pool_change, now=now, row=row, outbox=outbox, workers=workers
        )
    shrink = aux_shrink_step(preset=preset, ready=ready, now=now, row=row, outbox=outbox, workers=workers)
    if shrink is not None:
        return shrink
    trigger = ReplacementTrigger(conf["STAGE_WINDOW_S"], conf["STAGE_THRESHOLD"], conf["STAGE_MIN_OPS"])
    trigger.load_state_dict(row.state.get("trigger", {}))
    last_fire = trigger.state_dict()["last_fire"]
    if (
        row.state.get("bootstrapped")
        and last_fire is not None
        and now.timestamp() - last_fire < trigger.window_s
    ):
        return None  # at most one re-placement per window (§5.3): no need to read the mix
    pipeline, gpu = stage_pipeline(), stage_gpu(ready.values())
    mix = live_mix(preset=preset, now=now, window_s=trigger.window_s, pipeline=pipeline, gpu=gpu)
    current = {name: w.stage_role for name, w in ready.items()}
    # Live jobs run on EDC workers, on DC and D workers while an encoder is ready, on ED and D ones
    # while a decoder is: a queued job is unserved when no worker can take it, whatever type Alg. 2
    # would prefer for it.
    has = {"E": "E" in current.values(), "C": "C" in current.values()}
    job_hosts = [r for r in current.values() if "D" in r and all(has[s] for s in "EC" if s not in r)]
    unserved_jobs = 0 if job_hosts else len(mix.pending)
    waiting_for_encoder = mix.queued_sessions if encoder_missing(ready.values()) else 0
    clock = now.timestamp()
    for t, stage in stage_ops(preset=preset, since=now - timedelta(seconds=trigger.window_s), until=now):
        trigger.record(t, stage)
    backlog = len(mix.pending) + mix.queued_sessions
    unserved = bool(unserved_jobs or waiting_for_encoder)
    if not row.state.get("bootstrapped"):
        reason = StagePlacement.Reason.BOOTSTRAP
        trigger.load_state_dict({"last_fire": clock})
    elif trigger.should_replace(clock, backlog, unserved):
        reason = StagePlacement.Reason.UNSERVED if unserved else StagePlacement.Reason.SKEW
    else:
        row.state = {**row.state, "trigger": trigger.state_dict()}
        row.save(update_fields=["state", "updated_at"])
        return None
    figures = {
        "throughputs_per_s": {k: round(v, 6) for k, v in trigger.throughputs(clock).items()},
        "window_s": trigger.window_s,
        "threshold": trigger.threshold,
        "min_ops": trigger.min_ops,
        "backlog": backlog,
        "unserved_jobs": unserved_jobs,
        "waiting_for_encoder": waiting_for_encoder,
        "pipeline": pipeline.name,
        "gpu": gpu.name,
        "mix": mix.to_json(),
    }
    row.state = {**row.state, "trigger": trigger.state_dict(), "bootstrapped": True}
    row.save(update_fields=["state", "updated_at"])
    try:
        plan = plan_placement(
            pipeline,
            mix.job_shapes,
            len(ready),
            gpu,
            encode_only_s=mix.encode_only_s,
            stream_shapes=mix.stream_shapes,
        )
    except PlacementError as exc:
        logger.warning("stages.plan_failed preset=%s reason=%s error=%s", preset, reason, exc)
        return None
    figures["plan_roles"] = dict(sorted(Counter(plan.roles).items()))
    # Streams only ever get EDC or DC GPUs (``stream_shapes``), so a D, ED or C worker in the plan is
    # one the jobs justify: the plan's roles go out as they are.
    changes = role_changes(current, list(plan.roles), busy_workers(ready.values()))
    if not changes:
        logger.info(
            "stages.plan_unchanged preset=%s reason=%s roles=%s", preset, reason, sorted(current.values())
        )
        return None
    placement = StagePlacement.objects.create(
        created_at=now,
        preset=preset,
        reason=reason,
        roles_before=current,
        roles_after={**current, **{w: to for w, _, to in changes}},
        trigger=figures,
    )
    StageRoleChange.objects.bulk_create(
        StageRoleChange(
            placement=placement, worker=ready[w], from_role=old, to_role=new, order=i, created_at=now
        )
        for i, (w, old, new) in enumerate(changes)
    )
    logger.info(
        "stages.placement id=%s preset=%s reason=%s changes=%s",
        placement.pk,
        preset,
        reason,
        ", ".join(f"{w}:{old}->{new}" for w, old, new in changes),
    )
    progress_changes(preset=preset, workers=workers, now=now, outbox=outbox)
    placement.refresh_from_db()
    return placement
