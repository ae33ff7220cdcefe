"""Growing and shrinking the pool: scaling records inside the decision, provisioner calls outside.

Scale-out is recorded in the decision's transaction and the provisioner is asked right after commit,
still under the scheduler lock, so the next decision already sees the new workers as provisioning.
Scale-in drains the (empty) worker in the transaction; a Celery task stops its process, which may
take a grace period, outside the transaction and the lock. A worker that ended leaves its command
stream behind until every command sent to it is answered or timed out; the tick then deletes it.
"""

from __future__ import annotations

import logging

from django.utils import timezone

from gpu import services as gpu_services
from gpu.models import GpuWorker
from gpu.provisioners.registry import get_provisioner
from scheduling.live.enqueue import worker_release_enqueue
from scheduling.live.outbox import Outbox, redis_client
from scheduling.live.profiles import gpu_profiles
from scheduling.models import ScalingAction, SchedulerDecision, WorkerCommand
from workers.channel import stream_key

logger = logging.getLogger("scheduling.live")


def scale_out(
    *, decision: SchedulerDecision, preset: str, gpu_type: str, count: int, budget: int, outbox: Outbox
) -> ScalingAction:
    action = ScalingAction.objects.create(
        decision=decision,
        created_at=timezone.now(),
        direction="out",
        from_budget=budget,
        to_budget=budget + count,
        gpu_type=gpu_type,
        reason=f"ρ_max={decision.rho_max:.2f} vs ρ̂={decision.rho_hat:.2f}; target {decision.target_budget}",
    )
    outbox.after.append(lambda: provision(action_id=action.pk, preset=preset, gpu_type=gpu_type, count=count))
    return action


def provision(*, action_id: int, preset: str, gpu_type: str, count: int) -> None:
    """Ask the provisioner for ``count`` workers; the action records what it answered."""
    action = ScalingAction.objects.get(pk=action_id)
    try:
        spec = gpu_profiles()[gpu_type]
        result = get_provisioner().request(
            count=count,
            gpu_type=gpu_type,
            preset=preset,
            capacity=max(1, int(spec.capacity)),
            price_per_hour=spec.price_per_hour,
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


def scale_in(*, decision: SchedulerDecision, worker: GpuWorker, budget: int, outbox: Outbox) -> ScalingAction:
    action = ScalingAction.objects.create(
        decision=decision,
        created_at=timezone.now(),
        direction="in",
        from_budget=budget,
        to_budget=budget - 1,
        gpu_type=worker.gpu_type,
        reason=f"consolidated; ρ_max={decision.rho_max:.2f} vs ρ̂={decision.rho_hat:.2f}",
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
