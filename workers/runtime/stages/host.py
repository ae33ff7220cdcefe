"""A worker daemon's stage role (issue 15): what it hosts and how it changes at run time.

A worker daemon (``manage.py gpuworker --stages ROLE``) runs any role:

- ``EDC`` — the monolithic worker, unchanged: its `ChunkEngine` holds the model itself.
- ``DC`` — a diffusion worker with no encoder weights. Its engine holds a `StagedStreamingModel`
  (``stages.staged_model``): diffuse and decode only, the prompt embeddings from an encoder worker
  (``stages.clients``).
- ``E`` — an encoder worker: no sessions, no chunks. Its `EncoderService` (``stages.service``)
  answers encode requests from many ``DC`` workers, one pair of hand-off links (``stages/link.py``)
  per client, rendezvous on the store the worker already hosts for migrations (its
  ``migration_address``).
- ``C`` — a decoder worker: no sessions, no jobs. Its `DecoderService` decodes finished one-shot
  jobs' latents for ``D``/``ED`` workers (`DecoderClient`), the same request/response `StageService`
  as the encoder's on its own hello queue.
- ``D``, ``ED`` — one-shot job workers: a stream keeps decode next to diffuse (its causal VAE's
  per-session decoder cache), so they refuse sessions; a job's prompt is encoded on an ``E`` worker
  (``D``) or here (``ED``), its final latents decoded on the ``C`` worker its ``job_run`` names.

`StageHost.set_role` re-cuts the model in place (``stages.restage``) at a chunk boundary.
"""

from __future__ import annotations

import gc
import statistics
import time
from collections.abc import Mapping
from typing import Any

import torch

from workers.runtime.stages.clients import Decoders, PromptEncodings
from workers.runtime.stages.contract import Stage, StagedModel, parse_role, role_name
from workers.runtime.stages.link import DEFAULT_TIMEOUT_S
from workers.runtime.stages.restage import StageLoader, hosted_stages, resident_weight_bytes, restage
from workers.runtime.stages.service import DecoderService, EncoderService, StageService
from workers.runtime.stages.staged_model import StagedStreamingModel, daemon_role

# Roles whose worker runs no sessions and no jobs: a request/response stage service.
SERVICE_ROLES = ("E", "C")


def prompt_at(meta: Mapping[str, Any], chunk: int) -> str:
    """The prompt in force at ``chunk`` under a session meta's schedule."""
    schedule = meta["prompt_schedule"]
    prompt = schedule[0][1]
    for start, text in schedule:
        if int(start) <= chunk:
            prompt = text
    return prompt


def pending_switch(meta: Mapping[str, Any]) -> int | None:
    """The first chunk at which a session's state still needs a prompt's embeddings (a switch due
    at its next chunk or scheduled later), or None when every prompt it will use is installed."""
    next_chunk = int(meta["next_chunk"])
    schedule = meta.get("prompt_schedule") or []
    in_force = None
    for start, text in schedule:
        if int(start) <= next_chunk:
            in_force = text
    if in_force is not None and in_force != meta.get("active_prompt"):
        return next_chunk
    later = [int(start) for start, _ in schedule if int(start) > next_chunk]
    return min(later) if later else None


# --- the worker daemon's role ------------------------------------------------------------------


class RoleRefused(RuntimeError):
    """A role change the worker cannot make now (the reason names the session or the role)."""


class PoolCopy:
    """A worker's packed copy of the whole model in the parameter pool (the model's weights are
    views of its buffers). ``release`` takes the worker out of the pool and lets go of the copy:
    ``workers.weights_loading.PooledCopy`` is the real one."""

    def tensors(self) -> list[torch.Tensor]:
        return []

    def release(self) -> None:
        """Leave the pool; the buffers are freed once nothing views them."""


class StageHost:
    """What a worker daemon's role decides: its engine's model (monolithic or `StagedStreamingModel`),
    the encoder it fetches embeddings from (``DC``) or the encoder service it runs (``E``), and how
    it changes role at run time (`set_role`). The daemon calls it from its loop only.

    ``pool_copy``: the worker's copy in the parameter pool, released when the worker drops a stage
    (a partial copy is no source, and its dropped blocks' memory must go back). ``loader``: where a
    stage added at run time loads its components from (`StageLoader`; default: ``weights_path`` or
    the preset's seed)."""

    def __init__(
        self,
        engine: Any,
        *,
        store_address: str | None = None,
        weights_path: str | None = None,
        timeout_s: float = DEFAULT_TIMEOUT_S,
        pool_copy: PoolCopy | None = None,
        loader: StageLoader | None = None,
    ) -> None:
        self.engine = engine
        self.store_address = store_address
        self.weights_path = weights_path
        self.timeout_s = timeout_s
        self.pool_copy = pool_copy
        self.loader = loader
        # Sessions waiting for a prompt's embeddings, with the reason (the heartbeat reports them).
        self.waiting: dict[str, str] = {}
        model = engine.model
        if isinstance(model, StagedStreamingModel):
            self.role = role_name(model.stages)
            self.encodings = model.encodings
        else:
            self.role = "EDC"
            self.encodings = PromptEncodings(device=engine.device, timeout_s=timeout_s)
        self.service: StageService | None = None
        if self.role in SERVICE_ROLES:
            self.service = self._service(model.staged, self.role)

    @property
    def needs_encoder(self) -> bool:
        """Whether sessions and jobs here take their embeddings from an encoder worker."""
        return "D" in self.role and "E" not in self.role

    @property
    def needs_decoder(self) -> bool:
        """Whether jobs here are decoded on a decoder worker (``D``, ``ED``)."""
        return "D" in self.role and "C" not in self.role

    @property
    def holds_sessions(self) -> bool:
        return "D" in self.role and "C" in self.role

    @property
    def runs_jobs(self) -> bool:
        return "D" in self.role

    @property
    def sessions_refused(self) -> str:
        """Why this worker takes no sessions (``""`` when it does)."""
        if self.holds_sessions:
            return ""
        if self.runs_jobs:
            return (
                f"role {self.role} runs one-shot jobs only: a stream needs decode next to diffuse "
                "(its causal VAE keeps a per-session decoder cache); start it on an EDC or DC worker"
            )
        return f"role {self.role} holds no sessions: start them on a diffusion worker"

    @property
    def decoders(self) -> Decoders | None:
        model = self.engine.model
        return model.decoders if isinstance(model, StagedStreamingModel) else None

    def start(self) -> None:
        if self.service is not None:
            self.service.start()

    def use_encoder(self, spec: Any) -> None:
        """``{"worker": name, "address": host:port}`` from a command; `ValueError` names the field."""
        if not isinstance(spec, Mapping) or not isinstance(spec.get("address"), str) or not spec["address"]:
            raise ValueError(f"encoder: required for role {self.role} ({{'worker': .., 'address': ..}})")
        self.encodings.use(spec["address"], str(spec.get("worker", "")))

    def use_decoder(self, spec: Any) -> None:
        """``{"worker": name, "address": host:port}`` from a job command; `ValueError` names the field."""
        if not isinstance(spec, Mapping) or not isinstance(spec.get("address"), str) or not spec["address"]:
            raise ValueError(f"decoder: required for role {self.role} ({{'worker': .., 'address': ..}})")
        decoders = self.decoders
        assert decoders is not None  # a D or ED worker runs a StagedStreamingModel
        decoders.use(spec["address"], str(spec.get("worker", "")))

    def set_role(self, role: str, sessions: Mapping[str, Mapping[str, Any]]) -> dict[str, Any]:
        """Become ``role``; ``sessions`` is the meta of every session this worker holds (resident,
        parked or arriving). Refuses (`RoleRefused`) when a session needs a stage the role drops, or
        a prompt encoding no encoder is known to provide."""
        try:
            target = daemon_role(role)
        except ValueError as exc:  # RoleError is a ValueError
            raise RoleRefused(str(exc)) from exc
        if target == self.role:
            return {"role": target, "load_ms": 0.0, "loaded": "", "dropped": ""}
        stages = parse_role(target)
        if sessions and not (Stage.DIFFUSE in stages and Stage.DECODE in stages):
            sid = next(iter(sessions))
            raise RoleRefused(
                f"session {sid} (and {len(sessions) - 1} more) needs diffuse and decode, which role {target} drops"
            )
        if Stage.ENCODE not in stages and not self.encodings.known:
            for sid, meta in sessions.items():
                chunk = pending_switch(meta)
                if chunk is not None:
                    raise RoleRefused(
                        f"session {sid} needs a prompt's embeddings at chunk {chunk} and no encoder is "
                        f"known to this worker (send set_role with an encoder)"
                    )
        if target in SERVICE_ROLES and self.store_address is None:
            raise RoleRefused(f"role {target} serves at the worker's store address; this worker has none")
        model = self.engine.model
        inner = model.inner if isinstance(model, StagedStreamingModel) else model
        before = set(hosted_stages(inner))
        bytes_before = self.weights_bytes()
        started = time.perf_counter()
        if self.service is not None:
            self.service.close()
            self.service = None
        staged, source, detail = restage(inner, stages, weights_path=self.weights_path, loader=self.loader)
        if set(stages) != set(Stage) and self.pool_copy is not None:
            # A partial model is no pool source: leave the pool and free the dropped blocks.
            self.pool_copy.release()
            self.pool_copy = None
        gc.collect()  # the dropped modules may sit in reference cycles
        if inner.device.type == "cuda":
            torch.cuda.synchronize(inner.device)
            torch.cuda.empty_cache()  # the dropped stages' weights go back to the device
        load_ms = (time.perf_counter() - started) * 1000.0
        decoders = self.decoders
        self.engine.model = (
            inner if target == "EDC" else StagedStreamingModel(staged, self.encodings, decoders)
        )
        if target in SERVICE_ROLES:
            self.service = self._service(staged, target)
            self.service.start()
        self.role = target
        return {
            "role": target,
            "load_ms": round(load_ms, 3),
            "loaded": role_name(frozenset(set(stages) - before)),
            "dropped": role_name(frozenset(before - set(stages))),
            "source": source,
            "source_detail": detail,
            "weights_bytes_before": bytes_before,
            "weights_bytes": self.weights_bytes(),
        }

    def weights_bytes(self) -> int:
        """Weight memory this worker keeps alive now (model and pool copy, `resident_weight_bytes`)."""
        model = self.engine.model
        inner = model.inner if isinstance(model, StagedStreamingModel) else model
        extra = self.pool_copy.tensors() if self.pool_copy is not None else []
        return resident_weight_bytes(inner, extra)

    def note_waiting(self, metas: Mapping[str, Mapping[str, Any]]) -> None:
        """Record which of these (due, not generated) sessions wait for a prompt's embeddings, and
        why; called by the daemon after each step."""
        waiting: dict[str, str] = {}
        if self.needs_encoder:
            for sid, meta in metas.items():
                prompt = prompt_at(meta, int(meta["next_chunk"]))
                if prompt != meta.get("active_prompt") and not self.encodings.ready(prompt):
                    waiting[sid] = self.encodings.wait_reason(prompt)
        self.waiting = waiting

    def report(self) -> dict[str, Any]:
        """What the heartbeat adds to the telemetry: the role, and an encoder's load."""
        fields: dict[str, Any] = {"stage_role": self.role}
        if self.service is not None:
            fields["encoder" if self.role == "E" else "decoder"] = self.service.load()
            fields["session_capacity"] = 0
        elif self.needs_encoder and self.encodings.round_trips_ms:
            fields["encode_round_trip_ms_p50"] = round(statistics.median(self.encodings.round_trips_ms), 3)
        if not self.holds_sessions:
            fields["session_capacity"] = 0
        decoders = self.decoders
        if self.needs_decoder and decoders is not None and decoders.round_trips_ms:
            fields["decode_round_trip_ms_p50"] = round(statistics.median(decoders.round_trips_ms), 3)
        waiting = self.waiting
        if waiting:
            fields["encoder_wait"] = {"sessions": sorted(waiting), "reason": next(iter(waiting.values()))}
        return fields

    def close(self) -> None:
        if self.service is not None:
            self.service.close()
        self.encodings.close()
        if self.decoders is not None:
            self.decoders.close()

    def _service(self, staged: StagedModel, role: str) -> StageService:
        if self.store_address is None:
            raise RoleRefused(f"role {role} serves at the worker's store address; this worker has none")
        service = EncoderService if role == "E" else DecoderService
        return service(staged, self.store_address, device=self.engine.device, timeout_s=self.timeout_s)
