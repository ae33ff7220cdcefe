"""The stage services a worker's role lacks: the encoder (E) worker that encodes the prompts of a
worker without E, the decoder (C) worker that decodes the final latents of a D or ED worker's jobs."""

from __future__ import annotations

from gpu.models import GpuWorker


def encoder_for(worker: GpuWorker, role: str | None = None, *, exclude: str | None = None) -> dict | None:
    """The encoder a session or job on ``worker`` (in ``role``: default its current one) uses:
    ``None`` when the role hosts E itself, else the least-loaded ready E worker of its model (the
    queue its heartbeat reported), same region first, other than ``exclude`` (one just lost). Raises
    ``EncoderMissing`` when there is none."""
    return _service_for(worker, "E", role, exclude=exclude)


def decoder_for(worker: GpuWorker, role: str | None = None, *, exclude: str | None = None) -> dict | None:
    """The decoder a one-shot job on a ``D`` or ``ED`` worker sends its final latents to: ``None``
    when the role hosts C itself, else the least-loaded ready C worker of its model, same region
    first (as `encoder_for`). Raises ``DecoderMissing`` when there is none."""
    return _service_for(worker, "C", role, exclude=exclude)


def _service_for(worker: GpuWorker, stage: str, role: str | None, *, exclude: str | None) -> dict | None:
    role = role or worker.stage_role
    if stage in role:
        return None
    candidates = list(
        GpuWorker.objects.filter(
            model_preset=worker.model_preset, status=GpuWorker.Status.READY, stage_role=stage
        )
        .exclude(migration_address="")
        .exclude(name=exclude or "")
    )
    service = "encoder" if stage == "E" else "decoder"
    if not candidates:
        missing = EncoderMissing if stage == "E" else DecoderMissing
        raise missing(f"no ready {stage} worker serves {worker.model_preset} to {worker.name} (role {role})")
    best = min(candidates, key=lambda e: (e.region_id != worker.region_id, e.service_load(service), e.name))
    return {"worker": best.name, "address": best.migration_address}


class StageServiceMissing(Exception):
    """A worker needs a stage service (an encoder or a decoder worker) and none is ready."""


class EncoderMissing(StageServiceMissing):
    """A worker without E needs an encoder and no ready E worker serves its model."""


class DecoderMissing(StageServiceMissing):
    """A ``D`` or ``ED`` worker needs a decoder for its jobs and no ready C worker serves its model."""
