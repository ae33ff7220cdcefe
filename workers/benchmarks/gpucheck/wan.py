"""The Wan2.1-T2V-1.3B streaming generator with random weights in the real architecture.

The Wan adapter (``workers.runtime.models.wan_causal``) normally loads a checkpoint directory. The
check needs the same modules at their real sizes without ~14 GB of files (and without network), so
it builds the adapter over a directory holding the two component configs only, with
``components=()``: the DiT and the VAE come up on the meta device from the configs (shapes only, as a
stage worker that hosts neither builds them). This module then materialises them on the device with
seeded random weights, adds a UMT5 encoder of the published UMT5-XXL shape and a tokenizer built in
code, and returns the ordinary `WanCausalModel` — the streaming step, KV ring, decoder cache and
KV re-cache are the adapter's own code, nothing here replaces them.

Shapes: diffusers' ``Wan-AI/Wan2.1-T2V-1.3B-Diffusers`` configs (DiT 1.42 B parameters, VAE 127 M)
and ``google/umt5-xxl``'s encoder (5.7 B); streaming settings are the adapter's defaults (832×480,
3 latent frames per chunk, KV window 3 sink + 9 local, 4 steps). ``WAN_TINY`` is the dry run's.
"""

from __future__ import annotations

import json
import math
import zlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from workers.runtime.models.base import splitmix64

WORDS = [
    *("a", "the", "red", "blue", "green", "cat", "dog", "fox", "robot", "walking", "running", "through"),
    *("snow", "forest", "city", "night", "beach", "waves", "at", "dusk", "volcano", "erupting", "quiet"),
    *("lake", "over", "sea", "storm", "library", "harbour", "dawn", "street", "rain"),
]


@dataclass(frozen=True)
class WanShape:
    """One size of the Wan generator: the diffusers configs of its DiT and VAE, its UMT5 encoder's
    config and the streaming settings (`WanCausalArchitecture` fields)."""

    name: str
    transformer: dict[str, Any]
    vae: dict[str, Any]
    text_encoder: dict[str, Any]
    settings: dict[str, Any] = field(default_factory=dict)


WAN_1_3B = WanShape(
    name="wan2.1-t2v-1.3b",
    # Wan-AI/Wan2.1-T2V-1.3B-Diffusers, transformer/config.json
    transformer={
        "_class_name": "WanTransformer3DModel",
        "patch_size": [1, 2, 2],
        "num_attention_heads": 12,
        "attention_head_dim": 128,
        "in_channels": 16,
        "out_channels": 16,
        "text_dim": 4096,
        "freq_dim": 256,
        "ffn_dim": 8960,
        "num_layers": 30,
        "cross_attn_norm": True,
        "qk_norm": "rms_norm_across_heads",
        "eps": 1e-06,
    },
    # vae/config.json: AutoencoderKLWan's defaults are the Wan2.1 VAE's.
    vae={
        "_class_name": "AutoencoderKLWan",
        "base_dim": 96,
        "z_dim": 16,
        "dim_mult": [1, 2, 4, 4],
        "num_res_blocks": 2,
        "attn_scales": [],
        "temperal_downsample": [False, True, True],
        "dropout": 0.0,
    },
    # google/umt5-xxl's encoder (the Wan2.1 text encoder, 5.7 B parameters).
    text_encoder={
        "vocab_size": 256384,
        "d_model": 4096,
        "d_kv": 64,
        "d_ff": 10240,
        "num_layers": 24,
        "num_heads": 64,
        "relative_attention_num_buckets": 32,
        "relative_attention_max_distance": 128,
        "feed_forward_proj": "gated-gelu",
        "layer_norm_epsilon": 1e-6,
    },
)

WAN_TINY = WanShape(
    name="wan-tiny",
    transformer={
        **WAN_1_3B.transformer,
        "num_attention_heads": 2,
        "attention_head_dim": 12,
        "text_dim": 16,
        "freq_dim": 32,
        "ffn_dim": 32,
        "num_layers": 2,
    },
    vae={**WAN_1_3B.vae, "base_dim": 8, "num_res_blocks": 1},
    text_encoder={
        **WAN_1_3B.text_encoder,
        "vocab_size": 64,
        "d_model": 16,
        "d_kv": 8,
        "d_ff": 32,
        "num_layers": 1,
        "num_heads": 2,
        "relative_attention_num_buckets": 8,
    },
    # Wan's streaming settings (3-frame chunks, 3 + 9 window) at 64×64.
    settings={"width": 64, "height": 64, "text_len": 16},
)


def libraries_unavailable() -> str | None:
    """None when the parts the adapter is built from import here, else why not (a machine may lack
    diffusers, or carry a diffusers its huggingface-hub is too old for: any import error counts)."""
    try:
        from diffusers import AutoencoderKLWan, WanTransformer3DModel  # noqa: F401
        from tokenizers import Tokenizer  # noqa: F401
        from transformers import PreTrainedTokenizerFast, UMT5EncoderModel  # noqa: F401
    except Exception as exc:
        return f"{type(exc).__name__}: {exc}"
    return None


def parameter_count(shape: WanShape) -> dict[str, int]:
    """Parameters of each component, from the configs on the meta device (allocates nothing)."""
    transformer, vae, text = _meta_modules(shape)
    return {
        "transformer": sum(p.numel() for p in transformer.parameters()),
        "vae": sum(p.numel() for p in vae.parameters()),
        "text_encoder": sum(p.numel() for p in text.parameters()),
    }


def _meta_modules(shape: WanShape) -> tuple[Any, Any, Any]:
    from diffusers import AutoencoderKLWan, WanTransformer3DModel
    from transformers import UMT5Config, UMT5EncoderModel

    with torch.device("meta"):
        transformer = WanTransformer3DModel.from_config(shape.transformer)
        vae = AutoencoderKLWan.from_config(shape.vae)
        text = UMT5EncoderModel(UMT5Config(**shape.text_encoder))
    return transformer, vae, text


def tokenizer() -> Any:
    """A word-level tokenizer built in code (the UMT5 tokenizer's files are not on the machine): the
    encoder's cost depends on the padded length (``text_len``), not on the vocabulary."""
    from tokenizers import Tokenizer, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    vocab = {"<pad>": 0, "</s>": 1, "<unk>": 2}
    for word in WORDS:
        vocab.setdefault(word, len(vocab))
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.post_processor = processors.TemplateProcessing(single="$A </s>", special_tokens=[("</s>", 1)])
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token="<pad>", eos_token="</s>", unk_token="<unk>"
    )


def random_init(module: torch.nn.Module, seed: int) -> None:
    """Seeded weights where the parameters live: biases 0, 1-D gains 1, every other tensor normal
    with std 1/√fan-in (its generator seeded by (seed, crc32(name)), so a rerun builds the same)."""
    with torch.no_grad():
        for name, param in module.named_parameters():
            leaf = name.rsplit(".", 1)[-1]
            if leaf == "bias":
                param.zero_()
            elif param.dim() == 1:
                param.fill_(1.0)
            else:
                generator = torch.Generator(device=param.device)
                generator.manual_seed(splitmix64(seed, zlib.crc32(name.encode())))
                param.normal_(0.0, 1.0 / math.sqrt(param[0].numel()), generator=generator)


def _materialise(
    module: torch.nn.Module,
    device: torch.device,
    dtype: torch.dtype,
    keep_fp32: list[str] | tuple[str, ...],
    seed: int,
) -> torch.nn.Module:
    # The Wan adapter imports diffusers, which a carried wheel may only provide at run time.
    from workers.runtime.models.wan_causal import place

    # Dtypes first, on the meta device (free), so the device allocates each tensor once, as loaded.
    place(module, torch.device("meta"), dtype, keep_fp32=keep_fp32)
    module.to_empty(device=device)
    random_init(module, seed)
    return module.eval().requires_grad_(False)


def write_configs(shape: WanShape, root: Path) -> Path:
    """The component configs the adapter reads (no weights): ``transformer/`` and ``vae/``."""
    for component, config in (("transformer", shape.transformer), ("vae", shape.vae)):
        (root / component).mkdir(parents=True, exist_ok=True)
        (root / component / "config.json").write_text(json.dumps(config))
    return root


def build_random_wan(
    shape: WanShape, *, device: torch.device | str, workdir: Path, dtype: str | None = None, seed: int = 0
) -> Any:
    """A `WanCausalModel` of ``shape`` with seeded random weights on ``device`` (see the module
    docstring); ``dtype`` None is the adapter's "auto" (bfloat16 on CUDA, float32 on CPU)."""
    # diffusers and transformers (the Wan adapter's too) may come from the carried wheels, on sys.path
    # only at run time.
    from diffusers import WanTransformer3DModel
    from transformers import UMT5Config, UMT5EncoderModel

    # The adapter imports them too: after them, at run time.
    from contracts.catalog.local_paths import WanCausalArchitecture
    from workers.runtime.models.wan_causal import ALL_COMPONENTS, WanCausalModel

    root = write_configs(shape, workdir / shape.name)
    arch = WanCausalArchitecture(path=str(root), base=str(root), layout="diffusers", **shape.settings)
    model = WanCausalModel(arch, preset=f"gpucheck-{shape.name}", device=device, dtype=dtype, components=())
    net = model.net
    net.transformer = _materialise(
        net.transformer, model.device, model.dtype, WanTransformer3DModel._keep_in_fp32_modules, seed
    )
    net.vae = _materialise(net.vae, model.device, model.dtype, (), seed + 1)
    with torch.device("meta"):
        text = UMT5EncoderModel(UMT5Config(**shape.text_encoder))
    net.text_encoder = _materialise(text, model.device, model.dtype, (), seed + 2)
    # Tied in transformers: one embedding under both names (as the adapter's loader re-ties it).
    net.text_encoder.encoder.embed_tokens.weight = net.text_encoder.shared.weight
    net.tokenizer = tokenizer()
    net.components = frozenset(ALL_COMPONENTS)
    return model


def weights_bytes(model: Any) -> dict[str, int]:
    """Bytes of parameters held on the device, by component (a `WanCausalModel`'s network)."""
    net = model.net
    parts = {"transformer": net.transformer, "vae": net.vae, "text_encoder": net.text_encoder}
    return {
        name: sum(p.numel() * p.element_size() for p in part.parameters() if not p.is_meta)
        for name, part in parts.items()
        if part is not None
    }
