"""The streaming preset's figures for the shared text-encoder pool's memory model (issue 15).

The model itself (sessions per GPU with and without the encoder on the diffusion workers, the pool's
own GPUs) is ``scheduling.sim.stages.encoder_pool``, the one copy both ``manage.py stage_memory``
and ``manage.py reproduce_stages`` print. This module supplies what only the runtime knows, exactly
and without allocating anything: a session's state region (``CausalDiTConfig.state_bytes``, checked
against real allocations in the model tests), the diffusion worker's weights (diffuse + decode,
`stage_weight_bytes` on the meta device), the encoder's weights (the preset's own, or a published
encoder standing in for it: `ENCODERS`, from its configuration), and the chunk's token count and
width (its activation workspace). Pure: no allocation, no Django; the command layer joins the two.
"""

from __future__ import annotations

from dataclasses import dataclass

from workers.runtime.models.causal_dit import PRESETS as DIT_PRESETS
from workers.runtime.stages.contract import stage_weight_bytes, staged_class


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


def stream_figures(preset: str, *, encoder: str | None) -> dict[str, int]:
    """The keyword arguments of ``encoder_pool.stream_model`` for ``preset``.

    ``encoder``: a name of `ENCODERS` standing in for the preset's own text encoder, or None for the
    preset's (``wan-1.3b``'s built-in one is a 20 MB test encoder; Wan2.1 serves UMT5-XXL)."""
    if encoder is not None and encoder not in ENCODERS:
        raise ValueError(f"unknown encoder {encoder!r}; known: {', '.join(sorted(ENCODERS))}")
    staged_class(preset)  # an unknown preset is an UnknownPresetError naming the presets
    if preset not in DIT_PRESETS:
        raise ValueError(
            f"the memory model covers the causal-dit presets; {preset!r} has no analytic state size"
        )
    cfg = DIT_PRESETS[preset]
    per_stage = stage_weight_bytes(preset)
    return {
        "state_bytes": cfg.state_bytes(),
        "worker_weight_bytes": per_stage["D"] + per_stage["C"],
        "encoder_weight_bytes": per_stage["E"] if encoder is None else ENCODERS[encoder].weight_bytes(),
        "tokens_per_chunk": cfg.tokens_per_frame * cfg.frames_per_chunk,
        "hidden": cfg.dim,
    }
