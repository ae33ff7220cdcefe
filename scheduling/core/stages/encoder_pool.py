"""Streams with a shared text-encoder pool: how many more sessions a diffusion GPU holds.

A streaming worker that hosts the whole pipeline keeps the text encoder resident although it runs
only at session start and on a prompt switch. Moving it to a shared pool (the encode-only GPUs of
the stage placement) frees its weights on every diffusion worker. Sessions are held by memory: each
resident session keeps its state region (KV window, prompt embeddings, latent history), so::

    sessions = floor((GPU memory − reserve − resident weights − chunk workspace) / state bytes)

"At equal chunk latency" means both placements run the same batch of active sessions per chunk (the
same workspace and the same DiT compute); only what is resident changes. The pool itself costs GPUs:
``amortised`` spreads them over the diffusion GPUs they serve at a given prompt-switch rate.

The numbers of the ``wan-1.3b`` preset (state bytes, parameter count, tokens per chunk) come from
the worker runtime and are passed in by the command layer (``scheduling.core`` may not import it).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from .profiles import GB, WAN_13B_STREAM, GpuSpec, PipelineProfile, Shape


@dataclass(frozen=True)
class StreamModel:
    """What the memory model needs to know about the streaming preset."""

    state_bytes: float  # one session's state region (``state_bytes_for``)
    worker_weight_bytes: float  # DiT + VAE decoder (+ the preset's own small text encoder)
    encoder_weight_bytes: float  # the UMT5-XXL-sized encoder the pool takes away
    chunk_workspace_bytes: float  # activations of one active session's chunk forward
    profile: PipelineProfile  # the stream pipeline (its encoder's time on a pool GPU)

    def encode_s(self, gpu: GpuSpec) -> float:
        return self.profile.encode_s(Shape(832, 480, 1, 1), gpu)


def stream_model(
    *,
    state_bytes: float,
    worker_params: float,
    tokens_per_chunk: int,
    hidden: int,
    profile: PipelineProfile = WAN_13B_STREAM,
) -> StreamModel:
    """The memory model's inputs from the preset's numbers (state size, parameter count, tokens of
    one chunk, hidden size) and the stream profile (encoder size and time, activation factor)."""
    return StreamModel(
        state_bytes=state_bytes,
        worker_weight_bytes=worker_params * profile.bytes_per_param,
        encoder_weight_bytes=profile.weight_bytes("E"),
        chunk_workspace_bytes=tokens_per_chunk * hidden * profile.bytes_per_param * profile.activation_factor,
        profile=profile,
    )


@dataclass(frozen=True)
class PoolResult:
    gpu: str
    memory_gb: float
    sessions_monolithic: int
    sessions_with_pool: int
    gain: float
    freed_gb: float
    pool_gpus_per_100: float
    amortised_gain: float

    def to_json(self) -> dict[str, float | int | str]:
        return {
            "gpu": self.gpu,
            "memory_gb": self.memory_gb,
            "sessions_monolithic": self.sessions_monolithic,
            "sessions_with_pool": self.sessions_with_pool,
            "gain": self.gain,
            "freed_gb": self.freed_gb,
            "pool_gpus_per_100": self.pool_gpus_per_100,
            "amortised_gain": self.amortised_gain,
        }


def sessions_per_gpu(
    memory_bytes: float, reserve_bytes: float, weights: float, model: StreamModel, active: int
) -> int:
    free = memory_bytes - reserve_bytes - weights - active * model.chunk_workspace_bytes
    return max(0, math.floor(free / model.state_bytes))


def encoder_pool_gain(
    model: StreamModel, gpu: GpuSpec, *, active: int = 4, switches_per_session_s: float = 1 / 30
) -> PoolResult:
    """Sessions per GPU with and without the encoder on the diffusion workers.

    ``switches_per_session_s``: prompt encodes each session asks for per second (session starts and
    prompt switches; our assumption, one per 30 s). A pool GPU serves ``1 / encode_s`` of them."""
    mono = sessions_per_gpu(
        gpu.memory_bytes,
        gpu.reserve_bytes,
        model.worker_weight_bytes + model.encoder_weight_bytes,
        model,
        active,
    )
    pooled = sessions_per_gpu(gpu.memory_bytes, gpu.reserve_bytes, model.worker_weight_bytes, model, active)
    gain = (pooled - mono) / mono if mono else math.inf
    # Encoder GPUs per diffusion GPU: the encode load of its sessions over one pool GPU's rate.
    pool_share = pooled * switches_per_session_s * model.encode_s(gpu)
    amortised = pooled / (1 + pool_share)
    amortised_gain = (amortised - mono) / mono if mono else math.inf
    return PoolResult(
        gpu=gpu.name,
        memory_gb=gpu.memory_bytes / GB,
        sessions_monolithic=mono,
        sessions_with_pool=pooled,
        gain=gain,
        freed_gb=model.encoder_weight_bytes / GB,
        pool_gpus_per_100=100 * pool_share,
        amortised_gain=amortised_gain,
    )
