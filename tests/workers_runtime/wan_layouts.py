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
import shutil
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


def write_diffusers_layout(
    root: Path, *, seed: int = 0, settings: dict | None = None, latent_channels: int = 4
) -> Path:
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
        patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=12, in_channels=latent_channels,
        out_channels=latent_channels,
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


# -- the original Wan2.1 release -------------------------------------------------------------------

# transformers' UMT5 names → Wan's T5 names (wan/modules/t5.py).
UMT5_TO_WAN = [
    (r"^shared\.weight$", "token_embedding.weight"),
    (r"^encoder\.final_layer_norm\.weight$", "norm.weight"),
    (r"^encoder\.block\.(\d+)\.layer\.0\.layer_norm\.", r"blocks.\1.norm1."),
    (
        r"^encoder\.block\.(\d+)\.layer\.0\.SelfAttention\.relative_attention_bias\.",
        r"blocks.\1.pos_embedding.embedding.",
    ),
    (r"^encoder\.block\.(\d+)\.layer\.0\.SelfAttention\.([qkvo])\.", r"blocks.\1.attn.\2."),
    (r"^encoder\.block\.(\d+)\.layer\.1\.layer_norm\.", r"blocks.\1.norm2."),
    (r"^encoder\.block\.(\d+)\.layer\.1\.DenseReluDense\.wi_0\.", r"blocks.\1.ffn.gate.0."),
    (r"^encoder\.block\.(\d+)\.layer\.1\.DenseReluDense\.wi_1\.", r"blocks.\1.ffn.fc1."),
    (r"^encoder\.block\.(\d+)\.layer\.1\.DenseReluDense\.wo\.", r"blocks.\1.ffn.fc2."),
]

RESIDUAL = {"norm1": "residual.0", "conv1": "residual.2", "norm2": "residual.3", "conv2": "residual.6",
            "conv_shortcut": "shortcut"}  # fmt: skip


def wan_vae_name(name: str) -> str:
    """diffusers' AutoencoderKLWan name → the name in Wan's Wan2.1_VAE.pth (the inverse of diffusers'
    converter for the Wan2.1 VAE structure)."""
    fixed = {"quant_conv": "conv1", "post_quant_conv": "conv2"}
    head, _, leaf = name.rpartition(".")
    if head in fixed:
        return f"{fixed[head]}.{leaf}"
    m = re.match(r"^(encoder|decoder)\.(conv_in|conv_out|norm_out)\.(.*)$", name)
    if m:
        part = {"conv_in": "conv1", "conv_out": "head.2", "norm_out": "head.0"}[m.group(2)]
        return f"{m.group(1)}.{part}.{m.group(3)}"
    m = re.match(r"^(encoder|decoder)\.mid_block\.(resnets|attentions)\.(\d)\.(.*)$", name)
    if m:
        side, kind, index, rest = m.groups()
        if kind == "attentions":
            return f"{side}.middle.1.{rest}"
        slot = 0 if index == "0" else 2
        return f"{side}.middle.{slot}.{_residual(rest)}"
    m = re.match(r"^encoder\.down_blocks\.(\d+)\.(.*)$", name)
    if m:
        return f"encoder.downsamples.{m.group(1)}.{_residual(m.group(2))}"
    m = re.match(r"^decoder\.up_blocks\.(\d+)\.resnets\.(\d+)\.(.*)$", name)
    if m:
        block, resnet, rest = int(m.group(1)), int(m.group(2)), m.group(3)
        return f"decoder.upsamples.{4 * block + resnet}.{_residual(rest)}"
    m = re.match(r"^decoder\.up_blocks\.(\d+)\.upsamplers\.0\.(.*)$", name)
    if m:
        return f"decoder.upsamples.{4 * int(m.group(1)) + 3}.{m.group(2)}"
    return name


def _residual(rest: str) -> str:
    for ours, theirs in RESIDUAL.items():
        if rest.startswith(ours + "."):
            return theirs + rest[len(ours) :]
    return rest


def write_wan_layout(root: Path, *, seed: int = 0) -> tuple[Path, Path]:
    """The original Wan2.1 release of a tiny random model (config.json and the DiT in Wan's names,
    models_t5_umt5-xxl-enc-bf16.pth, Wan2.1_VAE.pth, google/umt5-xxl/), and beside it the same
    weights in the diffusers layout. Returns (original, diffusers)."""
    from diffusers import AutoencoderKLWan
    from diffusers.loaders.single_file_utils import convert_wan_vae_to_diffusers
    from safetensors.torch import load_file, save_file

    diffusers_dir = write_diffusers_layout(root / "diffusers", seed=seed, latent_channels=16)
    # The Wan2.1 VAE structure (2 residual blocks a level, what diffusers' converter maps) at width 8.
    vae = AutoencoderKLWan(base_dim=8, z_dim=16)
    vae.save_pretrained(str(diffusers_dir / "vae"))
    original = root / "Wan2.1-T2V-tiny"
    original.mkdir(parents=True)
    write_tokenizer(original / "google" / "umt5-xxl")
    dit = load_file(str(diffusers_dir / "transformer" / "diffusion_pytorch_model.safetensors"))
    save_file({wan_name(k): v for k, v in dit.items()}, str(original / "diffusion_pytorch_model.safetensors"))
    cfg = json.loads((diffusers_dir / "transformer" / "config.json").read_text())
    heads = cfg["num_attention_heads"]
    (original / "config.json").write_text(json.dumps({
        "_class_name": "WanModel", "model_type": "t2v", "dim": heads * cfg["attention_head_dim"],
        "num_heads": heads, "in_dim": cfg["in_channels"], "out_dim": cfg["out_channels"],
        "ffn_dim": cfg["ffn_dim"], "freq_dim": cfg["freq_dim"], "num_layers": cfg["num_layers"],
        "text_dim": cfg["text_dim"], "text_len": 512, "eps": 1e-06,
    }))  # fmt: skip
    t5 = load_file(str(diffusers_dir / "text_encoder" / "model.safetensors"))
    t5_wan = {}
    for name, tensor in t5.items():
        for pattern, repl in UMT5_TO_WAN:
            name, hits = re.subn(pattern, repl, name)
            if hits:
                break
        t5_wan[name] = tensor
    t5_wan.pop("encoder.embed_tokens.weight", None)
    torch.save(t5_wan, str(original / "models_t5_umt5-xxl-enc-bf16.pth"))
    vae_wan = {wan_vae_name(k): v for k, v in vae.state_dict().items()}
    assert convert_wan_vae_to_diffusers(dict(vae_wan)).keys() == vae.state_dict().keys()
    torch.save(vae_wan, str(original / "Wan2.1_VAE.pth"))
    shutil.copy(diffusers_dir / "streamserve.json", original / "streamserve.json")
    return original, diffusers_dir
