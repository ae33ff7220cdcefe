"""The demo model: a small trained causal video model that follows its prompt (preset ``demo``).

It draws what its prompt names — a shape of a colour on a background, moving in a direction at a
speed (``demo_data``: "a red circle moving left on a blue background") — chunk by chunk, and
conditions every chunk on the prompt in force at that chunk, so a new prompt changes the video from
the next chunk while the object carries on from where it was.

Architecture (about 40 k parameters, trained by ``python manage.py train_demo_model``):
- Text encoder: words → ids from a vocabulary built in code (``demo_data.VOCAB``), an embedding,
  a GRU over the words (so a word knows what came before it, e.g. "on" before a background colour),
  and slot attention pooling: `slots` learned queries attend over the words with GRU-informed keys
  and read back the *word embeddings*, so each slot picks words rather than mixing contexts (this
  is what lets it generalise to combinations of words it never saw together).
- Heads from the pooled text features: foreground and background RGB, a per-frame displacement
  (the motion), and a shape code.
- A causal latent: the object's position on the frame (a point on the torus), kept in the session's
  state region and advanced by the predicted displacement every frame. During training this latent
  is the clip's ground-truth track (teacher forcing); at generation it comes from the model alone.
- An implicit decoder: an MLP from (pixel offset to the object, shape code) to coverage, evaluated on
  the pixels of a patch around the object and composited over the background colour. The decoder is
  resolution-independent; it renders `width × height` directly.

The session's state region holds the position latent and the active prompt's text features; meta
holds the seed, the chunk counter and the prompt schedule (the same contract and keys as
``causal_dit``), so offload, migration and checkpoints work unchanged and byte-exact. The seed picks
the starting position (splitmix64(seed, ...) → a CPU generator), so it never depends on the batch.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch
from torch import nn

from contracts.catalog.presets import DEMO_MAX_JOB_FRAMES, DemoArchitecture
from contracts.catalog.presets import PRESETS as MODEL_PRESETS
from workers.runtime.models import UnknownPresetError
from workers.runtime.models.base import (
    JobSpecError,
    SessionState,
    StagewiseModel,
    allocate_region,
    region_offsets,
    splitmix64,
)
from workers.runtime.models.demo_data import MAX_TOKENS, OBJECT_EXTENT, PAD, VOCAB, tokenize

# The decoder draws the object inside a box of ± CUTOFF (fraction of the frame) around its position;
# everything outside is background, in training as in generation.
CUTOFF = 1.35 * OBJECT_EXTENT
MAX_STEP = 0.1  # largest displacement per frame the motion head can express (fraction of the frame)

PRESETS: dict[str, DemoArchitecture] = {
    name: preset.architecture
    for name, preset in MODEL_PRESETS.items()
    if isinstance(preset.architecture, DemoArchitecture)
}
WEIGHTS_DIR = Path(__file__).resolve().parent


class DemoNetwork(nn.Module):
    def __init__(self, cfg: DemoArchitecture) -> None:
        super().__init__()
        e, h, k = cfg.embed_dim, cfg.hidden, cfg.slots
        self.embed = nn.Embedding(len(VOCAB), e, padding_idx=PAD)
        self.gru = nn.GRU(e, e, batch_first=True)
        self.key = nn.Linear(2 * e, e)
        self.queries = nn.Parameter(torch.randn(k, e) / math.sqrt(e))
        features = k * e
        self.fg = nn.Sequential(nn.Linear(features, h), nn.SiLU(), nn.Linear(h, 3))
        self.bg = nn.Sequential(nn.Linear(features, h), nn.SiLU(), nn.Linear(h, 3))
        self.motion = nn.Sequential(nn.Linear(features, h), nn.SiLU(), nn.Linear(h, 2))
        self.shape = nn.Linear(features, cfg.shape_dim)
        self.mask = nn.Sequential(
            nn.Linear(2 + cfg.shape_dim, h),
            nn.ReLU(),
            nn.Linear(h, h),
            nn.ReLU(),
            nn.Linear(h, h),
            nn.ReLU(),
            nn.Linear(h, 1),
        )

    def text_features(self, ids: torch.Tensor) -> torch.Tensor:
        """Token ids [B, L] → pooled features [B, slots * embed_dim]."""
        words = self.embed(ids)
        context, _ = self.gru(words)
        keys = self.key(torch.cat([words, context], dim=-1))  # [B, L, E]
        scores = torch.einsum("ke,ble->bkl", self.queries, keys) / math.sqrt(keys.shape[-1])
        scores = scores.masked_fill((ids == PAD)[:, None, :], float("-inf"))
        slots = torch.einsum("bkl,ble->bke", scores.softmax(-1), words)
        return slots.flatten(1)

    def heads(self, features: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """(foreground RGB [B, 3] in [0, 1], background RGB, displacement per frame [B, 2], shape code)."""
        fg = torch.sigmoid(self.fg(features))
        bg = torch.sigmoid(self.bg(features))
        step = MAX_STEP * torch.tanh(self.motion(features))
        return fg, bg, step, self.shape(features)

    def coverage(self, offsets: torch.Tensor, code: torch.Tensor) -> torch.Tensor:
        """Coverage in [0, 1] of points at `offsets` [B, N, 2] (fraction of the frame, from the object's
        centre) for shape codes [B, S]; zero outside the ± CUTOFF box."""
        b, n, _ = offsets.shape
        x = torch.cat([offsets / OBJECT_EXTENT, code[:, None, :].expand(b, n, code.shape[-1])], dim=-1)
        alpha = torch.sigmoid(self.mask(x).squeeze(-1))
        return alpha * (offsets.abs().amax(-1) < CUTOFF)


class DemoModel(StagewiseModel):
    """`StreamingVideoModel` around `DemoNetwork` (see the module docstring), generating as its
    stages (`StagewiseModel`): encode = the text encoder, diffuse = the heads and the track, decode =
    the implicit decoder."""

    # The network's top-level components of each stage (what a stage-only worker loads).
    STAGE_COMPONENTS = {
        "E": ("embed", "gru", "key", "queries"),
        "D": ("fg", "bg", "motion", "shape"),
        "C": ("mask",),
    }

    def __init__(
        self,
        cfg: DemoArchitecture,
        *,
        preset: str,
        device: str | torch.device = "cpu",
        net: DemoNetwork | None = None,
        weights_path: str | Path | None = None,
        weights: Mapping[str, torch.Tensor] | None = None,
    ) -> None:
        self.cfg = cfg
        self.preset = preset
        self.device = torch.device(device)
        if self.device.type == "cuda" and self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())
        self.width, self.height, self.fps = cfg.width, cfg.height, cfg.fps
        self.frames_per_chunk = cfg.frames_per_chunk
        if weights is not None:
            if net is not None or weights_path is not None:
                raise ValueError("pass one of net, weights or weights_path")
            # Weights received from the parameter pool (workers.runtime.weights): adopted as they
            # are, no copy and no read of the shipped file.
            net = DemoNetwork(cfg)
            net.load_state_dict(weights, strict=True, assign=True)
        if net is None:
            path = Path(weights_path) if weights_path is not None else WEIGHTS_DIR / cfg.weights
            if not path.is_file():
                raise FileNotFoundError(
                    f"demo model weights {path} are missing; train them with "
                    "`python manage.py train_demo_model --seed 0`"
                )
            from safetensors.torch import load_file

            net = DemoNetwork(cfg)
            net.load_state_dict(load_file(str(path)), strict=True)
        self.net = net.to(self.device).eval().requires_grad_(False)
        self.feature_dim = cfg.slots * cfg.embed_dim
        # The decoder's patch: pixels within ± CUTOFF of the object (plus one for rounding).
        self.patch_x, self.patch_y = _patch(cfg.width, cfg.height)
        if 2 * self.patch_x > cfg.width or 2 * self.patch_y > cfg.height:
            raise ValueError("frame too small for the demo model's object patch")

    @classmethod
    def from_preset(
        cls,
        preset: str,
        *,
        device: str | torch.device = "cpu",
        weights_path: str | None = None,
        weights: Mapping[str, torch.Tensor] | None = None,
        dtype: str | None = None,
        **_ignored: Any,
    ) -> DemoModel:
        if preset not in PRESETS:
            raise UnknownPresetError(
                f"unknown demo preset {preset!r}; available presets: {', '.join(sorted(PRESETS))}"
            )
        if dtype not in (None, "float32"):
            raise ValueError(f"the demo model runs in float32 only, not {dtype!r}")
        return cls(PRESETS[preset], preset=preset, device=device, weights_path=weights_path, weights=weights)

    def save_weights(self, path: str | Path) -> None:
        from safetensors.torch import save_file

        save_file({k: v.contiguous().cpu() for k, v in self.net.state_dict().items()}, str(path))

    def describe(self) -> dict[str, Any]:
        return {
            "preset": self.preset,
            "config": asdict(self.cfg),
            "parameters": sum(p.numel() for p in self.net.parameters()),
            "state_bytes": self.state_bytes_for(),
            "width": self.width,
            "height": self.height,
            "fps": self.fps,
            "frames_per_chunk": self.frames_per_chunk,
            "device": str(self.device),
        }

    # -- state regions -------------------------------------------------------------------------

    def _layout(self) -> list[tuple[str, tuple[int, ...], torch.dtype]]:
        return [("position", (2,), torch.float32), ("text_features", (self.feature_dim,), torch.float32)]

    def expected_layout(self, meta: dict[str, Any]) -> list[tuple[str, tuple[int, ...], torch.dtype]]:
        for key in ("seed", "next_chunk", "prompt_schedule", "active_prompt"):
            if key not in meta:
                raise KeyError(f"meta lacks {key!r}")
        if int(meta["next_chunk"]) < 0:
            raise ValueError("the chunk counter must be non-negative")
        return self._layout()

    def state_bytes_for(self, options: dict[str, Any] | None = None) -> int:
        _check_options(options)

        return region_offsets(self._layout())[1]

    def create_state(
        self, prompt: str, seed: int, options: dict[str, Any] | None = None, *, start_chunk: int = 0
    ) -> SessionState:
        _check_options(options)
        region, tensors = allocate_region(self._layout(), self.device)
        region.zero_()
        self.init_state(tensors, seed, self.encode_prompt(prompt))
        meta = self.session_meta(prompt, seed, options, start_chunk)
        return SessionState(tensors=tensors, meta=meta, region=region)

    @torch.inference_mode()
    def encode_prompt(self, prompt: str) -> torch.Tensor:
        """Text features of one prompt, always encoded alone so they never depend on other sessions."""
        ids = torch.tensor([tokenize(prompt, MAX_TOKENS)], device=self.device)
        return self.net.text_features(ids)[0]

    # -- generation ----------------------------------------------------------------------------

    @torch.inference_mode()
    def diffuse(self, states: list[SessionState], embeddings: list[torch.Tensor | None]) -> torch.Tensor:
        """The diffuse stage: the heads and the object's track for the chunk, advancing the position
        latent; ``embeddings[i]`` (when not None) replaces the session's text features first. The
        latents (the hand-off to decode) are one float32 vector per session: the chunk's object
        centres ``[T, 2]``, then foreground and background RGB and the shape code."""
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
    def decode(self, latents: torch.Tensor, caches: list[dict[str, torch.Tensor]]) -> torch.Tensor:
        """The decode stage: render the track (the decoder keeps no per-session cache)."""
        t = self.frames_per_chunk
        centres = latents[:, : 2 * t].reshape(-1, t, 2)
        fg, bg, code = (
            latents[:, 2 * t : 2 * t + 3],
            latents[:, 2 * t + 3 : 2 * t + 6],
            latents[:, 2 * t + 6 :],
        )
        return self.render(centres, fg, bg, code)

    def init_state(self, tensors: dict[str, torch.Tensor], seed: int, embeddings: torch.Tensor) -> None:
        """Fill a zeroed state region: the seed's start position and the prompt's text features."""
        tensors["position"].copy_(_start_position(seed))
        tensors["text_features"].copy_(embeddings)

    def render(
        self,
        centres: torch.Tensor,
        fg: torch.Tensor,
        bg: torch.Tensor,
        code: torch.Tensor,
        *,
        width: int | None = None,
        height: int | None = None,
    ) -> torch.Tensor:
        """Frames uint8 [B, T, H, W, 3] with the object at `centres` [B, T, 2] (fractions, x then y)."""
        return quantize(self.render_float(centres, fg, bg, code, width=width, height=height))

    def render_float(
        self,
        centres: torch.Tensor,
        fg: torch.Tensor,
        bg: torch.Tensor,
        code: torch.Tensor,
        *,
        width: int | None = None,
        height: int | None = None,
    ) -> torch.Tensor:
        """RGB in [0, 1], float [B, T, H, W, 3], at `width × height` (the preset's size by default)."""
        b, t, _ = centres.shape
        w, h = width or self.width, height or self.height
        px, py = _patch(w, h)
        flat = centres.reshape(b * t, 2)
        # Pixel columns/rows of each frame's patch (unwrapped), and their centres' offsets.
        base_x = torch.floor(flat[:, 0] * w).long()[:, None] + torch.arange(-px, px, device=self.device)
        base_y = torch.floor(flat[:, 1] * h).long()[:, None] + torch.arange(-py, py, device=self.device)
        off_x = (base_x.float() + 0.5) / w - flat[:, :1]  # [BT, 2px]
        off_y = (base_y.float() + 0.5) / h - flat[:, 1:]  # [BT, 2py]
        offsets = torch.stack(
            [off_x[:, None, :].expand(-1, 2 * py, -1), off_y[:, :, None].expand(-1, -1, 2 * px)], dim=-1
        ).reshape(b, t * 4 * px * py, 2)
        alpha = self.net.coverage(offsets, code).reshape(b * t, 4 * py * px)
        index = (torch.remainder(base_y, h)[:, :, None] * w + torch.remainder(base_x, w)[:, None, :]).reshape(
            b * t, -1
        )
        canvas = torch.zeros(b * t, h * w, device=self.device).scatter_(1, index, alpha)
        canvas = canvas.view(b, t, h, w, 1)
        return bg[:, None, None, None, :] + canvas * (fg - bg)[:, None, None, None, :]

    # -- one-shot jobs (issue 14) ---------------------------------------------------------------
    # The "denoiser" predicts the clean frames by rendering the prompt's object along its track
    # from the seed's start position (at the job's own size); `advance_jobs` blends the latents
    # towards that prediction with fresh noise, so after the last step they are exactly the render.

    MIN_JOB_SIDE = 32  # the object's patch (± CUTOFF) must fit in the frame
    MAX_JOB_SIDE = 512
    MAX_JOB_FRAMES = DEMO_MAX_JOB_FRAMES  # the catalogue's: the control plane checks it too

    def check_job(self, *, kind: str, width: int, height: int, frames: int, steps: int) -> None:
        self.check_job_common(kind=kind, width=width, height=height, frames=frames, steps=steps)
        for name, value in (("width", width), ("height", height)):
            if not self.MIN_JOB_SIDE <= value <= self.MAX_JOB_SIDE:
                raise JobSpecError(name, f"must be between {self.MIN_JOB_SIDE} and {self.MAX_JOB_SIDE}")
        if frames > self.MAX_JOB_FRAMES:
            raise JobSpecError("frames", f"at most {self.MAX_JOB_FRAMES} for {self.preset!r}")

    def job_layout(self, meta: dict[str, Any]) -> list[tuple[str, tuple[int, ...], torch.dtype]]:
        shape = (int(meta["frames"]), int(meta["height"]), int(meta["width"]), 3)
        return [
            ("latents", shape, torch.float32),
            ("text_features", (self.feature_dim,), torch.float32),
            ("position", (2,), torch.float32),
        ]

    def init_job(self, tensors: dict[str, torch.Tensor], seed: int, embeddings: torch.Tensor) -> None:
        self.init_state(tensors, seed, embeddings)

    @torch.inference_mode()
    def job_step(self, states: list[SessionState]) -> None:
        if not states:
            return
        self.check_job_batch(states)
        _kind, width, height, frames = self.job_shape(states[0].meta)
        fg, bg, step, code = self.net.heads(torch.stack([s.tensors["text_features"] for s in states]))
        start = torch.stack([s.tensors["position"] for s in states])
        ticks = torch.arange(frames, device=self.device, dtype=torch.float32)
        centres = torch.remainder(start[:, None, :] + ticks[None, :, None] * step[:, None, :], 1.0)
        self.check_abandon()  # a block boundary: after the heads, before the render
        rendered = self.render_float(centres, fg, bg, code, width=width, height=height)
        self.check_abandon()  # and after it (`advance_jobs` checks once more after the noise)
        self.advance_jobs(states, rendered)

    def job_frames(self, state: SessionState) -> torch.Tensor:
        return quantize(state.tensors["latents"])


def quantize(rgb: torch.Tensor) -> torch.Tensor:
    """RGB in [0, 1] → uint8."""
    return (rgb * 255.0).round().clamp(0, 255).to(torch.uint8)


def _patch(width: int, height: int) -> tuple[int, int]:
    """Half-size in pixels of the decoder's patch (± CUTOFF of the frame, plus one for rounding)."""
    return math.ceil(CUTOFF * width) + 1, math.ceil(CUTOFF * height) + 1


def _start_position(seed: int) -> torch.Tensor:
    """The object's start position (fractions of the frame) for a seed, from a CPU generator."""
    generator = torch.Generator(device="cpu").manual_seed(splitmix64(int(seed), 0xDE30))
    return torch.rand(2, generator=generator, dtype=torch.float32)


def _check_options(options: dict[str, Any] | None) -> None:
    if options:
        raise ValueError(f"the demo model takes no per-session options, got {sorted(options)}")


__all__ = ["CUTOFF", "PRESETS", "DemoModel", "DemoNetwork"]
