"""Reference streaming model: a causal video diffusion transformer (Self-Forcing / LongLive style).

Architecture (Wan2.1-shaped, scaled by preset):
- A latent chunk is `frames_per_chunk` latent frames of `latent_channels × latent_height ×
  latent_width`, patchified 1×p×p into tokens (Wan: 16×60×104, p=2 → 1,560 tokens per frame).
- Transformer blocks with adaLN timestep modulation; self-attention over the chunk's own tokens plus
  the session's rolling KV cache (block-causal: full attention inside the chunk, causal across
  chunks); cross-attention to prompt embeddings; a GELU MLP. 3-D RoPE on (frame, row, column), with
  the absolute latent frame index as the time position.
- The KV cache keeps `sink_frames` attention-sink frames (the first frames of the stream) and a
  ring buffer of the most recent `window_frames - sink_frames` frames (LongLive's frame sink + local
  window). Keys are cached after RoPE, so slot order inside the ring does not matter to attention.
- Each chunk is denoised in `denoising_steps` (4) flow-matching steps from noise, re-noising the x0
  prediction between steps with fresh noise (Self-Forcing's few-step sampler); then one more pass at
  t=0 over the clean chunk writes its keys/values into the cache.
- A small text encoder built from code: a byte-level tokenizer with hashed word ids, a small
  transformer, and a Linear-GELU-Linear projection to the model width. No downloads.
- A small decoder from latents to RGB: per latent frame, conv layers over (frame, previous frame)
  and a pixel shuffle that expands each latent frame to `temporal_upsample` video frames of
  `spatial_upsample`× the latent resolution.

Batching across sessions at different stream positions: every session keeps its own ring-buffer KV
cache in its state region. For a batched step the per-block caches are stacked into one padded batch;
sessions whose cache is not yet full get a boolean attention mask over the unwritten slots (when all
sessions have the same number of valid slots the cache is sliced instead and no mask is used).
Per-session RNG is counter-based: the noise of chunk c comes from a CPU `torch.Generator` seeded with
splitmix64(seed, c), so it depends only on (seed, chunk index), never on the batch or the device.
"""

from __future__ import annotations

import contextlib
import copy
import math
import zlib
from collections.abc import Callable, Collection, Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass, replace
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from contracts.catalog.presets import CAUSAL_DIT_MAX_JOB_LATENT_FRAMES, CausalDiTArchitecture
from contracts.catalog.presets import PRESETS as MODEL_PRESETS
from workers.runtime.accel import Accelerator
from workers.runtime.models import UnknownPresetError
from workers.runtime.models.base import (
    DTYPES_BY_NAME,
    JobSpecError,
    SessionState,
    StagewiseModel,
    allocate_region,
    few_step_sample,
    region_offsets,
    splitmix64,
)
from workers.runtime.models.kv_cache import KvCacheBatch, attention_over_cache
from workers.runtime.models.partial import load_subset, load_subset_from_file, partial_network

TEXT_VOCAB = 259  # 256 bytes + pad/bos/eos
WORD_BUCKETS = 1024
PAD, BOS, EOS = 0, 1, 2


@dataclass(frozen=True)
class CausalDiTConfig(CausalDiTArchitecture):
    """A preset's architecture (``contracts.catalog.presets``) with what the model derives from it."""

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES_BY_NAME[self.dtype]

    def state_layout(self) -> list[tuple[str, tuple[int, ...], torch.dtype]]:
        """The tensors of one session's state region, in manifest order."""
        return [
            (
                "kv_cache",
                (self.blocks, 2, self.window_frames, self.tokens_per_frame, self.dim),
                self.torch_dtype,
            ),
            ("prompt_embeds", (self.text_len, self.dim), self.torch_dtype),
            ("latent_history", (self.latent_channels, self.latent_height, self.latent_width), torch.float32),
        ]

    def state_bytes(self) -> int:
        """Analytic size of a state region: its flat buffer, alignment padding included (checked
        against real allocations in the tests)."""
        return region_offsets(self.state_layout())[1]

    def parameter_count(self) -> int:
        d, f, td = self.dim, self.ffn_dim, self.text_dim
        pdim = self.latent_channels * self.patch * self.patch
        block = 8 * (d * d + d) + 4 * d + 2 * d + 6 * d + 2 * d * f + f + d
        text_layer = 4 * (td * td + td) + 2 * td * 4 * td + 4 * td + td + 4 * td
        text = (TEXT_VOCAB + WORD_BUCKETS + self.text_len) * td + self.text_layers * text_layer
        text += 2 * td + td * d + d + d * d + d
        dit = pdim * d + d + 256 * d + d + d * d + d + d * 6 * d + 6 * d + self.blocks * block
        dit += 2 * d + d * pdim + pdim
        c, dd, s, tu = self.latent_channels, self.decoder_dim, self.spatial_upsample, self.temporal_upsample
        decoder = 2 * c * dd * 9 + dd + dd * dd * 9 + dd + dd * 3 * s * s * tu + 3 * s * s * tu
        return text + dit + decoder


# The causal-DiT presets of the one preset table, as this model's configurations.
PRESETS: dict[str, CausalDiTConfig] = {
    name: CausalDiTConfig(**asdict(preset.architecture))
    for name, preset in MODEL_PRESETS.items()
    if isinstance(preset.architecture, CausalDiTArchitecture)
}


def tokenize(prompt: str, text_len: int) -> tuple[list[int], list[int]]:
    """Byte-level token ids plus a hashed id of the word each byte belongs to (crc32, stable)."""
    data = prompt.encode("utf-8")[: text_len - 2]
    ids = [BOS] + [b + 3 for b in data] + [EOS]
    words = [0]
    for word in data.split(b" "):
        bucket = zlib.crc32(word.lower()) % (WORD_BUCKETS - 1) + 1
        words.extend([bucket] * len(word))
        words.append(0)  # the separating space (or EOS)
    words = words[: len(ids)]
    ids += [PAD] * (text_len - len(ids))
    words += [0] * (text_len - len(words))
    return ids, words


# -- layers ----------------------------------------------------------------------------------------


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype) * self.weight


class TextBlock(nn.Module):
    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.norm1 = nn.LayerNorm(dim)
        self.qkv = nn.Linear(dim, 3 * dim)
        self.out = nn.Linear(dim, dim)
        self.norm2 = nn.LayerNorm(dim)
        self.mlp = nn.Sequential(
            nn.Linear(dim, 4 * dim), nn.GELU(approximate="tanh"), nn.Linear(4 * dim, dim)
        )

    def forward(self, x: torch.Tensor, key_mask: torch.Tensor) -> torch.Tensor:
        b, n, d = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(b, n, 3, self.heads, d // self.heads).unbind(2)
        attn = F.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=key_mask[:, None, None, :]
        )
        x = x + self.out(attn.transpose(1, 2).reshape(b, n, d))
        return x + self.mlp(self.norm2(x))


class TextEncoder(nn.Module):
    def __init__(self, cfg: CausalDiTConfig) -> None:
        super().__init__()
        td = cfg.text_dim
        self.text_len = cfg.text_len
        # Uninitialised (``_weight``): the network is built on the meta device and its weights are
        # loaded or seeded (``seeded_init``) after, so Embedding's default normal_ init would be
        # thrown away — and on the meta device it runs PyTorch's Python reference, whose first use
        # imports torch._dynamo (~1 s of CPU at every worker's start).
        self.byte_embed = nn.Embedding(TEXT_VOCAB, td, _weight=torch.empty(TEXT_VOCAB, td))
        self.word_embed = nn.Embedding(WORD_BUCKETS, td, _weight=torch.empty(WORD_BUCKETS, td))
        self.pos_embed = nn.Parameter(torch.zeros(cfg.text_len, td))
        self.layers = nn.ModuleList(TextBlock(td, cfg.text_heads) for _ in range(cfg.text_layers))
        self.norm = nn.LayerNorm(td)
        # Wan's text_embedding: Linear → GELU → Linear into the DiT width.
        self.proj = nn.Sequential(
            nn.Linear(td, cfg.dim), nn.GELU(approximate="tanh"), nn.Linear(cfg.dim, cfg.dim)
        )

    def forward(self, ids: torch.Tensor, words: torch.Tensor) -> torch.Tensor:
        x = self.byte_embed(ids) + self.word_embed(words) + self.pos_embed
        key_mask = ids != PAD
        for layer in self.layers:
            x = layer(x, key_mask)
        return self.proj(self.norm(x))


class DiTBlock(nn.Module):
    def __init__(self, cfg: CausalDiTConfig) -> None:
        super().__init__()
        d = cfg.dim
        self.heads = cfg.heads
        self.modulation = nn.Parameter(torch.zeros(1, 6, d))
        self.norm1 = nn.LayerNorm(d, elementwise_affine=False, eps=1e-6)
        self.q, self.k, self.v, self.o = (nn.Linear(d, d) for _ in range(4))
        self.norm_q, self.norm_k = RMSNorm(d), RMSNorm(d)
        self.norm3 = nn.LayerNorm(d, eps=1e-6)
        self.cq, self.ck, self.cv, self.co = (nn.Linear(d, d) for _ in range(4))
        self.cnorm_q, self.cnorm_k = RMSNorm(d), RMSNorm(d)
        self.norm2 = nn.LayerNorm(d, elementwise_affine=False, eps=1e-6)
        self.ffn = nn.Sequential(
            nn.Linear(d, cfg.ffn_dim), nn.GELU(approximate="tanh"), nn.Linear(cfg.ffn_dim, d)
        )

    def forward(
        self,
        x: torch.Tensor,
        e: torch.Tensor,
        context: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor],
        cache_k: torch.Tensor | None,
        cache_v: torch.Tensor | None,
        cache_mask: torch.Tensor | None,
        attention: Callable[..., torch.Tensor] = F.scaled_dot_product_attention,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """One block over x [B, N, D]; returns (x, k, v) where k, v [B, N, D] are this chunk's
        RoPE'd keys/values (what the cache pass writes into the ring). ``attention(q, k, v, mask)``
        is the self-attention kernel (the model's `Accelerator.attention`)."""
        b, n, d = x.shape
        mod = self.modulations(e, b)
        q, k, v = self.self_attention_inputs(x, mod, rope)
        attn = attention_over_cache(q, k, v, cache_k, cache_v, cache_mask, attention=attention)
        x = self.after_attention(x, attn, mod, context)
        return x, k.reshape(b, n, d), v.reshape(b, n, d)

    # The block in its three parts, so that a sequence-parallel step (`CausalDiTModel.job_step`
    # across devices) can run every per-token part on its own shard and gather only keys/values.

    def modulations(self, e: torch.Tensor, b: int) -> tuple[torch.Tensor, ...]:
        """(shift1, scale1, gate1, shift2, scale2, gate2), each [B, 1, D]."""
        return (self.modulation + e.view(b, 6, -1)).chunk(6, dim=1)

    def self_attention_inputs(
        self, x: torch.Tensor, mod: tuple[torch.Tensor, ...], rope: tuple[torch.Tensor, torch.Tensor]
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q, k (RoPE'd) and v [B, N, H, hd] of the tokens x [B, N, D] (per token)."""
        b, n, d = x.shape
        h, hd = self.heads, d // self.heads
        shift1, scale1 = mod[0], mod[1]
        y = self.norm1(x) * (1 + scale1) + shift1
        q = apply_rope(self.norm_q(self.q(y)).view(b, n, h, hd), rope)
        k = apply_rope(self.norm_k(self.k(y)).view(b, n, h, hd), rope)
        return q, k, self.v(y).view(b, n, h, hd)

    def after_attention(
        self, x: torch.Tensor, attn: torch.Tensor, mod: tuple[torch.Tensor, ...], context: torch.Tensor
    ) -> torch.Tensor:
        """Output projection, cross-attention to the prompt and the MLP (per token);
        attn [B, H, N, hd] is the self-attention of x's tokens."""
        b, n, d = x.shape
        h, hd = self.heads, d // self.heads
        _shift1, _scale1, gate1, shift2, scale2, gate2 = mod
        x = x + gate1 * self.o(attn.transpose(1, 2).reshape(b, n, d))
        # Cross-attention to the prompt embeddings.
        y = self.norm3(x)
        cq = self.cnorm_q(self.cq(y)).view(b, n, h, hd)
        ck = self.cnorm_k(self.ck(context)).view(b, -1, h, hd)
        cv = self.cv(context).view(b, -1, h, hd)
        cross = F.scaled_dot_product_attention(cq.transpose(1, 2), ck.transpose(1, 2), cv.transpose(1, 2))
        x = x + self.co(cross.transpose(1, 2).reshape(b, n, d))
        return x + gate2 * self.ffn(self.norm2(x) * (1 + scale2) + shift2)


def run_block(
    block: DiTBlock,
    accel: Accelerator,
    x: torch.Tensor,
    e: torch.Tensor,
    context: torch.Tensor,
    rope: tuple[torch.Tensor, torch.Tensor],
    cache_k: torch.Tensor | None,
    cache_v: torch.Tensor | None,
    cache_mask: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One block call as `Accelerator.block` takes it: a plain function with the block module among
    its arguments, so every block shares one compiled function and one graph slot per shape."""
    return block(x, e, context, rope, cache_k, cache_v, cache_mask, attention=accel.attention)


def rope_axis_dims(head_dim: int) -> tuple[int, int, int]:
    """Wan's split of a head between (time, height, width) rotary frequencies."""
    hw = 2 * (head_dim // 6)
    return head_dim - 2 * hw, hw, hw


def rope_tables(
    cfg: CausalDiTConfig, frame_positions: torch.Tensor, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin tables [B, N, 1, head_dim/2] for tokens of frames `frame_positions` [B, F] (absolute)."""
    dt, dh, dw = rope_axis_dims(cfg.head_dim)
    gh, gw = cfg.latent_height // cfg.patch, cfg.latent_width // cfg.patch

    def freqs(dim: int) -> torch.Tensor:
        return 1.0 / (10000.0 ** (torch.arange(0, dim, 2, dtype=torch.float64, device=device) / dim))

    b, f = frame_positions.shape
    pos_t = frame_positions.to(device=device, dtype=torch.float64)[:, :, None, None]  # [B,F,1,1]
    ang_t = (pos_t * freqs(dt)).expand(b, f, gh * gw, dt // 2)
    rows = torch.arange(gh, device=device, dtype=torch.float64).repeat_interleave(gw)
    cols = torch.arange(gw, device=device, dtype=torch.float64).repeat(gh)
    ang_h = (rows[:, None] * freqs(dh)).expand(b, f, gh * gw, dh // 2)
    ang_w = (cols[:, None] * freqs(dw)).expand(b, f, gh * gw, dw // 2)
    angles = torch.cat([ang_t, ang_h, ang_w], dim=-1).reshape(b, f * gh * gw, 1, -1)
    return angles.cos().float(), angles.sin().float()


def apply_rope(x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    cos, sin = rope
    xf = x.float().unflatten(-1, (-1, 2))
    x1, x2 = xf[..., 0], xf[..., 1]
    out = torch.stack([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1).flatten(-2)
    return out.to(x.dtype)


def timestep_embedding(t: torch.Tensor, dim: int = 256) -> torch.Tensor:
    half = dim // 2
    freqs = torch.exp(-math.log(10000.0) * torch.arange(half, dtype=torch.float32, device=t.device) / half)
    args = t.float()[:, None] * freqs[None]
    return torch.cat([torch.cos(args), torch.sin(args)], dim=-1)


class CausalDiT(nn.Module):
    def __init__(self, cfg: CausalDiTConfig) -> None:
        super().__init__()
        d = cfg.dim
        pdim = cfg.latent_channels * cfg.patch * cfg.patch
        self.cfg = cfg
        self.patch_embed = nn.Linear(pdim, d)
        self.time_embed = nn.Sequential(nn.Linear(256, d), nn.SiLU(), nn.Linear(d, d))
        self.time_proj = nn.Sequential(nn.SiLU(), nn.Linear(d, 6 * d))
        self.blocks = nn.ModuleList(DiTBlock(cfg) for _ in range(cfg.blocks))
        self.head_modulation = nn.Parameter(torch.zeros(1, 2, d))
        self.head_norm = nn.LayerNorm(d, elementwise_affine=False, eps=1e-6)
        self.head = nn.Linear(d, pdim)


class LatentDecoder(nn.Module):
    def __init__(self, cfg: CausalDiTConfig) -> None:
        super().__init__()
        c, dd = cfg.latent_channels, cfg.decoder_dim
        self.s, self.tu = cfg.spatial_upsample, cfg.temporal_upsample
        self.conv1 = nn.Conv2d(2 * c, dd, 3, padding=1)
        self.conv2 = nn.Conv2d(dd, dd, 3, padding=1)
        self.out = nn.Conv2d(dd, 3 * self.s * self.s * self.tu, 1)

    def forward(self, latents: torch.Tensor, previous: torch.Tensor) -> torch.Tensor:
        """latents [B, F, C, h, w], previous [B, C, h, w] → uint8 frames [B, F*tu, H, W, 3]."""
        b, f, c, h, w = latents.shape
        prev = torch.cat([previous.unsqueeze(1), latents[:, :-1]], dim=1)
        x = torch.cat([latents, prev], dim=2).reshape(b * f, 2 * c, h, w)
        x = self.out(F.silu(self.conv2(F.silu(self.conv1(x)))))
        x = x.view(b * f * self.tu, 3 * self.s * self.s, h, w)
        rgb = torch.tanh(F.pixel_shuffle(x, self.s).float())  # [B*F*tu, 3, H, W]
        rgb = ((rgb + 1.0) * 127.5).round().clamp(0, 255).to(torch.uint8)
        return rgb.view(b, f * self.tu, 3, h * self.s, w * self.s).permute(0, 1, 3, 4, 2).contiguous()


class CausalDiTNetwork(nn.Module):
    def __init__(self, cfg: CausalDiTConfig) -> None:
        super().__init__()
        self.text = TextEncoder(cfg)
        self.dit = CausalDiT(cfg)
        self.decoder = LatentDecoder(cfg)


# -- the model -------------------------------------------------------------------------------------


class CausalDiTModel(StagewiseModel):
    """`StreamingVideoModel` implementation around `CausalDiTNetwork` (see the module docstring),
    generating as its stages (`StagewiseModel`): encode = ``net.text``, diffuse = the sampler over
    ``net.dit``, decode = ``net.decoder`` with ``latent_history`` as the decoder cache."""

    DECODER_CACHE = ("latent_history",)
    # The network's top-level component of each stage (what a stage-only worker loads).
    STAGE_COMPONENTS = {"E": ("text",), "D": ("dit",), "C": ("decoder",)}

    def __init__(
        self,
        cfg: CausalDiTConfig,
        *,
        preset: str,
        device: str | torch.device = "cpu",
        weights_seed: int = 0,
        weights_path: str | None = None,
        weights: Mapping[str, torch.Tensor] | None = None,
        components: Collection[str] | None = None,
    ) -> None:
        """``components`` (top-level names of `CausalDiTNetwork`, see `STAGE_COMPONENTS`): build
        only those, the others stay None — a stage worker's model; the weights given or read are
        then those of the components only. None: the whole network."""
        if weights is not None and weights_path is not None:
            raise ValueError("pass weights or weights_path, not both")
        self.cfg = cfg
        self.preset = preset
        self.device = torch.device(device)
        if self.device.type == "cuda" and self.device.index is None:
            # Tensors report "cuda:N"; a bare "cuda" would never compare equal to their device.
            self.device = torch.device("cuda", torch.cuda.current_device())
        self.dtype = cfg.torch_dtype
        self.width, self.height, self.fps = cfg.width, cfg.height, cfg.fps
        self.frames_per_chunk = cfg.video_frames_per_chunk
        whole = components is None
        net = partial_network(
            lambda: CausalDiTNetwork(cfg), components or ("text", "dit", "decoder"), self.device
        )
        if weights is not None and whole:
            # Adopt the tensors as they are (no copy when device and dtype already match): weights
            # received block by block (workers.runtime.weights) stay where the transfer put them,
            # so a worker can keep serving them to its peers without a second copy.
            net.load_state_dict(weights, strict=True, assign=True)
        elif weights is not None:
            load_subset(net, weights, "the given weights")
        elif weights_path is not None and whole:
            from safetensors.torch import load_file

            net.load_state_dict(load_file(weights_path, device=str(self.device)), strict=True)
        elif weights_path is not None:
            load_subset_from_file(net, weights_path, self.device)
        else:
            seeded_init(net, weights_seed)
        self.net = net.to(self.dtype).eval().requires_grad_(False)
        # GPU paths (flash attention, CUDA graphs, compiled blocks): settings from the environment.
        self.accel = Accelerator(self.device)
        # Sequence parallelism (`sequence_parallel`): the devices of the current job step, and the
        # DiT's copies on devices other than the model's own.
        self._sp_devices: list[torch.device] = [self.device]
        self._dit_replicas: dict[torch.device, CausalDiT] = {}
        # Flow-matching sigmas for the few-step sampler, e.g. [1.0, 0.75, 0.5, 0.25] for 4 steps.
        steps = cfg.denoising_steps
        self.sigmas = [1.0 - i / steps for i in range(steps)]

    @classmethod
    def from_preset(
        cls,
        preset: str,
        *,
        device: str | torch.device = "cpu",
        weights_path: str | None = None,
        weights_seed: int = 0,
        weights: Mapping[str, torch.Tensor] | None = None,
        dtype: str | None = None,
    ) -> CausalDiTModel:
        if preset not in PRESETS:
            raise UnknownPresetError(
                f"unknown causal-dit preset {preset!r}; available presets: {', '.join(sorted(PRESETS))}"
            )
        cfg = PRESETS[preset] if dtype is None else replace(PRESETS[preset], dtype=dtype)
        return cls(
            cfg,
            preset=preset,
            device=device,
            weights_seed=weights_seed,
            weights_path=weights_path,
            weights=weights,
        )

    def save_weights(self, path: str) -> None:
        from safetensors.torch import save_file

        save_file({k: v.contiguous().cpu() for k, v in self.net.state_dict().items()}, path)

    def describe(self) -> dict[str, Any]:
        return {
            "preset": self.preset,
            "config": asdict(self.cfg),
            "parameters": sum(p.numel() for p in self.net.parameters()),
            "state_bytes": self.cfg.state_bytes(),
            "width": self.width,
            "height": self.height,
            "fps": self.fps,
            "frames_per_chunk": self.frames_per_chunk,
            "device": str(self.device),
        }

    # -- state regions -------------------------------------------------------------------------

    def expected_layout(self, meta: dict[str, Any]) -> list[tuple[str, tuple[int, ...], torch.dtype]]:
        for key in ("seed", "next_chunk", "frames_written", "prompt_schedule", "active_prompt"):
            if key not in meta:
                raise KeyError(f"meta lacks {key!r}")
        if int(meta["next_chunk"]) < 0 or int(meta["frames_written"]) < 0:
            raise ValueError("chunk and frame counters must be non-negative")
        return self.cfg.state_layout()

    def state_bytes_for(self, options: dict[str, Any] | None = None) -> int:
        _check_options(options)
        return self.cfg.state_bytes()

    def create_state(
        self, prompt: str, seed: int, options: dict[str, Any] | None = None, *, start_chunk: int = 0
    ) -> SessionState:
        _check_options(options)
        region, tensors = allocate_region(self.cfg.state_layout(), self.device)
        region.zero_()
        tensors["prompt_embeds"].copy_(self.encode_prompt(prompt))
        meta = self.session_meta(prompt, seed, options, start_chunk, {"frames_written": 0})
        return SessionState(tensors=tensors, meta=meta, region=region)

    @torch.inference_mode()
    def encode_prompt(self, prompt: str) -> torch.Tensor:
        # Always encoded alone (batch of one) so embeddings never depend on other sessions.
        ids, words = tokenize(prompt, self.cfg.text_len)
        ids_t = torch.tensor([ids], device=self.device)
        words_t = torch.tensor([words], device=self.device)
        return self.net.text(ids_t, words_t)[0].to(self.dtype)

    # -- generation ----------------------------------------------------------------------------

    def chunk_noise(self, state: SessionState, chunk_index: int) -> torch.Generator:
        return torch.Generator(device="cpu").manual_seed(splitmix64(int(state.meta["seed"]), chunk_index))

    @torch.inference_mode()
    def diffuse(self, states: list[SessionState], embeddings: list[torch.Tensor | None]) -> torch.Tensor:
        """The diffuse stage: noise, the few-step denoising loop and the cache pass → clean latents
        ``[B, F, C, h, w]`` (float32); ``embeddings[i]`` (when not None) replaces the session's
        prompt embeddings first."""
        cfg = self.cfg
        fpc = cfg.frames_per_chunk
        latent_shape = (fpc, cfg.latent_channels, cfg.latent_height, cfg.latent_width)
        chunk_indices = [s.next_chunk for s in states]
        for state, encoded in zip(states, embeddings, strict=True):
            if encoded is not None:
                state.tensors["prompt_embeds"].copy_(encoded)
        generators = [self.chunk_noise(s, c) for s, c in zip(states, chunk_indices, strict=True)]

        # All of the chunk's noise (the initial latents, then one re-noise per later step) is drawn
        # per session on CPU from its own generator — independent of batch and device — and moved to
        # the device in one copy, so the denoising loop never waits on a host transfer.
        draws = len(self.sigmas)
        per_session = [
            torch.stack([torch.randn(latent_shape, generator=g) for _ in range(draws)]) for g in generators
        ]
        noise_all = torch.stack(per_session, dim=1).to(self.device)  # [draws, B, F, C, h, w]

        context = torch.stack([s.tensors["prompt_embeds"] for s in states])
        frames_written = [int(s.meta["frames_written"]) for s in states]
        positions = torch.tensor(
            [[c * fpc + i for i in range(fpc)] for c in chunk_indices], dtype=torch.float64
        )
        rope = rope_tables(cfg, positions, self.device)
        cache = self._gather_cache_plan(states, frames_written)

        x = few_step_sample(
            lambda x, sigma: self._forward(x, sigma, context, rope, states, cache, write_slots=None),
            self.sigmas,
            noise_all,
        )
        # Cache pass: the clean chunk at t=0 writes its keys/values into each session's ring.
        slots = torch.tensor([self._ring_slots(fw) for fw in frames_written]).to(self.device)
        self._forward(x, 0.0, context, rope, states, cache, write_slots=slots)
        for i, state in enumerate(states):
            state.meta["frames_written"] = frames_written[i] + fpc
            state.meta["next_chunk"] = chunk_indices[i] + 1
        return x

    @torch.inference_mode()
    def decode(self, latents: torch.Tensor, caches: list[dict[str, torch.Tensor]]) -> torch.Tensor:
        """The decode stage: each latent frame with its predecessor; a chunk's first frame takes the
        last latent of the session's previous chunk from its decoder cache (``latent_history``)."""
        previous = torch.stack([cache["latent_history"] for cache in caches])
        frames = self.net.decoder(latents.to(self.dtype), previous.to(self.dtype))
        for i, cache in enumerate(caches):
            cache["latent_history"].copy_(latents[i, -1])
        return frames

    # -- one-shot jobs (issue 14) ---------------------------------------------------------------
    # A job is denoised as one clip: full attention over all its latent frames (no KV cache), the
    # same DiT at the job's own latent grid (RoPE makes it resolution-agnostic), and decoded once.

    MAX_JOB_LATENT_FRAMES = (
        CAUSAL_DIT_MAX_JOB_LATENT_FRAMES  # the catalogue's: the control plane checks it too
    )

    def check_job(self, *, kind: str, width: int, height: int, frames: int, steps: int) -> None:
        self.check_job_common(kind=kind, width=width, height=height, frames=frames, steps=steps)
        cfg = self.cfg
        unit = cfg.spatial_upsample * cfg.patch
        largest = 4 * max(cfg.width, cfg.height)
        for name, value in (("width", width), ("height", height)):
            if value % unit or value > largest:
                raise JobSpecError(name, f"must be a multiple of {unit} up to {largest} for {self.preset!r}")
        if kind == "video" and frames % cfg.temporal_upsample:
            raise JobSpecError("frames", f"must be a multiple of {cfg.temporal_upsample} for {self.preset!r}")
        if kind == "video" and frames // cfg.temporal_upsample > self.MAX_JOB_LATENT_FRAMES:
            most = self.MAX_JOB_LATENT_FRAMES * cfg.temporal_upsample
            raise JobSpecError("frames", f"at most {most} for {self.preset!r}")

    def job_layout(self, meta: dict[str, Any]) -> list[tuple[str, tuple[int, ...], torch.dtype]]:
        cfg = self.cfg
        latent_frames = 1 if meta["kind"] == "image" else int(meta["frames"]) // cfg.temporal_upsample
        grid = (int(meta["height"]) // cfg.spatial_upsample, int(meta["width"]) // cfg.spatial_upsample)
        return [
            ("latents", (latent_frames, cfg.latent_channels, *grid), torch.float32),
            ("prompt_embeds", (cfg.text_len, cfg.dim), self.dtype),
        ]

    def init_job(self, tensors: dict[str, torch.Tensor], seed: int, embeddings: torch.Tensor) -> None:
        tensors["prompt_embeds"].copy_(embeddings)

    @torch.inference_mode()
    def job_step(self, states: list[SessionState]) -> None:
        if not states:
            return
        self.check_job_batch(states)
        x = torch.stack([s.tensors["latents"] for s in states])  # [B, F, C, h, w]
        b, latent_frames, _, h, w = x.shape
        grid = replace(self.cfg, latent_height=h, latent_width=w)
        positions = torch.arange(latent_frames, dtype=torch.float64).expand(b, latent_frames)
        rope = rope_tables(grid, positions, self.device)
        context = torch.stack([s.tensors["prompt_embeds"] for s in states])
        sigmas = self.job_sigmas(states, self.device)
        if len(self._sp_devices) > 1 and states[0].meta["kind"] == "video":
            velocity = self._job_velocity_split(x, sigmas, context, rope)
        else:
            velocity = self._forward(x, sigmas, context, rope, states, (0, None), write_slots=None)
        self.advance_jobs(states, x - sigmas.view(b, 1, 1, 1, 1) * velocity)

    # -- elastic sequence parallelism (GenServe: a video's SP degree) ------------------------------
    # A video job's tokens (latent frames × patches) are split into contiguous shards, one per
    # device. Everything in a block but self-attention is per token, so each device runs it on its
    # own shard; for self-attention every device gathers all shards' keys and values (all-gather
    # of K/V, as in ring attention without the ring) and attends its own queries over the whole
    # sequence. Chosen over Ulysses (all-to-all from sequence shards to head shards): it places no
    # constraint on the head count (Ulysses needs heads divisible by the degree; the presets have
    # 4 to 12 heads, 12 does not split 8 ways) nor on the sequence length, and each query row sees
    # exactly the keys in the order one device would, which keeps the result equal to SP 1. The
    # price is O(N·D) K/V traffic per device per block instead of Ulysses' O(N·D/P) — fine within
    # one worker's NVLink; across nodes Ulysses would be the better trade.

    SEQUENCE_PARALLEL = True

    @contextlib.contextmanager
    def sequence_parallel(self, devices: Sequence[torch.device | str]) -> Iterator[None]:
        previous = self._sp_devices
        chosen = [torch.device(d) for d in devices] or [self.device]
        self._sp_devices = [
            self.device if d == self.device or d.type == self.device.type == "cpu" else d for d in chosen
        ]
        try:
            yield
        finally:
            self._sp_devices = previous

    def _dit_on(self, device: torch.device) -> CausalDiT:
        """The DiT's weights on ``device`` (the model's own, or a copy made once and kept)."""
        if device == self.device:
            return self.net.dit
        replica = self._dit_replicas.get(device)
        if replica is None:
            replica = self._dit_replicas[device] = copy.deepcopy(self.net.dit).to(device)
        return replica

    def _job_velocity_split(
        self,
        latents: torch.Tensor,
        sigmas: torch.Tensor,
        context: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor],
    ) -> torch.Tensor:
        """`_forward` of a job batch (no KV cache) with the token sequence split across
        ``self._sp_devices`` (see above); the flow velocity [B, F, C, h, w] on the model's device."""
        cfg, p, devices = self.cfg, self.cfg.patch, self._sp_devices
        b, f, c, h, w = latents.shape
        tokens = (
            latents.to(self.dtype)
            .view(b, f, c, h // p, p, w // p, p)
            .permute(0, 1, 3, 5, 2, 4, 6)
            .reshape(b, f * (h // p) * (w // p), c * p * p)
        )
        dits = [self._dit_on(d) for d in devices]
        temb = self.net.dit.time_embed(timestep_embedding(sigmas * 1000.0).to(self.dtype))
        e = self.net.dit.time_proj(temb)
        degree = len(devices)
        token_shards = torch.tensor_split(tokens, degree, dim=1)
        cos_shards = torch.tensor_split(rope[0], degree, dim=1)
        sin_shards = torch.tensor_split(rope[1], degree, dim=1)
        ropes = [(cs.to(d), sn.to(d)) for cs, sn, d in zip(cos_shards, sin_shards, devices, strict=True)]
        es = [e.to(d) for d in devices]
        contexts = [context.to(d) for d in devices]
        xs = [dit.patch_embed(shard.to(d)) for dit, shard, d in zip(dits, token_shards, devices, strict=True)]
        for index in range(cfg.blocks):
            self.check_abandon()  # a job step's block boundary (`abandon_on`)
            blocks = [dit.blocks[index] for dit in dits]
            mods = [blk.modulations(ei, b) for blk, ei in zip(blocks, es, strict=True)]
            qkv = [
                blk.self_attention_inputs(x, m, r)
                for blk, x, m, r in zip(blocks, xs, mods, ropes, strict=True)
            ]
            for i, device in enumerate(devices):
                # All-gather: every shard's keys and values, in sequence order, onto this device.
                keys = torch.cat([k.to(device) for _, k, _ in qkv], dim=1)
                values = torch.cat([v.to(device) for _, _, v in qkv], dim=1)
                attn = F.scaled_dot_product_attention(
                    qkv[i][0].transpose(1, 2), keys.transpose(1, 2), values.transpose(1, 2)
                )
                xs[i] = blocks[i].after_attention(xs[i], attn, mods[i], contexts[i])
        outputs = []
        for dit, x, device in zip(dits, xs, devices, strict=True):
            shift, scale = (dit.head_modulation + temb.to(device).unsqueeze(1)).chunk(2, dim=1)
            outputs.append(dit.head(dit.head_norm(x) * (1 + scale) + shift).to(self.device))
        out = torch.cat(outputs, dim=1)
        out = out.view(b, f, h // p, w // p, c, p, p).permute(0, 1, 4, 2, 5, 3, 6).reshape(b, f, c, h, w)
        return out.float()

    @torch.inference_mode()
    def job_frames(self, state: SessionState) -> torch.Tensor:
        latents = state.tensors["latents"][None].to(self.dtype)
        frames = self.net.decoder(latents, torch.zeros_like(latents[:, 0]))[0]
        return frames[: int(state.meta["frames"])]

    def _ring_slots(self, frames_written: int) -> list[int]:
        cfg = self.cfg
        local = cfg.window_frames - cfg.sink_frames
        slots = []
        for i in range(cfg.frames_per_chunk):
            f = frames_written + i
            slots.append(f if f < cfg.sink_frames else cfg.sink_frames + (f - cfg.sink_frames) % local)
        return slots

    def _gather_cache_plan(
        self, states: list[SessionState], frames_written: list[int]
    ) -> tuple[int, torch.Tensor | None]:
        """(number of cache slots to read, boolean key mask [B, slots*T] or None)."""
        cfg = self.cfg
        valid = [min(fw, cfg.window_frames) for fw in frames_written]
        read = max(valid)
        if read == 0 or len(set(valid)) == 1:
            return read, None
        tpf = cfg.tokens_per_frame
        mask = torch.zeros(len(states), read * tpf, dtype=torch.bool)
        for i, v in enumerate(valid):
            mask[i, : v * tpf] = True
        return read, mask.to(self.device)

    def _forward(
        self,
        latents: torch.Tensor,
        sigma: float | torch.Tensor,
        context: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor],
        states: list[SessionState],
        cache: tuple[int, torch.Tensor | None],
        write_slots: torch.Tensor | None,
    ) -> torch.Tensor:
        """Predict the flow velocity of `latents` [B, F, C, h, w] at noise level `sigma`."""
        cfg, dit = self.cfg, self.net.dit
        b, f, c, h, w = latents.shape
        p = cfg.patch
        tokens = (
            latents.to(self.dtype)
            .view(b, f, c, h // p, p, w // p, p)
            .permute(0, 1, 3, 5, 2, 4, 6)
            .reshape(b, f * (h // p) * (w // p), c * p * p)
        )
        job_step = isinstance(sigma, torch.Tensor)  # one noise level per batch element (one-shot jobs)
        t = sigma * 1000.0 if job_step else torch.full((b,), sigma * 1000.0, device=self.device)
        temb = dit.time_embed(timestep_embedding(t).to(self.dtype))
        e = dit.time_proj(temb)
        x = dit.patch_embed(tokens)
        read, mask = cache
        kv_cache = KvCacheBatch(states, read=read, write_slots=write_slots)
        for index, block in enumerate(dit.blocks):
            if job_step:
                self.check_abandon()  # a job step's block boundary (`abandon_on`)
            cache_k, cache_v = kv_cache.cached(index)
            # The steady state (window full, no mask) has one shape per batch size: CUDA graphs.
            fixed = read == cfg.window_frames and mask is None and not job_step
            args = (block, self.accel, x, e, context, rope, cache_k, cache_v, mask)
            x, k, v = self.accel.block(index, run_block, args, fixed_shape=fixed)
            kv_cache.write(index, k, v)
        if write_slots is not None:
            return latents  # the cache pass needs no prediction
        shift, scale = (dit.head_modulation + temb.unsqueeze(1)).chunk(2, dim=1)
        out = dit.head(dit.head_norm(x) * (1 + scale) + shift)
        out = out.view(b, f, h // p, w // p, c, p, p).permute(0, 1, 4, 2, 5, 3, 6).reshape(b, f, c, h, w)
        return out.float()


def seeded_init(net: nn.Module, seed: int) -> None:
    """Reproducible init: each parameter from its own generator seeded by (seed, crc32(name))."""
    for name, param in net.named_parameters():
        gen = torch.Generator(device=param.device).manual_seed(splitmix64(seed, zlib.crc32(name.encode())))
        leaf = name.rsplit(".", 1)[-1]
        with torch.no_grad():
            if leaf == "bias":
                param.zero_()
            elif param.dim() == 1 and leaf == "weight":  # LayerNorm / RMSNorm gains
                param.fill_(1.0)
            elif "modulation" in name or name.endswith("pos_embed"):
                param.normal_(0.0, 0.02, generator=gen)
            else:
                fan_in = param.shape[-1] if param.dim() == 2 else param[0].numel()
                param.normal_(0.0, 1.0 / math.sqrt(fan_in), generator=gen)


def _check_options(options: dict[str, Any] | None) -> None:
    if options:
        raise ValueError(f"causal-dit takes no per-session options yet, got {sorted(options)}")
