"""Growing and shrinking the pool: scaling records inside the decision, provisioner calls outside.

Scale-out is recorded in the decision's transaction and the provisioner is asked right after commit,
still under the scheduler lock, so the next decision already sees the new workers as provisioning.
Scale-in drains the (empty) worker in the transaction; a Celery task stops its process, which may
take a grace period, outside the transaction and the lock. A worker that ended leaves its command
stream behind until every command sent to it is answered or timed out; the tick then deletes it.
"""

from __future__ import annotations

import json
import logging
import statistics
import struct
from datetime import datetime, timedelta
from decimal import Decimal
from pathlib import Path

from django.conf import settings
from django.db import transaction
from django.utils import timezone

from contracts.wire.channel import stream_key
from gpu import selectors as pool_selectors
from gpu import services as gpu_services
from gpu.models import GpuWorker, Region
from gpu.provisioners.registry import get_provisioner, provisioner_for
from scheduling.core.scaleplan import Endpoint, Topology, plan_scale_out
from scheduling.live.enqueue import worker_release_enqueue
from scheduling.live.outbox import Outbox, redis_client
from scheduling.live.regions import region_price_multiplier
from scheduling.live.stages.auxiliary import new_worker_role
from scheduling.live.worker_profiles import default_gpu_type, gpu_profiles
from scheduling.models import Migration, ScalingAction, SchedulerDecision, WorkerCommand

logger = logging.getLogger("scheduling.live")

# Where the weights file carries its block manifest (``workers.runtime.weights.manifest``).
WEIGHTS_METADATA_KEY = "streamserve.weights_manifest"


def scale_out(
    *,
    decision: SchedulerDecision,
    preset: str,
    gpu_type: str,
    count: int,
    budget: int,
    outbox: Outbox,
    region: Region | None = None,
) -> ScalingAction:
    """Record the scale-out of ``count`` GPUs in ``region`` (``None``: the local region) and ask the
    provisioner after commit. The region's policy sized it within the region's GPU limits
    (``scheduling.core.regions.partition``)."""
    reason = f"ρ_max={decision.rho_max:.2f} vs ρ̂={decision.rho_hat:.2f}; target {decision.target_budget}"
    action = ScalingAction.objects.create(
        decision=decision,
        created_at=timezone.now(),
        direction="out",
        from_budget=budget,
        to_budget=budget + count,
        gpu_type=gpu_type,
        reason=reason + (f"; region {region.name}" if region else ""),
    )
    outbox.after.append(
        lambda: provision(action_id=action.pk, preset=preset, gpu_type=gpu_type, count=count, region=region)
    )
    return action


def provision(
    *, action_id: int, preset: str, gpu_type: str, count: int, region: Region | None = None
) -> None:
    """Ask ``region``'s provisioner for ``count`` workers; the action records what it answered.

    Before any new worker starts, the scale plan is made over the parameter pool's holders and
    written on the action and on each worker's row (``scale_plan_write``), and each worker is put in
    ``region`` (none: the local region) at the type's price × the region's price multiplier.
    """
    action = ScalingAction.objects.get(pk=action_id)

    def before_start(workers: list[GpuWorker]) -> None:
        if region is not None:
            GpuWorker.objects.filter(pk__in=[w.pk for w in workers]).update(region=region)
        scale_plan_write(action=action, preset=preset, workers=workers)
        # The first new worker takes the role the stage placement wants (``--stages``): E while
        # workers without E run with no encoder, else the whole pipeline (docs/stages.md).
        role = new_worker_role(preset)
        if workers and role != workers[0].stage_role:
            workers[0].stage_role = role
            GpuWorker.objects.filter(pk=workers[0].pk).update(stage_role=role)

    try:
        spec = gpu_profiles()[gpu_type]
        multiplier = Decimal(str(region_price_multiplier(region)))
        result = provisioner_for(region).request(
            count=count,
            gpu_type=gpu_type,
            preset=preset,
            capacity=max(1, int(spec.capacity)),
            price_per_hour=Decimal(str(spec.price_per_hour)) * multiplier,
            before_start=before_start,
        )
    except Exception as exc:
        logger.exception("scale-out failed")
        action.outcome, action.provisioner_result = "failed", {"error": str(exc)}
        action.save(update_fields=["outcome", "provisioner_result"])
        return
    action.provisioner_result = result.as_dict()
    action.outcome = "requested" if result.ok else "failed"
    action.save(update_fields=["outcome", "provisioner_result"])
    action.workers.set(result.worker_ids)


# --- the scale plan and the phases (BlitzScale §5.1–5.3; docs/scaleout.md) -----------------------

# Every endpoint in one scale-out domain (a single leaf): the local and single-rack deployments.
POOL_DOMAIN = "cluster"
# Recent scale-outs whose measured boot (requested → process up) predicts the next one's.
BOOT_HISTORY = 20


def scale_topology(gpu_type: str):
    """The network the planner sees: the GPU type's documented links, with the links of migrations
    in flight marked busy (§5.1: plans route around them)."""
    spec = gpu_profiles().get(gpu_type) or gpu_profiles()[default_gpu_type()]
    busy = Migration.objects.filter(outcome=Migration.Outcome.PENDING).values_list(
        "source__name", "target__name"
    )
    if spec.scale_out is not None:
        # The profile's documented (or measured) network: the one the simulator plans over too.
        return spec.scale_out.topology.with_busy(busy)
    return Topology.cluster(
        nvlink_gbps=None, rdma_gbps=float(spec.link_gbps), pcie_gbps=float(spec.host_link_gbps)
    ).with_busy(busy)


def boot_seconds(*, gpu_type: str) -> float:
    """Median measured boot (request → process up) of this type's recent workers; without any, the
    profile's ``scale_out.boot_s`` (what ``profile_model`` measured), else 0."""
    rows = list(
        GpuWorker.objects.filter(gpu_type=gpu_type, process_up_at__isnull=False)
        .order_by("-requested_at")
        .values_list("requested_at", "process_up_at")[:BOOT_HISTORY]
    )
    if not rows:
        spec = gpu_profiles().get(gpu_type)
        return float(spec.scale_out.boot_s) if spec is not None and spec.scale_out is not None else 0.0
    return float(statistics.median((up - requested).total_seconds() for requested, up in rows))


def weights_bytes_on_disk(preset: str) -> int:
    """The model's size from its safetensors file's manifest (the header only: no torch here), or 0."""
    path = Path(settings.STREAMSERVE["WEIGHTS_DIR"]) / f"{preset}.safetensors"
    try:
        with open(path, "rb") as handle:
            (length,) = struct.unpack("<Q", handle.read(8))
            header = json.loads(handle.read(length))
        manifest = json.loads(header["__metadata__"][WEIGHTS_METADATA_KEY])
        return int(manifest["total_bytes"])
    except (OSError, ValueError, KeyError, TypeError, struct.error):
        return 0


def scale_plan_make(*, preset: str, gpu_type: str, targets: list[GpuWorker]) -> dict:
    """The scale plan (``scheduling.core.scaleplan``) over the pool's complete copies of ``preset``,
    as JSON plus ``sources``: each source's holder kind, address and weights digest."""
    holders = pool_selectors.weight_sources(model_preset=preset)
    digests = {h["digest"] for h in holders}
    if len(digests) > 1:
        # Copies of two versions of the weights: plan from the newest only (never mix blocks).
        newest = holders[-1]["digest"]
        holders = [h for h in holders if h["digest"] == newest]
    sources = [
        Endpoint(
            id=h["name"],
            host=h["host"],
            domain=POOL_DOMAIN,
            kind="gpu" if h["kind"] == "gpu" else "host_cache",
        )
        for h in holders
    ]
    weights_bytes = (
        max((h["weights_bytes"] for h in holders), default=0) or weights_bytes_on_disk(preset) or 1
    )
    plan = plan_scale_out(
        sources=sources,
        targets=[Endpoint(id=w.name, host=w.host, domain=POOL_DOMAIN) for w in targets],
        topology=scale_topology(gpu_type),
        weights_bytes=weights_bytes,
    )
    out = plan.to_json()
    out["sources"] = {
        h["name"]: {
            "kind": h["kind"],
            "address": h["address"],
            "digest": h["digest"],
            "holding": h["holding"],
        }
        for h in holders
    }
    return out


def worker_plan(plan: dict, name: str) -> dict:
    """One target's part of a plan: its chain, its position (1-based) and what it is expected to take."""
    for chain in plan.get("chains", []):
        if name in chain["targets"]:
            position = chain["targets"].index(name) + 1
            source = plan.get("sources", {}).get(chain["source"], {})
            return {
                "chain": [chain["source"], *chain["targets"]],
                "position": position,
                "source_kind": chain.get("source_kind", "gpu"),
                "source_address": source.get("address", ""),
                "digest": source.get("digest", ""),
                "expected_seconds": chain.get("ready_s", [chain["expected_seconds"]] * position)[
                    position - 1
                ],
                "fallback": plan.get("fallback", "disk"),
            }
    return {"chain": [], "position": 0, "source_kind": "disk", "expected_seconds": None, "fallback": "disk"}


def scale_plan_write(*, action: ScalingAction, preset: str, workers: list[GpuWorker]) -> dict:
    """Plan the scale-out of ``workers`` (committed, not yet started) and write it on the action and
    on each worker's row, with when each is expected ready: measured boot + planned load."""
    plan = scale_plan_make(preset=preset, gpu_type=action.gpu_type, targets=workers)
    boot_s = boot_seconds(gpu_type=action.gpu_type)
    expected = []
    for worker in workers:
        part = worker_plan(plan, worker.name)
        load_s = part["expected_seconds"] or 0.0
        ready_at = worker.requested_at + timedelta(seconds=boot_s + load_s)
        expected.append(ready_at)
        gpu_services.worker_weights_plan_set(worker_id=worker.pk, plan=part, expected_ready_at=ready_at)
    plan["boot_seconds"] = boot_s
    # Linked now, before the processes start: their first phase reports find the action.
    action.workers.set([w.pk for w in workers])
    ScalingAction.objects.filter(pk=action.pk).update(
        plan=plan, expected_ready_at=max(expected, default=None)
    )
    logger.info(
        "scale_plan action=%s chains=%s expected_s=%.3f",
        action.pk,
        [[c["source"], *c["targets"]] for c in plan["chains"]],
        plan.get("expected_seconds", 0.0),
    )
    return plan


@transaction.atomic
def scaling_phase_record(*, worker_id: int, phase: str, source: str = "", at: datetime | None = None) -> None:
    """A worker's scale-out phase, copied onto the scale-out actions that asked for it; an action
    whose workers are all ready is done (``ready_at``, outcome succeeded)."""
    if phase not in gpu_services.PHASES:
        raise ValueError(f"phase must be one of {', '.join(gpu_services.PHASES)}, got {phase!r}")
    at = at or timezone.now()
    worker = GpuWorker.objects.get(pk=worker_id)
    actions = ScalingAction.objects.select_for_update().filter(
        direction=ScalingAction.Direction.OUT, workers=worker
    )
    for action in actions:
        entry = action.phases.setdefault(worker.name, {})
        entry[phase] = at.isoformat()
        if source:
            entry["source"] = source
        fields = ["phases"]
        if phase == "ready" and action.ready_at is None:
            names = set(action.workers.values_list("name", flat=True))
            if names and all("ready" in action.phases.get(n, {}) for n in names):
                action.ready_at = at
                action.outcome = ScalingAction.Outcome.SUCCEEDED
                fields += ["ready_at", "outcome"]
        action.save(update_fields=fields)


TO_ZERO_REASON = "idle region to zero"


def scale_in_reason(*, decision: SchedulerDecision, worker: GpuWorker) -> str:
    """Why a worker is released: TurboServe's consolidation, or an idle region with a forecast of no
    demand going to its ``REGION_MIN_GPUS`` (``regions_to_zero``, named in the decision's inputs)."""
    if worker.name in (decision.inputs or {}).get("released_to_zero", ()):
        region = decision.inputs.get("region", "")
        return f"{TO_ZERO_REASON}: region {region} has no session and a forecast of none"
    return f"consolidated; ρ_max={decision.rho_max:.2f} vs ρ̂={decision.rho_hat:.2f}"


def scale_in(*, decision: SchedulerDecision, worker: GpuWorker, budget: int, outbox: Outbox) -> ScalingAction:
    action = ScalingAction.objects.create(
        decision=decision,
        created_at=timezone.now(),
        direction="in",
        from_budget=budget,
        to_budget=budget - 1,
        gpu_type=worker.gpu_type,
        reason=scale_in_reason(decision=decision, worker=worker),
    )
    action.workers.set([worker.pk])
    if worker.status == GpuWorker.Status.READY:
        gpu_services.worker_drain(worker=worker)
    outbox.after.append(lambda: worker_release_enqueue(worker_id=worker.pk, action_id=action.pk))
    return action


def release(*, worker_id: int, action_id: int | None) -> None:
    """Stop a drained worker: the daemon is asked to exit by itself first (a hand-started worker
    has no process to stop), then the provisioner stops its process or pod."""
    worker = GpuWorker.objects.get(pk=worker_id)
    action = ScalingAction.objects.filter(pk=action_id).first()
    outbox = Outbox()
    outbox.command(worker, "shutdown")
    outbox.send()
    try:
        result = get_provisioner(worker.provider).release(worker)
        outcome, details = ("succeeded" if result.ok else "failed"), result.as_dict()
    except Exception as exc:
        logger.exception("scale-in failed worker=%s", worker.name)
        outcome, details = "failed", {"error": str(exc)}
    if action is not None:
        action.outcome, action.provisioner_result = outcome, details
        action.save(update_fields=["outcome", "provisioner_result"])


def command_streams_prune() -> list[str]:
    """Delete the command streams (``ss:cmd:<worker>``) nobody will read again; returns the names.

    That is the stream of a worker that ended (released or failed) once none of its commands still
    waits for an answer: an answer that can still come is matched to its ``WorkerCommand`` row and
    a late reader would find its backlog, so the stream stays until ``commands_expire`` has timed the
    rest out. Streams of names this database does not know are left alone (another deployment's).
    """
    client = redis_client()
    prefix = stream_key("")
    names = [
        (key.decode() if isinstance(key, bytes) else key).removeprefix(prefix)
        for key in client.scan_iter(match=stream_key("*"), count=1000)
    ]
    if not names:
        return []
    ended = list(
        GpuWorker.objects.filter(
            name__in=names, status__in=[GpuWorker.Status.RELEASED, GpuWorker.Status.FAILED]
        )
        .exclude(commands__status=WorkerCommand.Status.SENT)
        .values_list("name", flat=True)
    )
    if ended:
        client.delete(*(stream_key(name) for name in ended))
        logger.info("command streams deleted workers=%s", ",".join(sorted(ended)))
    return ended
