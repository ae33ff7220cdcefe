"""Stage adapter of the reference causal video DiT (``workers.runtime.models.causal_dit``).

How ``CausalDiTModel.generate`` composes the stages:
- encode: the text encoder (``net.text``, byte/word tokens → transformer → projection to the DiT
  width) → ``prompt_embeds`` ``[text_len, dim]``;
- diffuse: the few-step flow-matching sampler over the DiT (``net.dit``) with the session's KV
  ring, then the cache pass → clean latents ``[F, C, h, w]`` (float32);
- decode: the latent decoder (``net.decoder``) over (frame, previous frame); the previous latent of a
  chunk's first frame is the last latent of the session's previous chunk — the per-session decoder
  cache (``latent_history``), which the monolithic state keeps in its region.

A diffusion state is the monolithic state region minus ``latent_history``; the decoder cache is
``latent_history`` alone. The stages are the model's own methods (``CausalDiTModel.diffuse`` and
``decode``, which its ``generate`` calls in a row), built with only the hosted stages' components;
this adapter adds the stage contract's bookkeeping (layouts, sizes, which stages are hosted), and
``tests/workers_runtime/test_stages.py`` checks split pipelines against ``generate`` bit for bit.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from workers.runtime.models import UnknownPresetError
from workers.runtime.models.base import Layout, SessionState
from workers.runtime.models.causal_dit import PRESETS, CausalDiTConfig, CausalDiTModel, CausalDiTNetwork
from workers.runtime.models.partial import component_bytes
from workers.runtime.stages.contract import Stage, StagedModel


class CausalDiTStages(StagedModel):
    COMPONENTS = {stage: CausalDiTModel.STAGE_COMPONENTS[stage.value] for stage in Stage}

    @classmethod
    def from_preset(
        cls,
        preset: str,
        *,
        stages: tuple[Stage, ...],
        device: str | torch.device = "cpu",
        weights_seed: int = 0,
        weights_path: str | None = None,
        weights: Mapping[str, torch.Tensor] | None = None,
    ) -> CausalDiTStages:
        keep = cls.components_for(stages)
        model = CausalDiTModel(
            _config(preset),
            preset=preset,
            device=device,
            weights_seed=weights_seed,
            weights_path=weights_path,
            weights=weights,
            components=keep,
        )
        return cls(model, stages)

    @classmethod
    def stage_weight_bytes(cls, preset: str) -> dict[str, int]:
        cfg = _config(preset)
        with torch.device("meta"):
            net = CausalDiTNetwork(cfg).to(cfg.torch_dtype)
        return {stage.value: component_bytes(net, names) for stage, names in cls.COMPONENTS.items()}

    @classmethod
    def state_bytes(cls, preset: str) -> int:
        """A session's bytes on a ``DC`` worker: its diffusion state plus its decoder cache (the
        monolithic state region, analytic)."""
        return _config(preset).state_bytes()

    @classmethod
    def handoff_layout(cls, preset: str) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        """Shape and dtype of one session's embeddings and latents (what crosses a stage link)."""
        cfg = _config(preset)
        return {
            "embeddings": ((cfg.text_len, cfg.dim), cfg.torch_dtype),
            "latents": (
                (cfg.frames_per_chunk, cfg.latent_channels, cfg.latent_height, cfg.latent_width),
                torch.float32,
            ),
        }

    # -- the stages (the model's own methods, `StagedModel`) -----------------------------------

    def state_layout(self) -> Layout:
        return self.model.cfg.state_layout()

    def init_diffusion_state(self, state: SessionState, seed: int, embeddings: torch.Tensor) -> None:
        state.tensors["prompt_embeds"].copy_(embeddings)
        state.meta["frames_written"] = 0


def _config(preset: str) -> CausalDiTConfig:
    if preset not in PRESETS:
        raise UnknownPresetError(
            f"unknown causal-dit preset {preset!r}; available presets: {', '.join(sorted(PRESETS))}"
        )
    return PRESETS[preset]
