"""Stage-level serving (TridentServe §3): a streaming model split into encode, diffuse and decode.

A diffusion pipeline is three stages with very different needs: the text encoder (large weights, runs
once per prompt), the diffusion transformer (most of the compute, per-session state that grows with
the stream) and the decoder (memory-hungry at high resolution). A `StagedModel` exposes each stage
with its own contract, so a worker can host any subset of them and hand tensors to the next:

- ``encode(prompt) -> embeddings``: one prompt, always encoded alone (batch of one), so the
  embeddings never depend on other sessions (the monolithic models do the same).
- ``diffuse(states, embeddings) -> latents``: the next chunk of every session in the batch; a
  session's *diffusion state* (`SessionState`: KV cache, prompt embeddings, counters) is updated in
  place; ``embeddings[i]`` is the encoding of a prompt taking effect at this chunk, or None.
- ``decode(latents, caches) -> frames``: uint8 frames ``[B, T, H, W, 3]``; a causal decoder keeps a
  per-session *decoder cache* (``caches[i]``, named tensors) updated in place.

A session's state of the monolithic model is split accordingly: the diffusion state holds every
tensor but the decoder's, the decoder cache holds the rest, so decode can run on another worker (or
next to diffuse when the cache is large: issue 15 keeps decode beside diffuse for such sessions).

Composing the three stages in one process reproduces the monolithic ``generate`` bit for bit with
the same batch (tested for every adapter); that is what lets a split pipeline replace a monolithic
replica without a visible change.

A *role* is the set of stages one worker hosts, written as the letters of its stages in pipeline
order: ``EDC`` (monolithic), ``ED``, ``DC``, ``E``, ``D``, ``C``. A stage worker loads only the
weights of its stages (`StagedModel.loaded_weight_bytes`; `stage_weight_bytes` gives the analytic
size of each stage of a preset without allocating anything).
"""

from __future__ import annotations

import abc
import enum
import pkgutil
from typing import Any

import torch

from contracts.catalog.local_paths import WAN_CAUSAL
from contracts.catalog.presets import CAUSAL_DIT, DEMO, PRESETS
from workers.runtime.models import UnknownPresetError
from workers.runtime.models.base import Layout, SessionState, StagewiseModel, allocate_region

DecoderCache = dict[str, torch.Tensor]


class Stage(enum.Enum):
    ENCODE = "E"
    DIFFUSE = "D"
    DECODE = "C"


PIPELINE_ORDER = (Stage.ENCODE, Stage.DIFFUSE, Stage.DECODE)
# The roles of issue 15: contiguous runs of the pipeline (a worker hosting E and C but not D would
# send its embeddings away and get latents back: never useful, so it is not a role).
ROLES = ("EDC", "ED", "DC", "E", "D", "C")


class RoleError(ValueError):
    """A role string names no valid set of stages."""


def parse_role(role: str) -> tuple[Stage, ...]:
    """``"DC"`` → (DIFFUSE, DECODE); raises `RoleError` naming the valid roles otherwise."""
    text = role.strip().upper() if isinstance(role, str) else role
    if text not in ROLES:
        raise RoleError(
            f"invalid stage role {role!r}: a role is the letters of the stages a worker hosts, in "
            f"pipeline order (E encode, D diffuse, C decode); valid roles: {', '.join(ROLES)}"
        )
    return tuple(Stage(letter) for letter in text)


def role_name(stages: tuple[Stage, ...] | frozenset[Stage]) -> str:
    return "".join(stage.value for stage in PIPELINE_ORDER if stage in stages)


class StageNotHosted(RuntimeError):
    """A stage was called on a worker that did not load its weights."""


class StagedModel(abc.ABC):
    """One model's stages, built with the weights of ``stages`` only (see the module docstring).

    The stages themselves are the model's (a `StagewiseModel`, whose ``generate`` calls the same
    methods in a row); an adapter adds which stages it hosts, their weights and their layouts."""

    # Network submodule (attribute name) of each stage: what a worker loads for that stage.
    COMPONENTS: dict[Stage, tuple[str, ...]]
    # The stages whose weights a one-shot job's denoising step uses: a worker running jobs' steps
    # hosts them all.
    JOB_STEP_STAGES: tuple[Stage, ...] = (Stage.DIFFUSE,)

    def __init__(self, model: StagewiseModel, stages: tuple[Stage, ...]) -> None:
        self.model = model
        self.net = model.net  # type: ignore[attr-defined]
        self.preset = model.preset
        self.device = model.device
        self.stages = frozenset(stages)

    @classmethod
    def components_for(cls, stages: tuple[Stage, ...]) -> list[str]:
        """The network submodules a worker hosting ``stages`` loads, in stage order."""
        return [name for stage in stages for name in cls.COMPONENTS[stage]]

    @abc.abstractmethod
    def state_layout(self) -> Layout:
        """(name, shape, dtype) of the monolithic model's state region: diffusion state and decoder
        cache (its tensors named in the model's ``DECODER_CACHE``) together."""

    @abc.abstractmethod
    def init_diffusion_state(self, state: SessionState, seed: int, embeddings: torch.Tensor) -> None:
        """Fill a freshly zeroed diffusion state as the monolithic ``create_state`` does."""

    def diffusion_layout(self) -> Layout:
        """(name, shape, dtype) of a session's diffusion state, in order."""
        return [entry for entry in self.state_layout() if entry[0] not in self.model.DECODER_CACHE]

    def decoder_cache_layout(self) -> Layout:
        """(name, shape, dtype) of a session's decoder cache (empty for a stateless decoder)."""
        return [entry for entry in self.state_layout() if entry[0] in self.model.DECODER_CACHE]

    def encode(self, prompt: str) -> torch.Tensor:
        self.require(Stage.ENCODE)
        return self.model.encode_prompt(prompt)

    def diffuse(self, states: list[SessionState], embeddings: list[torch.Tensor | None]) -> torch.Tensor:
        self.require(Stage.DIFFUSE)
        return self.model.diffuse(states, embeddings)

    def decode(self, latents: torch.Tensor, caches: list[DecoderCache]) -> torch.Tensor:
        self.require(Stage.DECODE)
        return self.model.decode(latents, caches)

    # -- shared implementation -----------------------------------------------------------------

    def require(self, stage: Stage) -> None:
        if stage not in self.stages:
            raise StageNotHosted(
                f"stage {stage.name.lower()} is not hosted by this {role_name(self.stages)} worker"
            )

    def create_diffusion_state(
        self, seed: int, embeddings: torch.Tensor, *, start_chunk: int = 0
    ) -> SessionState:
        """A session's diffusion state at ``start_chunk`` whose prompt encoding is ``embeddings``."""
        self.require(Stage.DIFFUSE)
        region, tensors = allocate_region(self.diffusion_layout(), self.device)
        region.zero_()
        state = SessionState(
            tensors=tensors, meta={"seed": int(seed), "next_chunk": int(start_chunk)}, region=region
        )
        self.init_diffusion_state(state, seed, embeddings.to(self.device))
        return state

    # -- one-shot jobs through the stages (the model's own `create_job` split at its encode) ------

    def create_job(
        self,
        embeddings: torch.Tensor,
        *,
        kind: str,
        prompt: str,
        seed: int,
        width: int,
        height: int,
        frames: int,
        steps: int,
    ) -> SessionState:
        """A job's region at step 0 from its prompt's encoding: the model's `create_job` after its
        encode, with the same checks (`JobSpecError` naming the field) and the same meta."""
        self.require_job_step()
        self.model.check_job(kind=kind, width=width, height=height, frames=frames, steps=steps)
        meta = self.model.job_meta(
            kind=kind, prompt=prompt, seed=seed, width=width, height=height, frames=frames, steps=steps
        )
        return self.model.create_job_region(meta, embeddings.to(self.device))

    def job_step(self, states: list[SessionState]) -> None:
        self.require_job_step()
        self.model.job_step(states)

    def require_job_step(self) -> None:
        missing = [stage for stage in self.JOB_STEP_STAGES if stage not in self.stages]
        if missing:
            raise StageNotHosted(
                f"one-shot jobs of {self.preset!r} step with the weights of {role_name(self.JOB_STEP_STAGES)}; "
                f"this {role_name(self.stages)} worker lacks {role_name(tuple(missing))}"
            )

    def decode_job(self, latents: torch.Tensor, meta: dict[str, Any]) -> torch.Tensor:
        self.require(Stage.DECODE)
        return self.model.decode_job(latents.to(self.device), meta)

    def create_decoder_cache(self) -> DecoderCache:
        self.require(Stage.DECODE)
        region, tensors = allocate_region(self.decoder_cache_layout(), self.device)
        region.zero_()
        return tensors

    def loaded_weight_bytes(self) -> int:
        """Bytes of the parameters and buffers this worker actually holds."""
        tensors = [t for module in self.weight_modules() for t in (*module.parameters(), *module.buffers())]
        return sum(t.numel() * t.element_size() for t in tensors if t.device.type != "meta")

    def weight_modules(self) -> list[torch.nn.Module]:
        """The modules holding the model's weights (those of stages not hosted are on meta or absent)."""
        return [self.net]


# Adapter of each model class of the preset table (``Preset.model``); Wan presets are added to the
# table at run time from checkpoint directories (``MODEL_PATHS``, `register_model_path`).
STAGE_ADAPTERS: dict[str, str] = {
    DEMO: "workers.runtime.stages.demo:DemoStages",
    CAUSAL_DIT: "workers.runtime.stages.causal_dit:CausalDiTStages",
    WAN_CAUSAL: "workers.runtime.stages.wan_causal:WanCausalStages",
}


def staged_class(preset: str) -> Any:
    if preset not in PRESETS:
        raise UnknownPresetError(f"unknown model preset {preset!r}; available: {', '.join(sorted(PRESETS))}")
    dotted = STAGE_ADAPTERS.get(PRESETS[preset].model)
    if dotted is None:
        raise UnknownPresetError(
            f"preset {preset!r} ({PRESETS[preset].model}) has no stage adapter; "
            f"staged model classes: {', '.join(sorted(STAGE_ADAPTERS))}"
        )
    return pkgutil.resolve_name(dotted)


def build_staged(preset: str, role: str, **kwargs: Any) -> StagedModel:
    """The stages of ``role`` (e.g. ``"DC"``) of ``preset``, with only their weights loaded."""
    return staged_class(preset).from_preset(preset, stages=parse_role(role), **kwargs)


def stage_weight_bytes(preset: str) -> dict[str, int]:
    """Bytes of weights of each stage of ``preset`` (``{"E": ..., "D": ..., "C": ...}``), computed
    on the meta device: exact for any preset, ``wan-1.3b`` included, and allocates nothing (a Wan
    preset: in bfloat16, its serving dtype on a GPU; `WanCausalStages.stage_weight_bytes` takes
    another)."""
    return staged_class(preset).stage_weight_bytes(preset)
