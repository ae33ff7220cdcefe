"""Stage adapter of the demo model (``workers.runtime.models.demo``).

How ``DemoModel.generate`` composes the stages:
- encode: the text encoder (``embed``, ``gru``, ``key``, ``queries``) → pooled text features;
- diffuse: the heads (``fg``, ``bg``, ``motion``, ``shape``) → colours, displacement and shape code,
  and the object's track for the chunk, advancing the position latent kept in the state;
- decode: the implicit decoder (``mask``) renders the track. It keeps no per-session cache.

The stages are the model's own methods (``DemoModel.diffuse`` and ``decode``, which its ``generate``
calls in a row); the hand-off between them ("latents") is one float32 vector per session: the
chunk's object centres ``[T, 2]``, then foreground and background RGB and the shape code.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from workers.runtime.models import UnknownPresetError
from workers.runtime.models.base import Layout, SessionState
from workers.runtime.models.demo import PRESETS, WEIGHTS_DIR, DemoModel, DemoNetwork
from workers.runtime.models.partial import (
    component_bytes,
    load_subset,
    load_subset_from_file,
    partial_network,
)
from workers.runtime.stages.contract import Stage, StagedModel


class DemoStages(StagedModel):
    COMPONENTS = {stage: DemoModel.STAGE_COMPONENTS[stage.value] for stage in Stage}
    # The demo's one-shot "denoiser" renders its prediction with the decoder's coverage network.
    JOB_STEP_STAGES = (Stage.DIFFUSE, Stage.DECODE)

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
        keep = cls.components_for(stages)
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

    # -- the stages (the model's own methods, `StagedModel`) -----------------------------------

    def state_layout(self) -> Layout:
        return self.model._layout()

    def init_diffusion_state(self, state: SessionState, seed: int, embeddings: torch.Tensor) -> None:
        self.model.init_state(state.tensors, seed, embeddings)


def _config(preset: str) -> Any:
    if preset not in PRESETS:
        raise UnknownPresetError(
            f"unknown demo preset {preset!r}; available presets: {', '.join(sorted(PRESETS))}"
        )
    return PRESETS[preset]
