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
``latent_history`` alone. Diffuse and decode reuse the model's own helpers (noise per (seed, chunk),
cache plan, ring slots, the DiT forward), so only the loop that strings them together is restated
here, and ``tests/workers_runtime/test_stages.py`` checks it against ``generate`` bit for bit.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from workers.runtime.models import UnknownPresetError
from workers.runtime.models.base import Layout, SessionState
from workers.runtime.models.causal_dit import (
    PRESETS,
    CausalDiTConfig,
    CausalDiTModel,
    CausalDiTNetwork,
    rope_tables,
    seeded_init,
)
from workers.runtime.stages.contract import DecoderCache, Stage, StagedModel
from workers.runtime.stages.partial import (
    component_bytes,
    load_subset,
    load_subset_from_file,
    partial_network,
)

DECODER_CACHE = ("latent_history",)


class _SubsetModel(CausalDiTModel):
    """A `CausalDiTModel` whose network holds only the components ``keep`` (the others are None)."""

    def __init__(
        self,
        cfg: CausalDiTConfig,
        *,
        preset: str,
        keep: list[str],
        device: str | torch.device,
        weights_seed: int,
        weights_path: str | None,
        weights: Mapping[str, torch.Tensor] | None,
    ) -> None:
        # Not CausalDiTModel.__init__: it allocates every component. Same attributes, same order of
        # initialisation (materialise on the device, load or seed, then cast), for a subset.
        self.cfg = cfg
        self.preset = preset
        self.device = torch.device(device)
        if self.device.type == "cuda" and self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())
        self.dtype = cfg.torch_dtype
        self.width, self.height, self.fps = cfg.width, cfg.height, cfg.fps
        self.frames_per_chunk = cfg.video_frames_per_chunk
        net = partial_network(lambda: CausalDiTNetwork(cfg), keep, self.device)
        if weights is not None:
            load_subset(net, weights, "the given weights")
        elif weights_path is not None:
            load_subset_from_file(net, weights_path, self.device)
        else:
            seeded_init(net, weights_seed)
        self.net = net.to(self.dtype).eval().requires_grad_(False)
        steps = cfg.denoising_steps
        self.sigmas = [1.0 - i / steps for i in range(steps)]


class CausalDiTStages(StagedModel):
    COMPONENTS = {Stage.ENCODE: ("text",), Stage.DIFFUSE: ("dit",), Stage.DECODE: ("decoder",)}

    def __init__(self, model: CausalDiTModel, stages: tuple[Stage, ...]) -> None:
        self.model = model
        self.net = model.net
        self.cfg = model.cfg
        self.preset = model.preset
        self.device = model.device
        self.stages = frozenset(stages)

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
        keep = [name for stage in stages for name in cls.COMPONENTS[stage]]
        model = _SubsetModel(
            _config(preset),
            preset=preset,
            keep=keep,
            device=device,
            weights_seed=weights_seed,
            weights_path=weights_path,
            weights=weights,
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

    # -- the stages ----------------------------------------------------------------------------

    def encode(self, prompt: str) -> torch.Tensor:
        self.require(Stage.ENCODE)
        return self.model.encode_prompt(prompt)

    def diffusion_layout(self) -> Layout:
        return [entry for entry in self.cfg.state_layout() if entry[0] not in DECODER_CACHE]

    def decoder_cache_layout(self) -> Layout:
        return [entry for entry in self.cfg.state_layout() if entry[0] in DECODER_CACHE]

    def init_diffusion_state(self, state: SessionState, seed: int, embeddings: torch.Tensor) -> None:
        state.tensors["prompt_embeds"].copy_(embeddings)
        state.meta["frames_written"] = 0

    @torch.inference_mode()
    def diffuse(self, states: list[SessionState], embeddings: list[torch.Tensor | None]) -> torch.Tensor:
        """The middle of ``CausalDiTModel.generate``: noise, denoising loop, cache pass."""
        self.require(Stage.DIFFUSE)
        model, cfg = self.model, self.cfg
        fpc = cfg.frames_per_chunk
        latent_shape = (fpc, cfg.latent_channels, cfg.latent_height, cfg.latent_width)
        chunk_indices = [s.next_chunk for s in states]
        for state, encoded in zip(states, embeddings, strict=True):
            if encoded is not None:
                state.tensors["prompt_embeds"].copy_(encoded)
        generators = [model.chunk_noise(s, c) for s, c in zip(states, chunk_indices, strict=True)]
        per_session = [
            torch.stack([torch.randn(latent_shape, generator=g) for _ in model.sigmas]) for g in generators
        ]
        noise_all = torch.stack(per_session, dim=1).to(self.device)  # [draws, B, F, C, h, w]
        context = torch.stack([s.tensors["prompt_embeds"] for s in states])
        frames_written = [int(s.meta["frames_written"]) for s in states]
        positions = torch.tensor(
            [[c * fpc + i for i in range(fpc)] for c in chunk_indices], dtype=torch.float64
        )
        rope = rope_tables(cfg, positions, self.device)
        cache = model._gather_cache_plan(states, frames_written)
        x = noise_all[0]
        for step, sigma in enumerate(model.sigmas):
            velocity = model._forward(x, sigma, context, rope, states, cache, write_slots=None)
            x0 = x - sigma * velocity
            if step + 1 < len(model.sigmas):
                nxt = model.sigmas[step + 1]
                x = (1.0 - nxt) * x0 + nxt * noise_all[step + 1]
            else:
                x = x0
        slots = torch.tensor([model._ring_slots(fw) for fw in frames_written]).to(self.device)
        model._forward(x, 0.0, context, rope, states, cache, write_slots=slots)
        for i, state in enumerate(states):
            state.meta["frames_written"] = frames_written[i] + fpc
            state.meta["next_chunk"] = chunk_indices[i] + 1
        return x

    @torch.inference_mode()
    def decode(self, latents: torch.Tensor, caches: list[DecoderCache]) -> torch.Tensor:
        self.require(Stage.DECODE)
        dtype = self.model.dtype
        previous = torch.stack([cache["latent_history"] for cache in caches])
        frames = self.net.decoder(latents.to(dtype), previous.to(dtype))
        for i, cache in enumerate(caches):
            cache["latent_history"].copy_(latents[i, -1])
        return frames


def _config(preset: str) -> CausalDiTConfig:
    if preset not in PRESETS:
        raise UnknownPresetError(
            f"unknown causal-dit preset {preset!r}; available presets: {', '.join(sorted(PRESETS))}"
        )
    return PRESETS[preset]
