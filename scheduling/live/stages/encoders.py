"""The encoders of workers without E: failover when the one a worker uses is lost (the rule:
``scheduling.core.stages.encoders.encoder_lost``), and the prompts such workers refused for lack of
an encoder, re-sent once one is ready."""

from __future__ import annotations

import logging
from collections.abc import Iterable
from datetime import datetime

from django.db.models import F, Q

from gpu.models import GpuWorker
from scheduling.core.stages.encoders import encoder_lost
from scheduling.live.outbox import Outbox
from scheduling.live.stages.peers import EncoderMissing, encoder_for
from scheduling.models import WorkerCommand
from sessions.models import GenerationSession

logger = logging.getLogger("scheduling.live")

# The commands that name the encoder a worker without E takes prompt embeddings from.
ENCODER_COMMANDS = (
    WorkerCommand.Kind.START,
    WorkerCommand.Kind.PROMPT,
    WorkerCommand.Kind.SET_ROLE,
    WorkerCommand.Kind.SET_ENCODER,
    WorkerCommand.Kind.JOB_RUN,
)


def current_encoders(workers: Iterable[GpuWorker]) -> dict[str, str]:
    """The encoder worker each of ``workers`` was last told to use (by name): the newest command to
    it that carried an ``encoder`` and was not refused. A worker never told one is absent."""
    ids = {w.pk: w.name for w in workers}
    if not ids:
        return {}
    rows = (
        WorkerCommand.objects.filter(worker__in=ids, kind__in=ENCODER_COMMANDS, payload__has_key="encoder")
        .exclude(status=WorkerCommand.Status.REFUSED)
        # DISTINCT ON (worker): the newest per worker, one index scan per worker's commands.
        .order_by("worker_id", "-created_at")
        .distinct("worker_id")
        .values_list("worker", "payload")
    )
    return {ids[pk]: str((payload.get("encoder") or {}).get("worker", "")) for pk, payload in rows}


def encoder_failover(*, preset: str, workers: dict[str, GpuWorker], now: datetime, outbox: Outbox) -> dict:
    """Give every ready worker without E whose encoder was lost another one (``set_encoder``, same
    region first), and re-send the prompts such workers refused for lack of an encoder once one is
    ready. Returns what it did for the run's decision record: ``{"encoder_failover": {worker:
    {"from", "to" | "waiting", "reason"}}, "prompts_resent": [prompt ids]}`` (empty keys left out)."""
    dependants = [
        w
        for w in workers.values()
        if w.status == GpuWorker.Status.READY and w.holds_sessions and "E" not in w.stage_role
    ]
    if not dependants:
        return {}
    ready_encoders = {
        w.name for w in workers.values() if w.status == GpuWorker.Status.READY and w.stage_role == "E"
    }
    current = current_encoders(dependants)
    in_flight = set(
        WorkerCommand.objects.filter(
            worker__in=dependants, kind=WorkerCommand.Kind.SET_ENCODER, status=WorkerCommand.Status.SENT
        ).values_list("worker__name", flat=True)
    )
    failover: dict[str, dict] = {}
    for worker in dependants:
        if worker.name in in_flight:
            continue
        why = encoder_lost(
            current.get(worker.name), ready_encoders, (worker.telemetry or {}).get("encoder_wait")
        )
        if why is None:
            continue
        entry = {"from": current.get(worker.name) or None, "reason": why}
        try:
            encoder = encoder_for(worker, exclude=current.get(worker.name))
        except EncoderMissing as exc:
            failover[worker.name] = {**entry, "waiting": f"waiting for an encoder: {exc}"}
            continue
        # ``lost`` and ``why`` are for the record (console, audit); the worker reads ``encoder``.
        outbox.command(worker, WorkerCommand.Kind.SET_ENCODER, encoder=encoder, lost=entry["from"], why=why)
        failover[worker.name] = {**entry, "to": encoder["worker"]}
        logger.warning(
            "stages.encoder_failover preset=%s worker=%s from=%s to=%s reason=%s",
            preset,
            worker.name,
            entry["from"],
            encoder["worker"],
            why,
        )
    out: dict = {"encoder_failover": failover} if failover else {}
    resent = _refused_prompts_resend(dependants, outbox)
    if resent:
        out["prompts_resent"] = resent
    return out


def _refused_prompts_resend(dependants: list[GpuWorker], outbox: Outbox) -> list[int]:
    """A prompt a worker without E refused for its encoder — it came without one (none was ready), or
    the one it named could not be used — goes to it again with a ready one (not the one refused) —
    once per refused command (a re-sent prompt refused again is left to the record), and only while
    the session is still on that worker (elsewhere its start or resume carries the whole prompt
    history)."""
    refused = list(
        WorkerCommand.objects.filter(
            worker__in=dependants,
            kind=WorkerCommand.Kind.PROMPT,
            status=WorkerCommand.Status.REFUSED,
            session__worker=F("worker"),
            session__status__in=[GenerationSession.Status.EXECUTING, GenerationSession.Status.MIGRATING],
        )
        # Refused for the encoder: sent without one (none was ready), or the one named was unusable.
        .filter(~Q(payload__has_key="encoder") | Q(reason__icontains="encoder"))
        .exclude(payload__has_key="resent")
        .select_related("worker", "session")
        .order_by("created_at")
    )
    if not refused:
        return []
    # A prompt already re-sent (the payload names the refused command) is not sent twice.
    done = set(
        WorkerCommand.objects.filter(
            kind=WorkerCommand.Kind.PROMPT, payload__resent__in=[str(c.pk) for c in refused]
        ).values_list("payload__resent", flat=True)
    )
    resent: list[int] = []
    for command in refused:
        if str(command.pk) in done:
            continue
        named = (command.payload.get("encoder") or {}).get("worker")
        try:
            encoder = encoder_for(command.worker, exclude=named)
        except EncoderMissing:
            continue
        session = command.session
        payload = {
            k: v for k, v in command.payload.items() if k not in ("id", "kind", "session", "epoch", "encoder")
        }
        outbox.command(
            command.worker,
            WorkerCommand.Kind.PROMPT,
            session=session,
            epoch=session.epoch,
            **payload,
            encoder=encoder,
            resent=str(command.pk),
        )
        resent.append(payload.get("prompt_id"))
        logger.info(
            "stages.prompt_resent session=%s worker=%s prompt=%s refused_command=%s",
            session.pk,
            command.worker.name,
            payload.get("prompt_id"),
            command.pk,
        )
    return resent
