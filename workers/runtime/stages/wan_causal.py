"""Stage adapter of the Wan2.1 causal model (``workers.runtime.models.wan_causal``).

How ``WanCausalModel.generate`` composes the stages:
- encode: UMT5 (padding zeroed) and the DiT's text projection → ``prompt_embeds`` ``[text_len, dim]``;
- diffuse: the few-step sampler over the DiT with the session's KV ring and latent window (and
  LongLive's re-cache when a new prompt's embeddings arrive) → clean latents ``[F, C, h, w]``;
- decode: the causal VAE with the ``vae_cache.*`` tensors as the per-session decoder cache.

The stages are the model's own methods; a stage worker's model loads only its stages' components
(`WanCausalNetwork`: an encode-only worker holds UMT5 and the text projection, a ``DC`` worker no
text encoder at all). Unlike the other adapters it is built from a loaded architecture
(``WanCausalStages.build``), not from the preset table: the Wan presets name checkpoint directories.
"""

from __future__ import annotations

import torch

from workers.runtime.local_models import WanCausalArchitecture
from workers.runtime.models.base import Layout, SessionState
from workers.runtime.models.wan_causal import WanCausalModel
from workers.runtime.stages.contract import Stage, StagedModel


class WanCausalStages(StagedModel):
    COMPONENTS = {
        Stage.ENCODE: ("text_encoder",),
        Stage.DIFFUSE: ("transformer",),
        Stage.DECODE: ("vae",),
    }

    @classmethod
    def build(
        cls,
        arch: WanCausalArchitecture,
        *,
        preset: str,
        stages: tuple[Stage, ...],
        device: str | torch.device = "cpu",
        dtype: str | None = None,
    ) -> WanCausalStages:
        components = cls.components_for(stages)
        return cls(
            WanCausalModel(arch, preset=preset, device=device, dtype=dtype, components=components), stages
        )

    def state_layout(self) -> Layout:
        return self.model.state_layout()  # type: ignore[attr-defined]

    def init_diffusion_state(self, state: SessionState, seed: int, embeddings: torch.Tensor) -> None:
        state.tensors["prompt_embeds"].copy_(embeddings)
        state.meta["frames_written"] = 0

    def weight_modules(self) -> list[torch.nn.Module]:
        net = self.net
        return [part for part in (net.text_encoder, net.transformer, net.vae) if part is not None]
