"""Wan2.1-based autoregressive video diffusion (Self-Forcing, CausVid, LongLive) from a local directory.

The parts come from the maintained libraries: the UMT5 text encoder and its tokenizer from
`transformers`, the Wan VAE (`AutoencoderKLWan`) and the Wan DiT (`WanTransformer3DModel`) from
`diffusers`. What those libraries do not have is the streaming step, written here over the
diffusers modules:

- A chunk of `frames_per_chunk` latent frames is denoised in few steps (Self-Forcing's sampler: the
  x0 prediction is re-noised to the next, shift-warped noise level), each step running the DiT
  blocks with block-causal self-attention over the chunk plus the session's KV cache; then one pass
  at t=0 over the clean chunk writes its keys/values into the cache (`context_noise: 0`).
- The KV cache keeps `sink_frames` attention-sink frames and a ring of the most recent frames
  (LongLive's frame sink + local window). Keys are cached after RoPE at their absolute frame
  position, so ring order does not matter to attention.
- The Wan VAE's causal decoder keeps a feature cache (the last two time steps of every causal
  convolution's input); each session's cache lives in its state region, so a session decodes its
  next chunk exactly as if its stream had never been interrupted, moved or batched.
- A prompt switch re-computes the cached keys/values of the frames in the window under the new
  prompt (LongLive's KV re-cache) when the model's settings ask for it (`kv_recache`), from the
  clean latents the state keeps for the window.

The state region (TurboServe §6.1): `kv_cache`, `prompt_embeds` (the projected text context),
`latent_window` (clean latents of the cached frames, slot-aligned with the KV ring) and one tensor
per decoder cache entry (`vae_cache.NN`); the metadata holds the seed, counters and prompt schedule.
Noise is counter-based (the generator of chunk c is seeded by splitmix64(seed, c)), so it depends
only on the session, never on the batch or the device.

One-shot jobs (issue 14) are the same rollout for a fixed prompt, stepped one denoising step of one
chunk at a time with the session's noise, and decoded at the end through a fresh decoder cache: a
job's frames are a session's (see "one-shot jobs" below and docs/runtime.md). The adapter has no
bidirectional (whole-clip) sampler: it loads the causal few-step generator only.

Batching sessions at different stream positions: the caches are stacked into one batch and sessions
whose cache is not yet full get a boolean key mask (as in `causal_dit`). The VAE decodes the
sessions whose stream has started in one batch and the new ones in another (their first latent
frame goes through the decoder's "first chunk" path).
"""

from __future__ import annotations

import re
import types
from collections.abc import Collection
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file

from contracts.catalog.local_paths import (
    WAN_FILES,
    ModelLayoutError,
    WanCausalArchitecture,
    read_json,
    read_wan_architecture,
)
from contracts.catalog.presets import PRESETS
from workers.runtime.accel import Accelerator
from workers.runtime.models import UnknownPresetError
from workers.runtime.models.base import (
    DTYPES_BY_NAME,
    JobSpecError,
    SessionState,
    StagewiseModel,
    allocate_region,
    few_step_sample,
    few_step_update,
    region_offsets,
)
from workers.runtime.models.causal_dit import apply_rope, rope_tables, splitmix64
from workers.runtime.models.kv_cache import KvCacheBatch, attention_over_cache

# Prefixes the training code of the causal projects puts in front of the Wan DiT parameter names:
# the diffusion wrapper's `.model`, FSDP and DDP wrappers, torch.compile.
WRAPPER_PREFIXES = ("model.", "module.", "_orig_mod.")
# A parameter name only the original Wan2.1 DiT spells this way (diffusers: attn1, attn2, condition_embedder).
ORIGINAL_WAN_NAME = re.compile(r"(^|\.)(self_attn|cross_attn|time_embedding|head\.head)\.")
WRAPPER_INFIXES = ("_fsdp_wrapped_module.", "_checkpoint_wrapped_module.")


# -- loading ---------------------------------------------------------------------------------------


def read_safetensors(component_dir: Path, stem: str) -> tuple[dict[str, torch.Tensor], dict[str, Path]]:
    """All tensors of `<stem>.safetensors` or of the shards its `.index.json` lists, and the file
    each parameter came from (for error messages)."""
    single = component_dir / f"{stem}.safetensors"
    index = component_dir / f"{stem}.safetensors.index.json"
    if single.is_file():
        files = [single]
    elif index.is_file():
        weight_map = read_json(index).get("weight_map", {})
        files = [component_dir / name for name in dict.fromkeys(weight_map.values())]
    else:
        raise ModelLayoutError(f"{single}: missing (nor is there a sharded {index.name})")
    tensors: dict[str, torch.Tensor] = {}
    sources: dict[str, Path] = {}
    for path in files:
        if not path.is_file():
            raise ModelLayoutError(f"{path}: missing (listed in {index.name})")
        for name, tensor in load_file(str(path)).items():
            tensors[name] = tensor
            sources[name] = path
    return tensors, sources


def _names(keys: list[str], limit: int = 8) -> str:
    shown = ", ".join(keys[:limit])
    return shown + (f" … ({len(keys)} in all)" if len(keys) > limit else "")


def load_strict(
    module: torch.nn.Module,
    tensors: dict[str, torch.Tensor],
    described_as: dict[str, str],
    origin: str,
) -> None:
    """Load `tensors` into `module` (built on the meta device) by assignment, after checking that the
    names and shapes match exactly; a mismatch raises `ModelLayoutError` naming the parameters as the
    file spells them (`described_as`: our name → the file's name) and the file (`origin`)."""
    expected = module.state_dict()
    missing = sorted(set(expected) - set(tensors))
    unexpected = sorted(set(tensors) - set(expected))
    problems = []
    if missing:
        problems.append(f"missing parameter(s) {_names(missing)}")
    if unexpected:
        problems.append(f"unexpected parameter(s) {_names([described_as.get(k, k) for k in unexpected])}")
    for name in sorted(set(expected) & set(tensors)):
        if tuple(expected[name].shape) != tuple(tensors[name].shape):
            problems.append(
                f"parameter {described_as.get(name, name)} has shape {tuple(tensors[name].shape)}, "
                f"the config needs {tuple(expected[name].shape)}"
            )
            break
    if problems:
        raise ModelLayoutError(f"{origin}: " + "; ".join(problems))
    module.load_state_dict(tensors, strict=True, assign=True)


def read_generator_checkpoint(
    path: Path, keys: tuple[str, ...]
) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """The Wan DiT of a causal project's checkpoint in diffusers names, and diffusers name → the name
    in the file.

    Self-Forcing and LongLive save `{"generator": sd, "generator_ema": sd, ...}`, CausVid
    `{"generator": sd}`; `sd` is their diffusion wrapper's state dict (`model.` + the original Wan
    parameter names). A bare state dict, or one already in diffusers names, is accepted too.
    """
    if path.suffix == ".safetensors":
        raw: dict[str, Any] = load_file(str(path))
    else:
        try:
            raw = torch.load(str(path), map_location="cpu", weights_only=True, mmap=True)
        except Exception as exc:
            raise ModelLayoutError(f"{path}: not a readable torch checkpoint ({exc})") from exc
    state: Any = raw
    for key in keys:
        if isinstance(raw, dict) and isinstance(raw.get(key), dict):
            state = raw[key]
            break
    if not isinstance(state, dict) or not all(isinstance(v, torch.Tensor) for v in state.values()):
        found = sorted(raw) if isinstance(raw, dict) else type(raw).__name__
        raise ModelLayoutError(f"{path}: no generator state dict under {list(keys)} (found {found})")
    return dit_in_diffusers_names(state)


def merge_lora(tensors: dict[str, torch.Tensor], path: Path, alpha: float | None) -> None:
    """Merge a peft LoRA over the Wan DiT (LongLive's `lora.pt`: `{"generator_lora": sd}` or `sd`, with
    `base_model.model.<module>.lora_A.weight` / `.lora_B.weight` in the original Wan names) into
    `tensors` (diffusers names): W += alpha / rank · B A. A LoRA for a module the DiT does not have
    raises `ModelLayoutError` naming it."""
    raw = torch.load(str(path), map_location="cpu", weights_only=True)
    state = raw.get("generator_lora", raw) if isinstance(raw, dict) else raw
    if not isinstance(state, dict) or not any(".lora_A." in k for k in state):
        raise ModelLayoutError(f"{path}: no LoRA weights (lora_A/lora_B) found")
    original = any(ORIGINAL_WAN_NAME.search(k) for k in state)
    for key_a, down in state.items():
        if ".lora_A." not in key_a:
            continue
        key_b = key_a.replace(".lora_A.", ".lora_B.")
        if key_b not in state:
            raise ModelLayoutError(f"{path}: {key_b} missing for {key_a}")
        module = key_a.split(".lora_A.")[0]
        weight, _ = dit_in_diffusers_names(
            {module.removeprefix("base_model.model.") + ".weight": down}, original
        )
        (name,) = weight
        if name not in tensors:
            raise ModelLayoutError(f"{path}: unexpected parameter(s) {key_a} (no {name} in the DiT)")
        up = state[key_b]
        rank = down.shape[0]
        scale = (alpha if alpha is not None else rank) / rank
        merged = tensors[name].float() + scale * (up.float() @ down.float())
        tensors[name] = merged.to(tensors[name].dtype)


def dit_in_diffusers_names(
    state: dict[str, torch.Tensor], original: bool | None = None
) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """A Wan DiT state dict in diffusers names (wrapper prefixes stripped, original Wan names mapped),
    and diffusers name → the name in the file."""
    from diffusers.loaders.single_file_utils import convert_wan_transformer_to_diffusers

    # The original Wan names (`blocks.N.self_attn.q`, `head.head`, ...) go through diffusers' own
    # converter one key at a time, so that an error can name the parameter as the file spells it.
    original_names = original if original is not None else any(ORIGINAL_WAN_NAME.search(k) for k in state)
    tensors: dict[str, torch.Tensor] = {}
    described_as: dict[str, str] = {}
    for spelled, tensor in state.items():
        name = spelled
        for infix in WRAPPER_INFIXES:
            name = name.replace(infix, "")
        while name.startswith(WRAPPER_PREFIXES) and not name.startswith("model.diffusion_model."):
            name = name.split(".", 1)[1]
        if original_names:
            (name,) = convert_wan_transformer_to_diffusers({name: tensor})
        tensors[name] = tensor
        described_as[name] = spelled
    return tensors, described_as


# Wan's own T5 encoder names (wan/modules/t5.py) → transformers' UMT5EncoderModel names.
WAN_T5_NAMES = [
    (r"^token_embedding\.weight$", "shared.weight"),
    (r"^norm\.weight$", "encoder.final_layer_norm.weight"),
    (r"^blocks\.(\d+)\.norm1\.weight$", r"encoder.block.\1.layer.0.layer_norm.weight"),
    (r"^blocks\.(\d+)\.attn\.([qkvo])\.weight$", r"encoder.block.\1.layer.0.SelfAttention.\2.weight"),
    (
        r"^blocks\.(\d+)\.pos_embedding\.embedding\.weight$",
        r"encoder.block.\1.layer.0.SelfAttention.relative_attention_bias.weight",
    ),
    (r"^blocks\.(\d+)\.norm2\.weight$", r"encoder.block.\1.layer.1.layer_norm.weight"),
    (r"^blocks\.(\d+)\.ffn\.gate\.0\.weight$", r"encoder.block.\1.layer.1.DenseReluDense.wi_0.weight"),
    (r"^blocks\.(\d+)\.ffn\.fc1\.weight$", r"encoder.block.\1.layer.1.DenseReluDense.wi_1.weight"),
    (r"^blocks\.(\d+)\.ffn\.fc2\.weight$", r"encoder.block.\1.layer.1.DenseReluDense.wo.weight"),
]
# The parameters the T5 encoder's shape is read from: transformers' name, Wan's name.
WAN_T5_SHAPE_FROM = {
    "embedding": ("shared.weight", "token_embedding.weight"),
    "position_bias": (
        "encoder.block.0.layer.0.SelfAttention.relative_attention_bias.weight",
        "blocks.0.pos_embedding.embedding.weight",
    ),
    "query": ("encoder.block.0.layer.0.SelfAttention.q.weight", "blocks.0.attn.q.weight"),
    "gate": ("encoder.block.0.layer.1.DenseReluDense.wi_0.weight", "blocks.0.ffn.gate.0.weight"),
}


def read_torch_state(path: Path) -> dict[str, torch.Tensor]:
    try:
        state = torch.load(str(path), map_location="cpu", weights_only=True, mmap=True)
    except Exception as exc:
        raise ModelLayoutError(f"{path}: not a readable torch checkpoint ({exc})") from exc
    if not isinstance(state, dict) or not all(isinstance(v, torch.Tensor) for v in state.values()):
        raise ModelLayoutError(f"{path}: expected a state dict of tensors")
    return state


def wan_t5_encoder(path: Path) -> tuple[Any, dict[str, torch.Tensor], dict[str, str]]:
    """A meta-device UMT5EncoderModel shaped like Wan's T5 checkpoint `path`, its tensors in
    transformers' names, and transformers' name → Wan's name."""
    from transformers import UMT5Config, UMT5EncoderModel

    tensors: dict[str, torch.Tensor] = {}
    described_as: dict[str, str] = {}
    for original, tensor in read_torch_state(path).items():
        name = original
        for pattern, repl in WAN_T5_NAMES:
            name, hits = re.subn(pattern, repl, name)
            if hits:
                break
        tensors[name] = tensor
        described_as[name] = original
    absent = [wan for name, wan in WAN_T5_SHAPE_FROM.values() if name not in tensors]
    if absent:
        raise ModelLayoutError(f"{path}: missing parameter(s) {_names(absent)}")
    shape = {key: tensors[name].shape for key, (name, _) in WAN_T5_SHAPE_FROM.items()}
    vocab, d_model = shape["embedding"]
    buckets, heads = shape["position_bias"]
    layers = len({m.group(1) for k in tensors if (m := re.match(r"encoder\.block\.(\d+)\.", k))})
    config = UMT5Config(
        vocab_size=vocab, d_model=d_model, d_kv=shape["query"][0] // heads, d_ff=shape["gate"][0],
        num_layers=layers, num_heads=heads, relative_attention_num_buckets=buckets,
        relative_attention_max_distance=128, feed_forward_proj="gated-gelu", layer_norm_epsilon=1e-6,
    )  # fmt: skip
    with torch.device("meta"):
        encoder = UMT5EncoderModel(config)
    # Tied in transformers: the one embedding under both names.
    tensors["encoder.embed_tokens.weight"] = tensors["shared.weight"]
    described_as["encoder.embed_tokens.weight"] = "token_embedding.weight"
    return encoder, tensors, described_as


def wan_transformer_config(config: dict[str, Any], origin: Path) -> dict[str, Any]:
    """The diffusers WanTransformer3DModel config of an original Wan2.1 `config.json`."""
    try:
        dim, heads = int(config["dim"]), int(config["num_heads"])
        return {
            "patch_size": tuple(config.get("patch_size", (1, 2, 2))),
            "num_attention_heads": heads,
            "attention_head_dim": dim // heads,
            "in_channels": int(config["in_dim"]),
            "out_channels": int(config["out_dim"]),
            "text_dim": int(config.get("text_dim", 4096)),
            "freq_dim": int(config.get("freq_dim", 256)),
            "ffn_dim": int(config["ffn_dim"]),
            "num_layers": int(config["num_layers"]),
            "cross_attn_norm": bool(config.get("cross_attn_norm", True)),
            "qk_norm": "rms_norm_across_heads" if config.get("qk_norm", True) else None,
            "eps": float(config.get("eps", 1e-6)),
        }
    except KeyError as exc:
        raise ModelLayoutError(f"{origin}: lacks {exc.args[0]!r} (a Wan2.1 WanModel config)") from None


def wan_vae(path: Path) -> tuple[Any, dict[str, torch.Tensor], dict[str, str]]:
    """A meta-device AutoencoderKLWan for Wan's own `Wan2.1_VAE.pth`, its tensors in diffusers' names
    (diffusers' converter, one key at a time), and diffusers' name → Wan's name."""
    from diffusers import AutoencoderKLWan
    from diffusers.loaders.single_file_utils import convert_wan_vae_to_diffusers

    tensors: dict[str, torch.Tensor] = {}
    described_as: dict[str, str] = {}
    for original, tensor in read_torch_state(path).items():
        (name,) = convert_wan_vae_to_diffusers({original: tensor})
        tensors[name] = tensor
        described_as[name] = original
    for name, wan in (
        ("encoder.conv_in.weight", "encoder.conv1.weight"),
        ("post_quant_conv.weight", "conv2.weight"),
    ):
        if name not in tensors:
            raise ModelLayoutError(f"{path}: missing parameter(s) {wan}")
    z_dim = tensors["post_quant_conv.weight"].shape[0]
    if z_dim != 16:
        raise ModelLayoutError(f"{path}: a {z_dim}-channel VAE is not the Wan2.1 VAE (16 latent channels)")
    with torch.device("meta"):
        vae = AutoencoderKLWan(base_dim=tensors["encoder.conv_in.weight"].shape[0], z_dim=z_dim)
    return vae, tensors, described_as


def place(
    module: torch.nn.Module, device: torch.device, dtype: torch.dtype, keep_fp32: tuple[str, ...] | list[str]
) -> None:
    """Copy parameters to `device` in `dtype`, those under a module named in `keep_fp32` in float32.

    Always a fresh allocation: weights read from a memory-mapped checkpoint would otherwise keep the
    file's alignment, and CPU kernels round differently on differently aligned operands — the same
    weights must give the same chunks whichever file they came from."""
    with torch.no_grad():
        for name, param in module.named_parameters():
            target = torch.float32 if any(part in keep_fp32 for part in name.split(".")) else dtype
            param.data = param.data.to(device=device, dtype=target, copy=True)


def meta_transformer(root: Path, original: bool) -> Any:
    """The Wan DiT of the folder `root` built from its config on the meta device."""
    from diffusers import WanTransformer3DModel

    transformer_dir = root if original else root / "transformer"
    config = read_json(transformer_dir / "config.json")
    if original:
        config = wan_transformer_config(config, transformer_dir / "config.json")
    with torch.device("meta"):
        return WanTransformer3DModel.from_config(config)


def meta_vae(root: Path, original: bool) -> Any:
    """The Wan VAE of the folder `root` on the meta device (the original release: shaped from its
    memory-mapped checkpoint)."""
    from diffusers import AutoencoderKLWan

    if original:
        return wan_vae(root / WAN_FILES["vae"])[0]
    with torch.device("meta"):
        return AutoencoderKLWan.from_config(read_json(root / "vae" / "config.json"))


def meta_text_encoder(root: Path, original: bool) -> Any:
    """The UMT5 encoder of the folder `root` on the meta device."""
    from transformers import UMT5Config, UMT5EncoderModel

    if original:
        return wan_t5_encoder(root / WAN_FILES["text_encoder"])[0]
    text_dir = root / "text_encoder"
    read_json(text_dir / "config.json")
    config = UMT5Config.from_pretrained(str(text_dir), local_files_only=True)
    with torch.device("meta"):
        return UMT5EncoderModel(config)


def component_weight_bytes(arch: WanCausalArchitecture, dtype: torch.dtype) -> dict[str, int]:
    """Bytes of weights of each part a Wan stage worker loads, in ``dtype`` as `WanCausalNetwork`
    places them (the DiT's `_keep_in_fp32_modules` in float32), from the configs on the meta device:
    ``text_encoder`` (UMT5), ``text_projection`` (`TEXT_PROJECTION`), ``transformer`` (the DiT without
    its text projection) and ``vae``. Allocates nothing."""
    from diffusers import WanTransformer3DModel

    root = Path(arch.base or arch.path)
    original = arch.layout == "wan"
    keep_fp32 = WanTransformer3DModel._keep_in_fp32_modules

    def size(name: str, param: torch.Tensor, keep: Collection[str]) -> int:
        fp32 = any(part in keep for part in name.split("."))
        return param.numel() * (4 if fp32 else dtype.itemsize)

    transformer = meta_transformer(root, original)
    dit = {name: size(name, p, keep_fp32) for name, p in transformer.named_parameters()}
    projection = sum(b for name, b in dit.items() if name.startswith(TEXT_PROJECTION))
    return {
        "text_encoder": sum(size(n, p, ()) for n, p in meta_text_encoder(root, original).named_parameters()),
        "text_projection": projection,
        "transformer": sum(dit.values()) - projection,
        "vae": sum(size(n, p, ()) for n, p in meta_vae(root, original).named_parameters()),
    }


ALL_COMPONENTS = ("text_encoder", "transformer", "vae")
# The DiT's text projection (Wan's text_embedding): part of the transformer's checkpoint, but run by
# the encode stage, so a worker hosting encode without diffuse loads it and nothing else of the DiT.
TEXT_PROJECTION = "condition_embedder.text_embedder."


class WanCausalNetwork:
    """The three loaded components and the tokenizer (not an nn.Module: each part keeps the dtype its
    library expects).

    ``components`` (of `ALL_COMPONENTS`) are those loaded; a stage worker names its stages' only. The
    text encoder and tokenizer of a worker without it are None; the transformer and the VAE of a
    worker without them are built from their configs on the meta device (their shapes and the
    decoder cache's layout are still known, no memory is held) — except the transformer's text
    projection, which a text-encoder worker loads (`TEXT_PROJECTION`)."""

    def __init__(
        self,
        arch: WanCausalArchitecture,
        device: torch.device,
        dtype: torch.dtype,
        components: Collection[str] = ALL_COMPONENTS,
    ) -> None:
        unknown = set(components) - set(ALL_COMPONENTS)
        if unknown:
            raise ValueError(
                f"unknown Wan component(s) {sorted(unknown)}; components: {', '.join(ALL_COMPONENTS)}"
            )
        self.components = frozenset(components)
        root = Path(arch.base or arch.path)
        original = arch.layout == "wan"
        self.tokenizer: Any = None
        self.text_encoder: Any = None
        if "text_encoder" in components:
            self._load_text_encoder(root, original, device, dtype)
        self.transformer = self._load_transformer(arch, root, original, device, dtype)
        self.vae = self._load_vae(root, original, device, dtype)

    def _load_text_encoder(
        self, root: Path, original: bool, device: torch.device, dtype: torch.dtype
    ) -> None:
        from transformers import AutoTokenizer

        tokenizer_dir = root / (WAN_FILES["tokenizer"] if original else "tokenizer")
        self.tokenizer = AutoTokenizer.from_pretrained(str(tokenizer_dir), local_files_only=True)
        if original:
            t5_path = root / WAN_FILES["text_encoder"]
            encoder, tensors, described_as = wan_t5_encoder(t5_path)
            load_strict(encoder, tensors, described_as, str(t5_path))
            encoder.encoder.embed_tokens.weight = encoder.shared.weight
            place(encoder, device, dtype, keep_fp32=())
            self.text_encoder = encoder.eval().requires_grad_(False)
        else:
            self.text_encoder = self._load_umt5(root / "text_encoder", device, dtype)

    def _load_transformer(
        self,
        arch: WanCausalArchitecture,
        root: Path,
        original: bool,
        device: torch.device,
        dtype: torch.dtype,
    ) -> Any:
        from diffusers import WanTransformer3DModel

        transformer_dir = root if original else root / "transformer"
        transformer = meta_transformer(root, original)
        transformer.rope = torch.nn.Identity()  # non-persistent buffers; the streaming step has its own RoPE
        if not self.components & {"transformer", "text_encoder"}:
            return transformer
        generator = arch.generator_path()
        if generator is not None:
            tensors, described_as = read_generator_checkpoint(generator, arch.checkpoint_keys)
            lora = arch.lora_path()
            if lora is not None:
                merge_lora(tensors, lora, arch.lora_alpha)
            load_strict(transformer, tensors, described_as, str(generator))
        else:
            tensors, sources = read_safetensors(transformer_dir, "diffusion_pytorch_model")
            origin = ", ".join(sorted({str(p) for p in sources.values()}))
            described_as = {}
            if original:
                tensors, described_as = dit_in_diffusers_names(tensors)
            load_strict(transformer, tensors, described_as, origin)
        keep_fp32 = WanTransformer3DModel._keep_in_fp32_modules
        if "transformer" not in self.components:
            # Encode only: the text projection is placed, the rest of the DiT goes back to meta.
            projection = transformer.condition_embedder.text_embedder
            transformer.condition_embedder.text_embedder = None
            transformer.to("meta")
            transformer.condition_embedder.text_embedder = projection
            place(projection, device, dtype, keep_fp32=keep_fp32)
            return transformer.eval().requires_grad_(False)
        # As diffusers does for Wan: time embedding, modulation tables and norms stay in float32.
        place(transformer, device, dtype, keep_fp32=keep_fp32)
        if "text_encoder" not in self.components:
            # Diffuse only: the prompt arrives projected (the encode stage ran the projection).
            transformer.condition_embedder.text_embedder.to("meta")
        return transformer.eval().requires_grad_(False)

    def _load_vae(self, root: Path, original: bool, device: torch.device, dtype: torch.dtype) -> Any:
        if original:
            vae_path = root / WAN_FILES["vae"]
            vae, tensors, described_as = wan_vae(vae_path)
            if "vae" not in self.components:
                return vae
            load_strict(vae, tensors, described_as, str(vae_path))
        else:
            vae_dir = root / "vae"
            vae = meta_vae(root, original=False)
            if "vae" not in self.components:
                return vae
            tensors, sources = read_safetensors(vae_dir, "diffusion_pytorch_model")
            load_strict(vae, tensors, {}, ", ".join(sorted({str(p) for p in sources.values()})))
        place(vae, device, dtype, keep_fp32=())
        return vae.eval().requires_grad_(False)

    def loaded_parameters(self) -> int:
        """Parameters held in memory (those of the components not loaded are on the meta device)."""
        parts = (self.text_encoder, self.transformer, self.vae)
        return sum(
            p.numel() for part in parts if part is not None for p in part.parameters() if not p.is_meta
        )

    @staticmethod
    def _load_umt5(text_dir: Path, device: torch.device, dtype: torch.dtype) -> Any:
        """transformers' own loader for the diffusers layout's text_encoder/, made strict."""
        from transformers import UMT5EncoderModel

        read_json(text_dir / "config.json")
        try:
            encoder, info = UMT5EncoderModel.from_pretrained(
                str(text_dir), local_files_only=True, output_loading_info=True, dtype=dtype
            )
        except OSError as exc:
            raise ModelLayoutError(f"{text_dir}: {exc}") from exc
        problems = []
        if info.get("missing_keys"):
            problems.append(f"missing parameter(s) {_names(sorted(info['missing_keys']))}")
        if info.get("unexpected_keys"):
            problems.append(f"unexpected parameter(s) {_names(sorted(info['unexpected_keys']))}")
        if info.get("mismatched_keys"):
            problems.append(f"mismatched parameter(s) {_names([str(k) for k in info['mismatched_keys']])}")
        if problems:
            raise ModelLayoutError(f"{text_dir}: " + "; ".join(problems))
        return encoder.to(device).eval().requires_grad_(False)


# -- the model -------------------------------------------------------------------------------------


class WanCausalModel(StagewiseModel):
    """`StreamingVideoModel` for Wan2.1-based causal video diffusion (see the module docstring),
    generating as its stages (`StagewiseModel`): encode = UMT5 + the DiT's text projection, diffuse
    = the few-step sampler over the DiT (KV ring, latent window, LongLive re-cache on a prompt
    switch), decode = the causal VAE with the ``vae_cache.*`` tensors as the per-session decoder
    cache (``vae_cache.decoded`` counts the latent frames it has decoded: 0 starts the VAE's stream).
    """

    # State tensors of the decoder cache: the VAE's causal conv caches and its frame counter.
    DECODER_PREFIX = "vae_cache."
    DECODED = "vae_cache.decoded"

    # Built from its own checkpoint directory (three libraries' modules, ~14 GB at 1.3B with the
    # UMT5-XXL encoder): workers load it from there and it is not a parameter-pool source.
    transferable_weights = False

    def __init__(
        self,
        arch: WanCausalArchitecture,
        *,
        preset: str,
        device: str | torch.device = "cpu",
        dtype: str | None = None,
        components: Collection[str] = ALL_COMPONENTS,
    ) -> None:
        """``components`` (of `ALL_COMPONENTS`): what `WanCausalNetwork` loads — a stage worker's
        model loads its stages' only."""
        self.arch = arch
        self.preset = preset
        self.device = torch.device(device)
        if self.device.type == "cuda" and self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())
        name = dtype or arch.dtype
        if name == "auto":
            name = "bfloat16" if self.device.type == "cuda" else "float32"
        self.dtype = DTYPES_BY_NAME[name]
        if arch.frames_per_chunk < 2:
            # After a chunk of >= 2 latent frames every decoder cache entry holds two time steps, so
            # the decoder cache has one fixed shape between chunks.
            raise ModelLayoutError(f"{arch.path}: frames_per_chunk must be >= 2 for the Wan VAE cache")
        self.net = WanCausalNetwork(arch, self.device, self.dtype, components)
        # GPU paths (flash attention, CUDA graphs, compiled blocks): settings from the environment.
        self.accel = Accelerator(self.device)
        tcfg = self.net.transformer.config
        self.dim = tcfg.num_attention_heads * tcfg.attention_head_dim
        self.heads = tcfg.num_attention_heads
        self.latent_channels = tcfg.in_channels
        p_t, p_h, p_w = tcfg.patch_size
        if p_t != 1 or p_h != p_w:
            raise ModelLayoutError(f"{arch.path}/transformer: patch_size {tcfg.patch_size} is not (1, p, p)")
        self.patch = int(p_h)
        if self.net.vae.config.z_dim != self.latent_channels:
            raise ModelLayoutError(
                f"{arch.path}/vae: z_dim {self.net.vae.config.z_dim} != transformer in_channels "
                f"{self.latent_channels}"
            )
        self.rope_shape = types.SimpleNamespace(
            head_dim=tcfg.attention_head_dim,
            latent_height=arch.latent_height,
            latent_width=arch.latent_width,
            patch=self.patch,
        )
        self.width, self.height, self.fps = arch.width, arch.height, arch.fps
        self.frames_per_chunk = arch.video_frames_per_chunk
        vae_cfg = self.net.vae.config
        self.latents_mean = torch.tensor(vae_cfg.latents_mean, device=self.device).view(1, -1, 1, 1, 1)
        self.latents_std = torch.tensor(vae_cfg.latents_std, device=self.device).view(1, -1, 1, 1, 1)
        # Self-Forcing's warped few-step schedule: timestep t/1000 → sigma with the flow shift.
        shift = arch.timestep_shift
        self.sigmas = [shift * (t / 1000) / (1 + (shift - 1) * (t / 1000)) for t in arch.denoising_timesteps]
        self.vae_cache_shapes = self._probe_decoder_cache()
        self.DECODER_CACHE = tuple(
            name for name, *_ in self.state_layout() if name.startswith(self.DECODER_PREFIX)
        )

    @classmethod
    def from_preset(
        cls,
        preset: str,
        *,
        device: str | torch.device = "cpu",
        weights_path: str | None = None,
        dtype: str | None = None,
        weights: Any = None,
        **_: Any,
    ) -> WanCausalModel:
        if weights is not None:
            raise ValueError(
                "the Wan adapter loads from its checkpoint directory, not from transferred weights"
            )
        entry = PRESETS.get(preset)
        if entry is None or not isinstance(entry.architecture, WanCausalArchitecture):
            raise UnknownPresetError(f"{preset!r} is not a Wan causal preset (register it with MODEL_PATHS)")
        arch = entry.architecture
        if weights_path is not None:
            arch = read_wan_architecture(weights_path)
        return cls(arch, preset=preset, device=device, dtype=dtype)

    def describe(self) -> dict[str, Any]:
        return {
            "preset": self.preset,
            "config": {k: v for k, v in asdict(self.arch).items() if k != "extra"},
            "parameters": self.net.loaded_parameters(),
            "state_bytes": self.state_bytes_for(),
            "width": self.width,
            "height": self.height,
            "fps": self.fps,
            "frames_per_chunk": self.frames_per_chunk,
            "device": str(self.device),
            "dtype": str(self.dtype).removeprefix("torch."),
        }

    # -- state regions -------------------------------------------------------------------------

    def _probe_decoder_cache(self) -> list[tuple[int, tuple[int, int, int, int]]]:
        """(index in the decoder's cache list, shape [C, 2, H, W]) of every decoder cache entry once
        the stream has decoded two latent frames, at this model's latent size. Found by decoding two
        frames of a 2×2 latent (the entries' spatial sizes scale with the latent's). Entries the
        decoder counts but never fills stay None and are not part of the state."""
        vae = self.net.vae
        cache: list[Any] = [None] * vae._cached_conv_counts["decoder"]
        # On the meta device when this worker does not host the VAE: shapes only.
        device = vae.post_quant_conv.weight.device
        z = torch.zeros(1, self.latent_channels, 2, 2, 2, device=device, dtype=self.dtype)
        with torch.inference_mode():
            x = vae.post_quant_conv(z)
            for i in range(2):
                vae.decoder(x[:, :, i : i + 1], feat_cache=cache, feat_idx=[0], first_chunk=i == 0)
        entries = []
        sh, sw = self.arch.latent_height // 2, self.arch.latent_width // 2
        for index, entry in enumerate(cache):
            if entry is None:
                continue
            if not isinstance(entry, torch.Tensor) or entry.shape[2] != 2:
                raise ModelLayoutError(f"{self.arch.path}/vae: decoder cache entry {index} is not causal")
            _, c, t, h, w = entry.shape
            entries.append((index, (c, t, h * sh, w * sw)))
        self.vae_cache_slots = len(cache)
        return entries

    def state_layout(self) -> list[tuple[str, tuple[int, ...], torch.dtype]]:
        arch = self.arch
        layout = [
            ("kv_cache", (self.net.transformer.config.num_layers, 2, arch.window_frames, arch.tokens_per_frame,
                          self.dim), self.dtype),
            ("prompt_embeds", (arch.text_len, self.dim), self.dtype),
            ("latent_window", (arch.window_frames, self.latent_channels, arch.latent_height, arch.latent_width),
             torch.float32),
        ]  # fmt: skip
        for index, shape in self.vae_cache_shapes:
            layout.append((f"vae_cache.{index:02d}", shape, self.dtype))
        layout.append((self.DECODED, (1,), torch.int64))
        return layout

    def expected_layout(self, meta: dict[str, Any]) -> list[tuple[str, tuple[int, ...], torch.dtype]]:
        for key in ("seed", "next_chunk", "frames_written", "prompt_schedule", "active_prompt"):
            if key not in meta:
                raise KeyError(f"meta lacks {key!r}")
        if int(meta["next_chunk"]) < 0 or int(meta["frames_written"]) < 0:
            raise ValueError("chunk and frame counters must be non-negative")
        return self.state_layout()

    def state_bytes_for(self, options: dict[str, Any] | None = None) -> int:
        _check_options(options)
        return region_offsets(self.state_layout())[1]

    def create_state(
        self, prompt: str, seed: int, options: dict[str, Any] | None = None, *, start_chunk: int = 0
    ) -> SessionState:
        _check_options(options)
        region, tensors = allocate_region(self.state_layout(), self.device)
        region.zero_()
        tensors["prompt_embeds"].copy_(self.encode_prompt(prompt))
        meta = self.session_meta(prompt, seed, options, start_chunk, {"frames_written": 0})
        return SessionState(tensors=tensors, meta=meta, region=region)

    @torch.inference_mode()
    def encode_prompt(self, prompt: str) -> torch.Tensor:
        """UMT5 embeddings of `prompt` (padding zeroed, as Wan does) projected to the DiT width."""
        text = " ".join(prompt.split())
        tokens = self.net.tokenizer(
            [text],
            padding="max_length",
            max_length=self.arch.text_len,
            truncation=True,
            add_special_tokens=True,
            return_attention_mask=True,
            return_tensors="pt",
        )
        ids = tokens.input_ids.to(self.device)
        mask = tokens.attention_mask.to(self.device)
        hidden = self.net.text_encoder(input_ids=ids, attention_mask=mask).last_hidden_state
        hidden = hidden * mask[..., None].to(hidden.dtype)
        context = self.net.transformer.condition_embedder.text_embedder(hidden.to(self.dtype))
        return context[0].to(self.dtype)

    def chunk_noise(self, state: SessionState, chunk_index: int) -> torch.Generator:
        return torch.Generator(device="cpu").manual_seed(splitmix64(int(state.meta["seed"]), chunk_index))

    # -- generation ----------------------------------------------------------------------------

    @torch.inference_mode()
    def diffuse(self, states: list[SessionState], embeddings: list[torch.Tensor | None]) -> torch.Tensor:
        """The diffuse stage → clean latents ``[B, F, C, h, w]`` (float32). ``embeddings[i]`` (when
        not None) is a new prompt's encoding: it replaces the session's, and with ``kv_recache`` the
        window is re-cached under it (LongLive) before the chunk."""
        arch = self.arch
        fpc = arch.frames_per_chunk
        chunk_indices = [s.next_chunk for s in states]
        for state, encoded in zip(states, embeddings, strict=True):
            if encoded is not None:
                state.tensors["prompt_embeds"].copy_(encoded)
                if arch.kv_recache and int(state.meta["frames_written"]) > 0:
                    self._recache(state)

        latent_shape = (fpc, self.latent_channels, arch.latent_height, arch.latent_width)
        generators = [self.chunk_noise(s, c) for s, c in zip(states, chunk_indices, strict=True)]
        per_session = [
            torch.stack([torch.randn(latent_shape, generator=g) for _ in self.sigmas]) for g in generators
        ]
        noise_all = torch.stack(per_session, dim=1).to(self.device)  # [steps, B, F, C, h, w]

        context = torch.stack([s.tensors["prompt_embeds"] for s in states])
        frames_written = [int(s.meta["frames_written"]) for s in states]
        positions = torch.tensor([[fw + i for i in range(fpc)] for fw in frames_written], dtype=torch.float64)
        rope = rope_tables(self.rope_shape, positions, self.device)  # type: ignore[arg-type]
        valid = [self._valid_slots(fw) for fw in frames_written]
        cache = self._cache_plan(valid)

        x = few_step_sample(
            lambda x, sigma: self._forward(x, sigma, context, rope, states, cache, write_slots=None),
            self.sigmas,
            noise_all,
        )
        slots = torch.tensor([self._ring_slots(fw) for fw in frames_written], device=self.device)
        self._forward(x, 0.0, context, rope, states, cache, write_slots=slots)
        for i, state in enumerate(states):
            state.tensors["latent_window"].index_copy_(0, slots[i], x[i])

        for i, state in enumerate(states):
            state.meta["frames_written"] = frames_written[i] + fpc
            state.meta["next_chunk"] = chunk_indices[i] + 1
        return x

    def _ring_slot(self, frame: int) -> int:
        sink, local = self.arch.sink_frames, self.arch.window_frames - self.arch.sink_frames
        return frame if frame < sink else sink + (frame - sink) % local

    def _ring_slots(self, frames_written: int) -> list[int]:
        return [self._ring_slot(frames_written + i) for i in range(self.arch.frames_per_chunk)]

    def _window_frames(self, frames_written: int) -> list[int]:
        """Absolute indices of the frames the cache holds after `frames_written` frames, in order."""
        sink, local = self.arch.sink_frames, self.arch.window_frames - self.arch.sink_frames
        kept_sink = list(range(min(frames_written, sink)))
        return kept_sink + list(range(max(sink, frames_written - local), frames_written))

    def _valid_slots(self, frames_written: int) -> set[int]:
        return {self._ring_slot(f) for f in self._window_frames(frames_written)}

    def _cache_plan(self, valid: list[set[int]]) -> tuple[int, torch.Tensor | None]:
        """(number of cache slots to read, boolean key mask [B, slots*T] or None when every session's
        valid slots are the same prefix)."""
        read = max((max(v) + 1 for v in valid if v), default=0)
        if read == 0:
            return 0, None
        if all(v == set(range(read)) for v in valid):
            return read, None
        tpf = self.arch.tokens_per_frame
        mask = torch.zeros(len(valid), read, tpf, dtype=torch.bool)
        for i, slots in enumerate(valid):
            for slot in slots:
                mask[i, slot] = True
        return read, mask.view(len(valid), read * tpf).to(self.device)

    def _recache(self, state: SessionState) -> None:
        """LongLive's KV re-cache: re-run the frames held in the window through the DiT at t=0 under
        the session's (new) prompt, chunk by chunk in stream order, each attending to the frames
        already re-cached, and overwrite their keys/values."""
        fpc = self.arch.frames_per_chunk
        frames = self._window_frames(int(state.meta["frames_written"]))
        groups: dict[int, list[int]] = {}
        for frame in frames:
            groups.setdefault(frame // fpc, []).append(frame)
        context = state.tensors["prompt_embeds"].unsqueeze(0)
        done: set[int] = set()
        for group in groups.values():
            slots = [self._ring_slot(f) for f in group]
            slot_t = torch.tensor(slots, device=self.device)
            latents = state.tensors["latent_window"].index_select(0, slot_t).unsqueeze(0)
            positions = torch.tensor([group], dtype=torch.float64)
            rope = rope_tables(self.rope_shape, positions, self.device)  # type: ignore[arg-type]
            plan = self._cache_plan([done])
            self._forward(latents, 0.0, context, rope, [state], plan, write_slots=slot_t.unsqueeze(0))
            done.update(slots)

    def _forward(
        self,
        latents: torch.Tensor,
        sigma: float,
        context: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor],
        states: list[SessionState],
        cache: tuple[int, torch.Tensor | None],
        write_slots: torch.Tensor | None,
        *,
        job_step: bool = False,
    ) -> torch.Tensor:
        """Flow velocity of `latents` [B, F, C, h, w] at noise level `sigma`; with `write_slots` the
        pass writes the chunk's keys/values into each session's ring instead. A job step's
        denoising pass (`job_step`) checks `abandon_on`'s flag at each block boundary."""
        dit = self.net.transformer
        b, f, c, h, w = latents.shape
        p = self.patch
        x = dit.patch_embedding(latents.to(self.dtype).transpose(1, 2))  # [B, D, F, h/p, w/p]
        x = x.flatten(2).transpose(1, 2).contiguous()  # [B, N, D], frame-major like the RoPE tables
        cond = dit.condition_embedder
        t = torch.full((b,), sigma * 1000.0, device=self.device)
        temb = cond.time_embedder(cond.timesteps_proj(t).float()).type_as(x)
        modulation = cond.time_proj(cond.act_fn(temb)).unflatten(1, (6, -1))  # [B, 6, D]
        read, mask = cache
        kv_cache = KvCacheBatch(states, read=read, write_slots=write_slots)
        for index, block in enumerate(dit.blocks):
            if job_step:
                self.check_abandon()  # a job step's block boundary (`abandon_on`)
            cache_k, cache_v = kv_cache.cached(index)
            # The steady state (window full, no mask) has one shape per batch size: CUDA graphs.
            fixed = read == self.arch.window_frames and mask is None and not job_step
            args = (self, block, x, modulation, context, rope, cache_k, cache_v, mask)
            x, k, v = self.accel.block(index, WanCausalModel._block, args, fixed_shape=fixed)
            kv_cache.write(index, k, v)
        if write_slots is not None:
            return latents
        shift, scale = (dit.scale_shift_table + temb.float().unsqueeze(1)).chunk(2, dim=1)
        out = dit.proj_out((dit.norm_out(x.float()) * (1 + scale) + shift).type_as(x))
        # proj_out lays each token out as (p_t, p_h, p_w, C), as diffusers unpatchifies it.
        out = out.view(b, f, h // p, w // p, p, p, c).permute(0, 1, 6, 2, 4, 3, 5).reshape(b, f, c, h, w)
        return out.float()

    def _block(
        self,
        block: torch.nn.Module,
        x: torch.Tensor,
        modulation: torch.Tensor,
        context: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor],
        cache_k: torch.Tensor | None,
        cache_v: torch.Tensor | None,
        cache_mask: torch.Tensor | None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """A diffusers `WanTransformerBlock` with causal self-attention over cache + chunk. Returns
        (x, k, v) with this chunk's RoPE'd keys and values [B, N, D] for the cache pass."""
        heads = self.heads
        shift, scale, gate, c_shift, c_scale, c_gate = (block.scale_shift_table + modulation.float()).chunk(
            6, dim=1
        )
        attn = block.attn1
        y = (block.norm1(x.float()) * (1 + scale) + shift).type_as(x)
        q = apply_rope(attn.norm_q(attn.to_q(y)).unflatten(2, (heads, -1)), rope)
        k = apply_rope(attn.norm_k(attn.to_k(y)).unflatten(2, (heads, -1)), rope)
        v = attn.to_v(y).unflatten(2, (heads, -1))
        out = attention_over_cache(q, k, v, cache_k, cache_v, cache_mask, attention=self.accel.attention)
        out = attn.to_out[0](out.transpose(1, 2).flatten(2))
        x = (x.float() + out * gate).type_as(x)
        x = x + block.attn2(block.norm2(x.float()).type_as(x), context)
        y = (block.norm3(x.float()) * (1 + c_scale) + c_shift).type_as(x)
        x = (x.float() + block.ffn(y).float() * c_gate).type_as(x)
        return x, k.flatten(2), v.flatten(2)

    @torch.inference_mode()
    def decode(self, latents: torch.Tensor, caches: list[dict[str, torch.Tensor]]) -> torch.Tensor:
        """The decode stage: uint8 frames [B, video_frames_per_chunk, H, W, 3] through each session's
        decoder cache (updated in place).

        A stream's first latent frame decodes to one image (the causal VAE's start); it is shown for
        `temporal_upsample` frames so every chunk has the same length and duration.
        """
        out = torch.empty(
            len(caches),
            self.frames_per_chunk,
            self.height,
            self.width,
            3,
            dtype=torch.uint8,
            device=self.device,
        )
        decoded = [int(cache[self.DECODED].item()) for cache in caches]
        started = [i for i, count in enumerate(decoded) if count > 0]
        fresh = [i for i, count in enumerate(decoded) if count == 0]
        for group, first in ((started, False), (fresh, True)):
            if group:
                out[group] = self._decode_group([caches[i] for i in group], latents[group], first)
        for cache in caches:
            cache[self.DECODED].add_(latents.shape[1])
        return out

    def _decode_group(
        self, caches: list[dict[str, torch.Tensor]], latents: torch.Tensor, first: bool
    ) -> torch.Tensor:
        vae = self.net.vae
        cache: list[Any] = [None] * self.vae_cache_slots
        if not first:
            for index, _ in self.vae_cache_shapes:
                cache[index] = torch.stack([c[f"vae_cache.{index:02d}"] for c in caches])
        z = latents.transpose(1, 2).to(self.dtype)  # [B, C, F, h, w]
        z = z * self.latents_std.to(self.dtype) + self.latents_mean.to(self.dtype)
        x = vae.post_quant_conv(z)
        pieces = []
        for i in range(x.shape[2]):
            pieces.append(
                vae.decoder(x[:, :, i : i + 1], feat_cache=cache, feat_idx=[0], first_chunk=first and i == 0)
            )
        video = torch.cat(pieces, dim=2).clamp(-1.0, 1.0)  # [B, 3, T, H, W]
        if first:
            video = torch.cat(
                [video[:, :, :1].expand(-1, -1, self.arch.temporal_upsample - 1, -1, -1), video], 2
            )
        for index, _ in self.vae_cache_shapes:
            for j, c in enumerate(caches):
                c[f"vae_cache.{index:02d}"].copy_(cache[index][j])
        rgb = ((video.float() + 1.0) * 127.5).round().clamp(0, 255).to(torch.uint8)
        return rgb.permute(0, 2, 3, 4, 1)  # [B, T, H, W, 3]

    # -- one-shot jobs (issue 14) ---------------------------------------------------------------
    # A job is the causal generator's own autoregressive rollout for a fixed prompt: chunk after
    # chunk, each sampled in the few steps of `self.sigmas` over the job's KV ring, exactly as a
    # session generates it (its noise is the session's: chunk c's draws from splitmix64(seed, c)),
    # then decoded chunk by chunk through a fresh decoder cache. A job step is one denoising step
    # of one chunk; the last step of a chunk also writes its keys/values into the ring (the t=0
    # pass) and puts the next chunk's first draw in place. The region: ``latents`` (every chunk's
    # latent frames: clean for the chunks done, the sampler's current state for the chunk in
    # progress, its first draw for the next), ``prompt_embeds`` and ``kv_cache`` (the session's
    # layout). No bidirectional sampler: the adapter loads the causal few-step generator only.

    MAX_JOB_CHUNKS = 32

    def job_chunks(self, kind: str, frames: int) -> int:
        """Chunks of the rollout a job takes: an image is the first frame of one chunk."""
        per_chunk = self.frames_per_chunk
        return 1 if kind == "image" else -(-int(frames) // per_chunk)

    def job_steps_for(self, *, kind: str, frames: int, steps: int) -> int:
        return self.job_chunks(kind, frames) * len(self.sigmas)

    def check_job(self, *, kind: str, width: int, height: int, frames: int, steps: int) -> None:
        self.check_job_common(kind=kind, width=width, height=height, frames=frames, steps=steps)
        if (width, height) != (self.width, self.height):
            field = "width" if width != self.width else "height"
            raise JobSpecError(
                field,
                f"{self.preset!r} renders {self.width}x{self.height} only (the causal generator's KV "
                f"cache and VAE decoder cache are laid out at its own size), not {width}x{height}",
            )
        chunks = self.job_chunks(kind, frames)
        if chunks > self.MAX_JOB_CHUNKS:
            most = self.MAX_JOB_CHUNKS * self.frames_per_chunk
            raise JobSpecError("frames", f"at most {most} for {self.preset!r}, not {frames}")
        per_chunk = len(self.sigmas)
        if steps != chunks * per_chunk:
            raise JobSpecError(
                "steps",
                f"{self.preset!r} samples each chunk in its {per_chunk} steps; this {kind} is {chunks} "
                f"chunk(s) of {self.frames_per_chunk} frames, so steps must be {chunks * per_chunk}, not {steps}",
            )

    def job_layout(self, meta: dict[str, Any]) -> list[tuple[str, tuple[int, ...], torch.dtype]]:
        arch = self.arch
        latent_frames = self.job_chunks(str(meta["kind"]), int(meta["frames"])) * arch.frames_per_chunk
        by_name = {name: (shape, dtype) for name, shape, dtype in self.state_layout()}
        return [
            ("latents", (latent_frames, self.latent_channels, arch.latent_height, arch.latent_width),
             torch.float32),
            ("prompt_embeds", *by_name["prompt_embeds"]),
            ("kv_cache", *by_name["kv_cache"]),
        ]  # fmt: skip

    def _job_draw(self, seed: int, chunk: int, step: int) -> torch.Tensor:
        """Draw `step` of chunk `chunk`'s noise: what a session with `seed` draws for that chunk."""
        arch = self.arch
        shape = (arch.frames_per_chunk, self.latent_channels, arch.latent_height, arch.latent_width)
        generator = torch.Generator(device="cpu").manual_seed(splitmix64(int(seed), int(chunk)))
        for _ in range(step):
            torch.randn(shape, generator=generator)
        return torch.randn(shape, generator=generator)

    def init_job(self, tensors: dict[str, torch.Tensor], seed: int, embeddings: torch.Tensor) -> None:
        tensors["prompt_embeds"].copy_(embeddings)
        tensors["kv_cache"].zero_()
        latents = tensors["latents"]
        latents.zero_()
        latents[: self.arch.frames_per_chunk].copy_(self._job_draw(seed, 0, 0))

    @torch.inference_mode()
    def job_step(self, states: list[SessionState]) -> None:
        """One denoising step of one chunk of each job. Jobs at the same step of their chunk run as
        one batch (at any chunk: positions and cache masks per job, as sessions are batched).

        Inside `abandon_on` the step stops at a DiT block boundary of its denoising passes; nothing
        is written before every group's pass is done (the chunk's KV write pass and the latents
        come after the last boundary), so an abandoned step leaves every region as it was."""
        if not states:
            return
        self.check_job_batch(states)
        per_chunk = len(self.sigmas)
        groups: dict[int, list[SessionState]] = {}
        for state in states:
            groups.setdefault(int(state.meta["step"]) % per_chunk, []).append(state)
        denoised = [(k, group, self._job_group_denoise(group, k)) for k, group in sorted(groups.items())]
        self.check_abandon()  # the last boundary: from here on the step writes
        for k, group, pending in denoised:
            self._job_group_write(group, k, *pending)

    def _job_group_denoise(self, states: list[SessionState], k: int) -> tuple[Any, ...]:
        """The denoising pass of jobs at step `k` of their chunks: the sampler's next state, and
        what the write needs (chunks, context, RoPE, cache plan). Writes nothing."""
        fpc = self.arch.frames_per_chunk
        chunks = [int(s.meta["step"]) // len(self.sigmas) for s in states]
        x = torch.stack(
            [s.tensors["latents"][c * fpc : (c + 1) * fpc] for s, c in zip(states, chunks, strict=True)]
        )
        context = torch.stack([s.tensors["prompt_embeds"] for s in states])
        frames_written = [c * fpc for c in chunks]
        positions = torch.tensor([[fw + i for i in range(fpc)] for fw in frames_written], dtype=torch.float64)
        rope = rope_tables(self.rope_shape, positions, self.device)  # type: ignore[arg-type]
        cache = self._cache_plan([self._valid_slots(fw) for fw in frames_written])
        sigma = self.sigmas[k]
        velocity = self._forward(x, sigma, context, rope, states, cache, write_slots=None, job_step=True)
        x = few_step_update(
            x,
            sigma * velocity,
            self.sigmas,
            k,
            lambda: torch.stack(
                [self._job_draw(int(s.meta["seed"]), c, k + 1) for s, c in zip(states, chunks, strict=True)]
            ).to(self.device),
        )
        return x, chunks, context, rope, cache

    def _job_group_write(
        self,
        states: list[SessionState],
        k: int,
        x: torch.Tensor,
        chunks: list[int],
        context: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor],
        cache: tuple[int, torch.Tensor | None],
    ) -> None:
        fpc = self.arch.frames_per_chunk
        last = k + 1 == len(self.sigmas)
        if last:  # the chunk is clean: its keys/values go into the ring, as a session's do
            slots = torch.tensor([self._ring_slots(c * fpc) for c in chunks], device=self.device)
            self._forward(x, 0.0, context, rope, states, cache, write_slots=slots)
        for i, state in enumerate(states):
            latents = state.tensors["latents"]
            start = chunks[i] * fpc
            latents[start : start + fpc].copy_(x[i])
            if last and start + fpc < latents.shape[0]:
                latents[start + fpc : start + 2 * fpc].copy_(
                    self._job_draw(int(state.meta["seed"]), chunks[i] + 1, 0)
                )
            state.meta["step"] = int(state.meta["step"]) + 1

    @torch.inference_mode()
    def job_frames(self, state: SessionState) -> torch.Tensor:
        """The finished rollout decoded chunk by chunk through a fresh decoder cache, as a session's
        chunks are: uint8 [frames, H, W, 3]. Reads only the job's latents and meta (`decode_job`)."""
        fpc = self.arch.frames_per_chunk
        latents = state.tensors["latents"]
        layout = [entry for entry in self.state_layout() if entry[0].startswith(self.DECODER_PREFIX)]
        region, cache = allocate_region(layout, self.device)
        region.zero_()
        pieces = [
            self.decode(latents[start : start + fpc][None], [cache])[0]
            for start in range(0, latents.shape[0], fpc)
        ]
        return torch.cat(pieces)[: int(state.meta["frames"])]


def _check_options(options: dict[str, Any] | None) -> None:
    if options:
        raise ValueError(f"wan-causal takes no per-session options, got {sorted(options)}")
