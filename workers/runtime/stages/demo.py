"""Stage adapter of the demo model (``workers.runtime.models.demo``).

How ``DemoModel.generate`` composes the stages:
- encode: the text encoder (``embed``, ``gru``, ``key``, ``queries``) → pooled text features;
- diffuse: the heads (``fg``, ``bg``, ``motion``, ``shape``) → colours, displacement and shape code,
  and the object's track for the chunk, advancing the position latent kept in the state;
- decode: the implicit decoder (``mask``) renders the track. It keeps no per-session cache.

The hand-off between diffuse and decode ("latents") is one float32 vector per session: the chunk's
object centres ``[T, 2]``, then foreground and background RGB and the shape code, concatenated.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from workers.runtime.models import UnknownPresetError
from workers.runtime.models.base import Layout, SessionState, splitmix64
from workers.runtime.models.demo import PRESETS, WEIGHTS_DIR, DemoModel, DemoNetwork
from workers.runtime.stages.contract import DecoderCache, Stage, StagedModel
from workers.runtime.stages.partial import (
    component_bytes,
    load_subset,
    load_subset_from_file,
    partial_network,
)


class DemoStages(StagedModel):
    COMPONENTS = {
        Stage.ENCODE: ("embed", "gru", "key", "queries"),
        Stage.DIFFUSE: ("fg", "bg", "motion", "shape"),
        Stage.DECODE: ("mask",),
    }

    def __init__(self, model: DemoModel, stages: tuple[Stage, ...]) -> None:
        self.model = model
        self.net = model.net
        self.preset = model.preset
        self.device = model.device
        self.stages = frozenset(stages)
        self.frames_per_chunk = model.frames_per_chunk

    @classmethod
    def from_preset(
        cls,
        preset: str,
        *,
        stages: tuple[Stage, ...],
        device: str | torch.device = "cpu",
        weights_path: str | None = None,
        weights: Mapping[str, torch.Tensor] | None = None,
    ) -> DemoStages:
        cfg = _config(preset)
        keep = [name for stage in stages for name in cls.COMPONENTS[stage]]
        # Built on the CPU and moved by DemoModel, as the monolithic model's weights are.
        net = partial_network(lambda: DemoNetwork(cfg), keep, torch.device("cpu"))
        if weights is None:
            path = weights_path or str(WEIGHTS_DIR / cfg.weights)
            load_subset_from_file(net, path, torch.device("cpu"))
        else:
            load_subset(net, weights, "the given weights")
        return cls(DemoModel(cfg, preset=preset, device=device, net=net), stages)

    @classmethod
    def stage_weight_bytes(cls, preset: str) -> dict[str, int]:
        with torch.device("meta"):
            net = DemoNetwork(_config(preset))
        return {stage.value: component_bytes(net, names) for stage, names in cls.COMPONENTS.items()}

    @classmethod
    def handoff_layout(cls, preset: str) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        """Shape and dtype of one session's embeddings and latents (what crosses a stage link)."""
        cfg = _config(preset)
        return {
            "embeddings": ((cfg.slots * cfg.embed_dim,), torch.float32),
            "latents": ((2 * cfg.frames_per_chunk + 6 + cfg.shape_dim,), torch.float32),
        }

    # -- the stages ----------------------------------------------------------------------------

    def encode(self, prompt: str) -> torch.Tensor:
        self.require(Stage.ENCODE)
        return self.model.encode_prompt(prompt)

    def diffusion_layout(self) -> Layout:
        return self.model._layout()

    def decoder_cache_layout(self) -> Layout:
        return []

    def init_diffusion_state(self, state: SessionState, seed: int, embeddings: torch.Tensor) -> None:
        # DemoModel.create_state: the start position from the session's own counter-based generator.
        generator = torch.Generator(device="cpu").manual_seed(splitmix64(int(seed), 0xDE30))
        state.tensors["position"].copy_(torch.rand(2, generator=generator, dtype=torch.float32))
        state.tensors["text_features"].copy_(embeddings)

    @torch.inference_mode()
    def diffuse(self, states: list[SessionState], embeddings: list[torch.Tensor | None]) -> torch.Tensor:
        self.require(Stage.DIFFUSE)
        for state, encoded in zip(states, embeddings, strict=True):
            if encoded is not None:
                state.tensors["text_features"].copy_(encoded)
        features = torch.stack([s.tensors["text_features"] for s in states])
        start = torch.stack([s.tensors["position"] for s in states])  # [B, 2]
        fg, bg, step, code = self.net.heads(features)
        t = self.frames_per_chunk
        ticks = torch.arange(t, device=self.device, dtype=torch.float32)
        centres = torch.remainder(start[:, None, :] + ticks[None, :, None] * step[:, None, :], 1.0)
        new_positions = torch.remainder(start + t * step, 1.0)
        for i, state in enumerate(states):
            state.tensors["position"].copy_(new_positions[i])
            state.meta["next_chunk"] = state.next_chunk + 1
        return torch.cat([centres.flatten(1), fg, bg, code], dim=1)

    @torch.inference_mode()
    def decode(self, latents: torch.Tensor, caches: list[DecoderCache]) -> torch.Tensor:
        self.require(Stage.DECODE)
        t = self.frames_per_chunk
        centres = latents[:, : 2 * t].reshape(-1, t, 2)
        fg, bg, code = (
            latents[:, 2 * t : 2 * t + 3],
            latents[:, 2 * t + 3 : 2 * t + 6],
            latents[:, 2 * t + 6 :],
        )
        return self.model.render(centres, fg, bg, code)


def _config(preset: str) -> Any:
    if preset not in PRESETS:
        raise UnknownPresetError(
            f"unknown demo preset {preset!r}; available presets: {', '.join(sorted(PRESETS))}"
        )
    return PRESETS[preset]
