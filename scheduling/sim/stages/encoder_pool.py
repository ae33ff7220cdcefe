"""Streams with a shared text-encoder pool: how many more sessions a diffusion GPU holds.

The one memory model of the shared encoder pool: ``manage.py stage_memory`` (any GPU size) and
``manage.py reproduce_stages`` (the L20 / H100 / H200 rows of docs/results/stages.md) both print
`encoder_pool_gain` of the same `StreamModel`, built by `stream_model` from the preset's figures
that the worker runtime computes (``workers.runtime.stages.memory.stream_figures``: the exact state
region, per-stage weight bytes on the meta device, UMT5-XXL's parameter count). The command layer
passes them in: ``scheduling.core`` may not import the runtime, nor the runtime the scheduler.

A streaming worker that hosts the whole pipeline keeps the text encoder resident although it runs
only at session start and on a prompt switch. Moving it to a shared pool (the encode-only GPUs of
the stage placement; diffusion workers run role ``DC``: a causal decoder carries a per-session
cache, so decode stays next to diffuse) frees its weights on every diffusion worker. Sessions are
held by memory: each resident session keeps its state region (KV window, prompt embeddings,
latent history), so::

    sessions = floor((GPU memory − reserve − resident weights − active × chunk workspace) / state)

"At equal chunk latency" means both placements run the same batch of active sessions per chunk (the
same workspace and the same DiT compute); only what is resident changes. The pool itself costs GPUs:
``amortised`` spreads them over the diffusion GPUs they serve at a given prompt-switch rate.

Why the gain is what it is: with ``F`` the bytes left for state regions when the encoder is on the
worker, the pool adds ``E / S`` regions to ``F / S``, so the gain is about ``E / F`` (before
flooring). The ≥ 30 % of issue 15 needs ``E / (F + E) ≥ 0.3 / 1.3 ≈ 23 %``: the encoder must be
nearly a quarter of the memory the encoder and the sessions share on a worker
(`PoolResult.encoder_share`); the larger the GPU, the smaller that share.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from scheduling.core.stages.stage_profiles import GB, WAN_13B_STREAM, GpuSpec, PipelineProfile, Shape

ACTIVE_SESSIONS = 4  # sessions whose chunk is in flight at once: their activations are resident
SWITCHES_PER_SESSION_S = 1 / 30  # prompt encodes per session per second (session start, switches)


@dataclass(frozen=True)
class StreamModel:
    """What the memory model needs to know about the streaming preset."""

    state_bytes: float  # one session's state region (``state_bytes_for``)
    worker_weight_bytes: float  # what a diffusion worker always holds: the diffuse and decode stages
    encoder_weight_bytes: float  # the text encoder the pool takes off every diffusion worker
    chunk_workspace_bytes: float  # activations of one active session's chunk forward
    profile: PipelineProfile  # the stream pipeline (its encoder's time on a pool GPU)

    def encode_s(self, gpu: GpuSpec) -> float:
        return self.profile.encode_s(Shape(832, 480, 1, 1), gpu)


def stream_model(
    *,
    state_bytes: float,
    worker_weight_bytes: float,
    encoder_weight_bytes: float,
    tokens_per_chunk: int,
    hidden: int,
    profile: PipelineProfile = WAN_13B_STREAM,
) -> StreamModel:
    """The memory model's inputs from the preset's figures (state size, the diffusion worker's and
    the encoder's weight bytes, tokens of one chunk, hidden size) and the stream profile (activation
    factor; the encode time, at the encoder's own parameter count)."""
    return StreamModel(
        state_bytes=state_bytes,
        worker_weight_bytes=worker_weight_bytes,
        encoder_weight_bytes=encoder_weight_bytes,
        chunk_workspace_bytes=tokens_per_chunk * hidden * profile.bytes_per_param * profile.activation_factor,
        profile=replace(profile, encoder_params=encoder_weight_bytes / profile.bytes_per_param),
    )


@dataclass(frozen=True)
class PoolResult:
    gpu: str
    memory_gb: float
    reserve_gb: float
    active: int
    sessions_monolithic: int
    sessions_with_pool: int
    gain: float
    freed_gb: float
    freed_state_regions: float  # the encoder's bytes in state regions
    encoder_share: float  # the encoder's part of the memory sessions and encoder share on a worker
    encode_s: float
    pool_gpus_per_100: float
    amortised_gain: float

    def to_json(self) -> dict[str, float | int | str]:
        return {
            "gpu": self.gpu,
            "memory_gb": self.memory_gb,
            "reserve_gb": self.reserve_gb,
            "active": self.active,
            "sessions_monolithic": self.sessions_monolithic,
            "sessions_with_pool": self.sessions_with_pool,
            "gain": self.gain,
            "freed_gb": self.freed_gb,
            "freed_state_regions": self.freed_state_regions,
            "encoder_share": self.encoder_share,
            "encode_s": self.encode_s,
            "pool_gpus_per_100": self.pool_gpus_per_100,
            "amortised_gain": self.amortised_gain,
        }


def sessions_per_gpu(
    memory_bytes: float, reserve_bytes: float, weights: float, model: StreamModel, active: int
) -> int:
    free = memory_bytes - reserve_bytes - weights - active * model.chunk_workspace_bytes
    return max(0, math.floor(free / model.state_bytes))


def encoder_pool_gain(
    model: StreamModel,
    gpu: GpuSpec,
    *,
    active: int = ACTIVE_SESSIONS,
    switches_per_session_s: float = SWITCHES_PER_SESSION_S,
    encode_s: float | None = None,
) -> PoolResult:
    """Sessions per GPU with and without the encoder on the diffusion workers.

    ``switches_per_session_s``: prompt encodes each session asks for per second (session starts and
    prompt switches; our assumption, one per 30 s). A pool GPU serves ``1 / encode_s`` of them
    (``encode_s``: measured, or the profile's analytic time on ``gpu``)."""
    if active < 0 or switches_per_session_s < 0 or (encode_s is not None and encode_s <= 0):
        raise ValueError("active sessions and the switch rate must be >= 0, the encode time positive")
    mono = sessions_per_gpu(
        gpu.memory_bytes,
        gpu.reserve_bytes,
        model.worker_weight_bytes + model.encoder_weight_bytes,
        model,
        active,
    )
    pooled = sessions_per_gpu(gpu.memory_bytes, gpu.reserve_bytes, model.worker_weight_bytes, model, active)
    gain = (pooled - mono) / mono if mono else math.inf
    session_memory = (
        gpu.memory_bytes
        - gpu.reserve_bytes
        - model.worker_weight_bytes
        - active * model.chunk_workspace_bytes
    )
    seconds = model.encode_s(gpu) if encode_s is None else encode_s
    # Encoder GPUs per diffusion GPU: the encode load of its sessions over one pool GPU's rate.
    pool_share = pooled * switches_per_session_s * seconds
    amortised = pooled / (1 + pool_share)
    amortised_gain = (amortised - mono) / mono if mono else math.inf
    return PoolResult(
        gpu=gpu.name,
        memory_gb=gpu.memory_bytes / GB,
        reserve_gb=gpu.reserve_bytes / GB,
        active=active,
        sessions_monolithic=mono,
        sessions_with_pool=pooled,
        gain=gain,
        freed_gb=model.encoder_weight_bytes / GB,
        freed_state_regions=model.encoder_weight_bytes / model.state_bytes,
        encoder_share=model.encoder_weight_bytes / session_memory if session_memory > 0 else math.inf,
        encode_s=seconds,
        pool_gpus_per_100=100 * pool_share,
        amortised_gain=amortised_gain,
    )
