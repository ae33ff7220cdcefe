"""Stage adapter of the Wan2.1 causal model (``workers.runtime.models.wan_causal``).

How ``WanCausalModel.generate`` composes the stages:
- encode: UMT5 (padding zeroed) and the DiT's text projection → ``prompt_embeds`` ``[text_len, dim]``;
- diffuse: the few-step sampler over the DiT with the session's KV ring and latent window (and
  LongLive's re-cache when a new prompt's embeddings arrive) → clean latents ``[F, C, h, w]``;
- decode: the causal VAE with the ``vae_cache.*`` tensors as the per-session decoder cache.

The stages are the model's own methods; a stage worker's model loads only its stages' components
(`WanCausalNetwork`: an encode-only worker holds UMT5 and the text projection, a ``DC`` worker no
text encoder and no text projection). A Wan preset names a checkpoint directory (``MODEL_PATHS``,
`register_model_path`): ``from_preset`` builds from the preset's architecture (``build_staged``), and
a stage worker process registers the directory under the preset's name first (``--model-path``).
"""

from __future__ import annotations

from typing import Any

import torch

from contracts.catalog.local_paths import WanCausalArchitecture
from contracts.catalog.presets import PRESETS
from workers.runtime.models import UnknownPresetError
from workers.runtime.models.base import DTYPES_BY_NAME, Layout, SessionState
from workers.runtime.models.wan_causal import WanCausalModel, component_weight_bytes
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

    @classmethod
    def from_preset(
        cls,
        preset: str,
        *,
        stages: tuple[Stage, ...],
        device: str | torch.device = "cpu",
        dtype: str | None = None,
        weights: Any = None,
        **_: Any,
    ) -> WanCausalStages:
        """``build_staged``'s entry: the stages of the registered Wan preset ``preset``."""
        if weights is not None:
            raise ValueError(
                "the Wan adapter loads from its checkpoint directory, not from transferred weights"
            )
        return cls.build(architecture(preset), preset=preset, stages=stages, device=device, dtype=dtype)

    @classmethod
    def stage_weight_bytes(cls, preset: str, *, dtype: str = "bfloat16") -> dict[str, int]:
        """Bytes of weights of each stage in ``dtype`` (default: the serving dtype on a GPU), from
        the checkpoint directory's configs on the meta device. The DiT's text projection counts
        towards encode: the encode stage runs it and only a worker hosting encode loads it."""
        parts = component_weight_bytes(architecture(preset), DTYPES_BY_NAME[dtype])
        return {
            Stage.ENCODE.value: parts["text_encoder"] + parts["text_projection"],
            Stage.DIFFUSE.value: parts["transformer"],
            Stage.DECODE.value: parts["vae"],
        }

    def state_layout(self) -> Layout:
        return self.model.state_layout()  # type: ignore[attr-defined]

    def init_diffusion_state(self, state: SessionState, seed: int, embeddings: torch.Tensor) -> None:
        state.tensors["prompt_embeds"].copy_(embeddings)
        state.meta["frames_written"] = 0

    def weight_modules(self) -> list[torch.nn.Module]:
        net = self.net
        return [part for part in (net.text_encoder, net.transformer, net.vae) if part is not None]


def architecture(preset: str) -> WanCausalArchitecture:
    entry = PRESETS.get(preset)
    if entry is None or not isinstance(entry.architecture, WanCausalArchitecture):
        raise UnknownPresetError(f"{preset!r} is not a Wan causal preset (register it with MODEL_PATHS)")
    return entry.architecture
