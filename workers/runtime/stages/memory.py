"""Memory model of the shared text-encoder pool for streams (issue 15, "Runtime").

Monolithic placement: every diffusion GPU holds the text encoder, the DiT and the decoder, and the
sessions' state regions fill what is left. Shared pool: diffusion workers run role ``DC`` (decode
stays next to diffuse: a causal decoder carries a per-session cache) and take prompt encodings from
an encoder replica (role ``E``) at session start and on every prompt switch, so the encoder's
weights leave every diffusion GPU. One replica serves ``gpus_per_encoder`` diffusion GPUs and sits
on one of them, displacing ``ceil(encoder / state)`` sessions there; that is charged to the group.

Equal chunk latency: a diffusion worker runs the same batched DiT step and the same decoder in both
placements (the encoder never ran in the chunk step except on a prompt switch, and in the pool that
encode runs elsewhere), so the two are compared at the same batch, i.e. purely by how many state
regions fit. Activation workspace and the CUDA context are the same in both (``reserved_bytes``).

Inputs are analytic: the DiT and decoder bytes of the preset (`stage_weight_bytes`, meta device),
its state region (``CausalDiTConfig.state_bytes``, checked against real allocations in the model
tests), and the encoder's parameter count from its published configuration (`ENCODERS`). Pure: no
allocation, no Django.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any

from workers.runtime.stages.contract import stage_weight_bytes, staged_class

GB = 10**9


@dataclass(frozen=True)
class T5EncoderShape:
    """A (U)MT5 encoder stack as ``transformers`` builds it (``UMT5EncoderModel``)."""

    d_model: int
    d_ff: int
    layers: int
    heads: int
    d_kv: int
    vocab: int
    relative_buckets: int
    bytes_per_parameter: int  # the dtype the serving stack keeps it in

    def parameter_count(self) -> int:
        inner = self.heads * self.d_kv
        attention = (
            4 * self.d_model * inner + self.relative_buckets * self.heads
        )  # q, k, v, o + per-layer bias (UMT5)
        feed_forward = 3 * self.d_model * self.d_ff  # gated GELU: wi_0, wi_1, wo
        layer = attention + feed_forward + 2 * self.d_model  # two RMS norms
        return self.vocab * self.d_model + self.layers * layer + self.d_model  # + the final norm

    def weight_bytes(self) -> int:
        return self.parameter_count() * self.bytes_per_parameter


ENCODERS: dict[str, T5EncoderShape] = {
    # google/umt5-xxl's config.json, the encoder Wan2.1 uses (models_t5_umt5-xxl-enc-bf16.pth, bf16).
    "umt5-xxl": T5EncoderShape(
        d_model=4096,
        d_ff=10240,
        layers=24,
        heads=64,
        d_kv=64,
        vocab=256384,
        relative_buckets=32,
        bytes_per_parameter=2,
    ),
}


def encoder_pool_memory(
    preset: str,
    *,
    encoder: str | None,
    gpu_memory_bytes: int,
    reserved_bytes: int = 0,
    gpus_per_encoder: int = 8,
    switch_interval_s: float | None = None,
    encode_ms: float | None = None,
) -> dict[str, Any]:
    """Sessions per GPU, monolithic vs with the shared encoder pool (see the module docstring).

    ``encoder``: a name of `ENCODERS` standing in for the preset's own encoder, or None for the
    preset's. ``switch_interval_s`` (mean time between a session's prompt switches) and ``encode_ms``
    (one encode on the encoder's GPU) size the pool's load when given.
    """
    if encoder is not None and encoder not in ENCODERS:
        raise ValueError(f"unknown encoder {encoder!r}; known: {', '.join(sorted(ENCODERS))}")
    if gpu_memory_bytes <= 0 or reserved_bytes < 0 or gpus_per_encoder < 1:
        raise ValueError("GPU memory must be positive, reserved memory >= 0, gpus_per_encoder >= 1")
    if (switch_interval_s is not None and switch_interval_s <= 0) or (
        encode_ms is not None and encode_ms <= 0
    ):
        raise ValueError("switch interval and encode time must be positive")
    staged = staged_class(preset)
    if not hasattr(staged, "state_bytes"):
        raise ValueError(
            f"the memory model covers the causal-dit presets; {preset!r} has no analytic state size"
        )
    per_stage = stage_weight_bytes(preset)
    encoder_bytes = per_stage["E"] if encoder is None else ENCODERS[encoder].weight_bytes()
    dc_bytes = per_stage["D"] + per_stage["C"]
    state_bytes = staged.state_bytes(preset)
    free_dc = gpu_memory_bytes - reserved_bytes - dc_bytes
    monolithic = _fit(free_dc - encoder_bytes, state_bytes)
    pooled = _fit(free_dc, state_bytes)
    displaced = math.ceil(encoder_bytes / state_bytes)
    amortized = (gpus_per_encoder * pooled - displaced) / gpus_per_encoder
    report: dict[str, Any] = {
        "preset": preset,
        "encoder": encoder or f"{preset} (built-in)",
        "gpu_memory_bytes": gpu_memory_bytes,
        "reserved_bytes": reserved_bytes,
        "weights_bytes": {"encode": encoder_bytes, "diffuse": per_stage["D"], "decode": per_stage["C"]},
        "state_bytes_per_session": state_bytes,
        "encoder_bytes_freed_per_diffusion_worker": encoder_bytes,
        "gpus_per_encoder": gpus_per_encoder,
        "sessions_per_gpu": {
            "monolithic": monolithic,
            "shared_pool": pooled,
            "shared_pool_with_encoder_share": round(amortized, 3),
        },
        "gain": {
            "shared_pool": _gain(pooled, monolithic),
            "shared_pool_with_encoder_share": _gain(amortized, monolithic),
        },
    }
    if switch_interval_s is not None:
        load = {"encodes_per_s_per_replica": round(gpus_per_encoder * pooled / switch_interval_s, 3)}
        if encode_ms is not None:
            load["replica_utilisation"] = round(load["encodes_per_s_per_replica"] * encode_ms / 1000.0, 4)
        report["encoder_load"] = {"switch_interval_s": switch_interval_s, "encode_ms": encode_ms, **load}
    return report


def encoder_shapes() -> dict[str, dict[str, int]]:
    return {
        name: {**asdict(shape), "parameters": shape.parameter_count()} for name, shape in ENCODERS.items()
    }


def _fit(free_bytes: int, state_bytes: int) -> int:
    return max(free_bytes // state_bytes, 0)


def _gain(value: float, base: int) -> float | None:
    return round(value / base - 1.0, 4) if base > 0 else None
