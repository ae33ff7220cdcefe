"""What a committed session event (or job change) asks of the workers that hold the session (job)."""

from __future__ import annotations

import logging

from gpu.models import GpuWorker
from scheduling.live.outbox import Outbox
from scheduling.live.stages.peers import EncoderMissing, encoder_for
from scheduling.models import Migration
from sessions.models import GenerationSession, Job, Prompt

logger = logging.getLogger("scheduling.live")

Status = GenerationSession.Status


def prompt_forward(*, session_id: str, prompt_id: int) -> None:
    """A new prompt goes to whoever holds the session (both ends while it migrates)."""
    session = GenerationSession.objects.select_related("worker", "host_worker").get(pk=session_id)
    prompt = Prompt.objects.get(pk=prompt_id)
    outbox = Outbox()
    holders = [w for w in (session.worker, session.host_worker) if w is not None]
    if session.status == Status.MIGRATING:
        pending = Migration.objects.filter(session=session, outcome=Migration.Outcome.PENDING).select_related(
            "target"
        )
        holders += [m.target for m in pending]
    for worker in {w.pk: w for w in holders}.values():
        # A holder without E encodes the new prompt on the pool's encoder (docs/stages.md).
        try:
            encoder = encoder_for(worker)
        except EncoderMissing as exc:
            # Sent all the same: the worker refuses it naming the missing encoder, and the refusal is
            # the command's recorded answer (the audit and the console show it).
            logger.warning("prompt.no_encoder session=%s worker=%s: %s", session.pk, worker.name, exc)
            encoder = None
        outbox.command(
            worker,
            "prompt",
            session=session,
            epoch=session.epoch,
            text=prompt.text,
            from_chunk=prompt.from_chunk,
            prompt_id=prompt.pk,
            **({"encoder": encoder} if encoder is not None else {}),
        )
    outbox.send()


def session_stop(*, session_id: str, held_by: list[str]) -> None:
    """After a depart: the workers that held the session free its state."""
    outbox = Outbox()
    session = GenerationSession.objects.filter(pk=session_id).first()
    for worker in GpuWorker.objects.filter(name__in=held_by, status__in=GpuWorker.LIVE_STATUSES):
        outbox.command(worker, "stop", session=session)
    outbox.send()


def job_stop(*, job_id: str, held_by: str, epoch: int) -> None:
    """After a cancel: the worker that held the job drops its state."""
    job = Job.objects.filter(pk=job_id).first()
    worker = GpuWorker.objects.filter(name=held_by, status__in=GpuWorker.LIVE_STATUSES).first()
    if job is None or worker is None:
        return
    outbox = Outbox()
    outbox.command(worker, "job_cancel", job=job, epoch=epoch)
    outbox.send()
