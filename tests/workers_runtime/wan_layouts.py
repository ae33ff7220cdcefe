"""Tiny random Wan2.1 checkpoints saved in the published layouts (nothing is downloaded).

- `write_diffusers_layout`: the `Wan-AI/Wan2.1-T2V-1.3B-Diffusers` folders (transformer/,
  text_encoder/, tokenizer/, vae/) with `save_pretrained` of the libraries' own classes.
- `write_generator_checkpoint`: a causal project's training checkpoint over it, as Self-Forcing,
  LongLive and CausVid publish them: `{"generator": sd, "generator_ema": sd}` where `sd` is their
  diffusion wrapper's state dict (`model.` + the original Wan2.1 parameter names).
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import torch

WORDS = [
    *("a", "the", "red", "blue", "green", "cat", "dog", "fox", "robot", "walking", "running", "through"),
    *("snow", "forest", "city", "night", "beach", "waves", "at", "dusk", "volcano", "erupting", "quiet"),
    *("lake", "over", "sea", "storm", "library", "harbour", "dawn"),
]

# Streaming settings of the tiny model: 64×64 video (8×8 latents, 16 tokens per frame), chunks of
# 2 latent frames, a window of 6 latent frames with 2 sink frames.
TINY_SETTINGS = {
    "width": 64,
    "height": 64,
    "fps": 8.0,
    "frames_per_chunk": 2,
    "window_frames": 6,
    "sink_frames": 2,
    "text_len": 16,
    "denoising_timesteps": [1000, 750, 500, 250],
    "timestep_shift": 5.0,
    "kv_recache": True,
}


def write_tokenizer(path: Path) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    vocab = {"<pad>": 0, "</s>": 1, "<unk>": 2}
    for word in WORDS:
        vocab.setdefault(word, len(vocab))
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.post_processor = processors.TemplateProcessing(single="$A </s>", special_tokens=[("</s>", 1)])
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token="<pad>", eos_token="</s>", unk_token="<unk>"
    )
    fast.save_pretrained(str(path))


def write_diffusers_layout(root: Path, *, seed: int = 0, settings: dict | None = None) -> Path:
    from diffusers import AutoencoderKLWan, WanTransformer3DModel
    from transformers import UMT5Config, UMT5EncoderModel

    torch.manual_seed(seed)
    root.mkdir(parents=True, exist_ok=True)
    write_tokenizer(root / "tokenizer")
    text = UMT5EncoderModel(
        UMT5Config(
            vocab_size=64, d_model=16, d_kv=8, d_ff=32, num_layers=1, num_heads=2,
            relative_attention_num_buckets=8, feed_forward_proj="gated-gelu",
        )
    )  # fmt: skip
    text.save_pretrained(str(root / "text_encoder"))
    transformer = WanTransformer3DModel(
        patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=12, in_channels=4, out_channels=4,
        text_dim=16, freq_dim=32, ffn_dim=32, num_layers=2, cross_attn_norm=True,
    )  # fmt: skip
    with torch.no_grad():  # zero-initialised tables would hide modulation bugs
        for name, param in transformer.named_parameters():
            if name.endswith("bias") or "scale_shift_table" in name:
                param.normal_(0.0, 0.1)
    transformer.save_pretrained(str(root / "transformer"))
    vae = AutoencoderKLWan(
        base_dim=8, z_dim=4, dim_mult=[1, 2, 4, 4], num_res_blocks=1, temperal_downsample=[False, True, True],
        latents_mean=[0.1, -0.2, 0.3, 0.0], latents_std=[1.5, 0.8, 1.2, 1.0],
    )  # fmt: skip
    vae.save_pretrained(str(root / "vae"))
    (root / "model_index.json").write_text(
        json.dumps({"_class_name": "WanPipeline", "transformer": ["diffusers", "WanTransformer3DModel"]})
    )
    (root / "streamserve.json").write_text(json.dumps(settings or TINY_SETTINGS))
    return root


# diffusers name → original Wan2.1 name (the inverse of diffusers' single-file converter).
DIFFUSERS_TO_WAN = [
    (r"^condition_embedder\.time_embedder\.linear_1", "time_embedding.0"),
    (r"^condition_embedder\.time_embedder\.linear_2", "time_embedding.2"),
    (r"^condition_embedder\.text_embedder\.linear_1", "text_embedding.0"),
    (r"^condition_embedder\.text_embedder\.linear_2", "text_embedding.2"),
    (r"^condition_embedder\.time_proj", "time_projection.1"),
    (r"^scale_shift_table$", "head.modulation"),
    (r"^proj_out", "head.head"),
    (r"\.attn1\.", ".self_attn."),
    (r"\.attn2\.", ".cross_attn."),
    (r"\.to_out\.0\.", ".o."),
    (r"\.to_([qkv])\.", r".\1."),
    (r"\.scale_shift_table$", ".modulation"),
    (r"\.ffn\.net\.0\.proj\.", ".ffn.0."),
    (r"\.ffn\.net\.2\.", ".ffn.2."),
    (r"\.norm2\.", ".norm3."),
]


def wan_name(name: str) -> str:
    for pattern, repl in DIFFUSERS_TO_WAN:
        name = re.sub(pattern, repl, name)
    return name


def write_generator_checkpoint(
    root: Path, relative: str = "checkpoints/self_forcing_dmd.pt", *, ema_offset: float | None = 0.05
) -> Path:
    """Save the transformer of `root` as a causal project's checkpoint, then drop the diffusers
    weights of transformer/ (its config stays), so only the checkpoint can supply them.

    With `ema_offset`, `generator_ema` holds the weights and `generator` the weights shifted by it
    (the loader must prefer the EMA); otherwise only `generator` is saved (CausVid)."""
    from safetensors.torch import load_file

    weights = load_file(str(root / "transformer" / "diffusion_pytorch_model.safetensors"))
    wrapped = {f"model.{wan_name(k)}": v for k, v in weights.items()}
    checkpoint: dict[str, dict[str, torch.Tensor]] = {}
    if ema_offset is None:
        checkpoint["generator"] = wrapped
    else:
        checkpoint["generator_ema"] = wrapped
        checkpoint["generator"] = {k: v + ema_offset for k, v in wrapped.items()}
    path = root / relative
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.save(checkpoint, str(path))
    (root / "transformer" / "diffusion_pytorch_model.safetensors").unlink()
    return path
