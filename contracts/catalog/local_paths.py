"""Model presets served from a local checkpoint directory (``MODEL_PATHS``), pure Python.

``MODEL_PATHS=wan-causal=/models/self-forcing,longlive=/models/longlive`` registers one preset per
entry. The control plane reads only the small JSON files of the directory (the component configs
and the optional ``streamserve.json``) to learn what the catalogue shows — resolution, frame rate,
chunk length; the worker loads the weights (``workers.runtime.models.wan_causal``).

The directory is the diffusers layout of Wan2.1-T2V (``Wan-AI/Wan2.1-T2V-1.3B-Diffusers``):
``transformer/`` (WanTransformer3DModel), ``text_encoder/`` (UMT5EncoderModel), ``tokenizer/``,
``vae/`` (AutoencoderKLWan), optionally overlaid by a causal generator checkpoint published by
Self-Forcing (``checkpoints/self_forcing_dmd.pt``), CausVid (``autoregressive_checkpoint/model.pt``)
or LongLive (``models/longlive_base.pt``) whose ``generator_ema``/``generator`` state dict holds the
Wan DiT under a ``model.`` prefix in the original Wan parameter names. ``streamserve.json`` (optional)
overrides the streaming settings below; the defaults are the Self-Forcing / LongLive inference
settings at 832×480.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from contracts.catalog.presets import PRESETS, Preset

WAN_CAUSAL = "workers.runtime.models.wan_causal:WanCausalModel"
SETTINGS_FILE = "streamserve.json"
COMPONENTS = ("transformer", "text_encoder", "tokenizer", "vae")
# The original Wan2.1 release (`Wan-AI/Wan2.1-T2V-1.3B`, what Self-Forcing, CausVid and LongLive put
# under `wan_models/`): the DiT config and weights at the top, the UMT5 encoder and the VAE as torch
# pickles in Wan's own parameter names, the tokenizer under google/umt5-xxl/.
WAN_FILES = {
    "text_encoder": "models_t5_umt5-xxl-enc-bf16.pth",
    "vae": "Wan2.1_VAE.pth",
    "tokenizer": "google/umt5-xxl",
}
# Where the causal projects put their generator checkpoint, relative to the model directory.
GENERATOR_CHECKPOINTS = (
    "checkpoints/self_forcing_dmd.pt",
    "self_forcing_dmd.pt",
    "longlive_models/models/longlive_base.pt",
    "models/longlive_base.pt",
    "longlive_base.pt",
    "autoregressive_checkpoint/model.pt",
    "generator.safetensors",
)
LORA_CHECKPOINTS = ("longlive_models/models/lora.pt", "models/lora.pt", "lora.pt")


class ModelLayoutError(ValueError):
    """A checkpoint directory does not have the expected layout; the message names the file and,
    for weights, the missing or unexpected parameter."""


@dataclass(frozen=True)
class WanCausalArchitecture:
    """Streaming settings of a Wan2.1-based causal model served from `path`.

    Latent frames are `spatial_upsample`× smaller than the video and each decodes to
    `temporal_upsample` video frames (the Wan VAE: 8 and 4). A chunk is `frames_per_chunk` latent
    frames denoised at `denoising_timesteps` (out of 1000, warped by `timestep_shift` as
    Self-Forcing's `warp_denoising_step`). The KV cache keeps `sink_frames` attention-sink frames
    and a ring of the most recent `window_frames - sink_frames` frames (LongLive: 3 + 9).
    `kv_recache` re-computes the cached keys under a new prompt when the prompt changes (LongLive).
    """

    path: str
    width: int = 832
    height: int = 480
    fps: float = 16.0
    frames_per_chunk: int = 3
    window_frames: int = 12
    sink_frames: int = 3
    denoising_timesteps: tuple[int, ...] = (1000, 750, 500, 250)
    timestep_shift: float = 5.0
    text_len: int = 512
    kv_recache: bool = True
    # Relative to `path`; "" = look for the published names (GENERATOR_CHECKPOINTS), none = plain Wan.
    generator_checkpoint: str = ""
    # LongLive's LoRA over the generator (peft state dict, rank 256 / alpha 256), merged at load;
    # "" = look for the published names (LORA_CHECKPOINTS). lora_alpha None = the rank (scale 1).
    lora_checkpoint: str = ""
    lora_alpha: float | None = None
    # Which state dict of a training checkpoint to serve: the EMA weights when present.
    checkpoint_keys: tuple[str, ...] = ("generator_ema", "generator", "model", "state_dict")
    dtype: str = "auto"  # bfloat16 on CUDA, float32 on CPU
    spatial_upsample: int = 8
    temporal_upsample: int = 4
    patch: tuple[int, int, int] = (1, 2, 2)
    layout: str = "diffusers"  # or "wan": the original Wan2.1 release (WAN_FILES)
    base: str = ""  # the Wan2.1 folder: `path` itself, or its PROJECT_BASE
    extra: dict[str, Any] = field(default_factory=dict, compare=False)

    def __post_init__(self) -> None:
        if self.width % (self.spatial_upsample * self.patch[2]) or self.height % (
            self.spatial_upsample * self.patch[1]
        ):
            raise ModelLayoutError(
                f"{self.path}: width and height must be multiples of "
                f"{self.spatial_upsample * self.patch[1]} (VAE × patch), got {self.width}x{self.height}"
            )
        if self.frames_per_chunk < 1 or self.sink_frames < 0:
            raise ModelLayoutError(f"{self.path}: frames_per_chunk >= 1 and sink_frames >= 0 required")
        if self.window_frames - self.sink_frames < self.frames_per_chunk:
            raise ModelLayoutError(f"{self.path}: the local KV window must hold at least one chunk")
        if not self.denoising_timesteps or any(not 0 < t <= 1000 for t in self.denoising_timesteps):
            raise ModelLayoutError(f"{self.path}: denoising_timesteps must lie in (0, 1000]")

    @property
    def latent_height(self) -> int:
        return self.height // self.spatial_upsample

    @property
    def latent_width(self) -> int:
        return self.width // self.spatial_upsample

    @property
    def tokens_per_frame(self) -> int:
        return (self.latent_height // self.patch[1]) * (self.latent_width // self.patch[2])

    @property
    def video_frames_per_chunk(self) -> int:
        return self.frames_per_chunk * self.temporal_upsample

    @property
    def denoising_steps(self) -> int:
        """Sampler steps per chunk (a one-shot job takes this many per chunk of its rollout)."""
        return len(self.denoising_timesteps)

    def lora_path(self) -> Path | None:
        """LongLive's LoRA checkpoint merged into the generator, or None."""
        root = Path(self.path)
        if self.lora_checkpoint:
            candidate = root / self.lora_checkpoint
            if not candidate.is_file():
                raise ModelLayoutError(f"{candidate}: lora_checkpoint of {SETTINGS_FILE} not found")
            return candidate
        for name in LORA_CHECKPOINTS:
            if (root / name).is_file():
                return root / name
        return None

    def generator_path(self) -> Path | None:
        """The generator checkpoint overlaid on ``transformer/``, or None for plain Wan weights."""
        root = Path(self.path)
        if self.generator_checkpoint:
            candidate = root / self.generator_checkpoint
            if not candidate.is_file():
                raise ModelLayoutError(f"{candidate}: generator_checkpoint of {SETTINGS_FILE} not found")
            return candidate
        for name in GENERATOR_CHECKPOINTS:
            if (root / name).is_file():
                return root / name
        return None


def read_json(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        raise ModelLayoutError(f"{path}: missing") from None
    except (OSError, json.JSONDecodeError) as exc:
        raise ModelLayoutError(f"{path}: unreadable ({exc})") from exc
    if not isinstance(data, dict):
        raise ModelLayoutError(f"{path}: expected a JSON object")
    return data


# A causal project's own tree: the Wan2.1 release where their READMEs download it, the generator
# checkpoint beside it (Self-Forcing `checkpoints/`, LongLive `longlive_models/models/`, CausVid).
PROJECT_BASE = "wan_models/Wan2.1-T2V-1.3B"


def read_wan_architecture(path: str | Path) -> WanCausalArchitecture:
    """Check the directory's layout (component folders and configs) and read its streaming settings.

    `path` is a Wan2.1 folder (diffusers or original layout), optionally holding a generator
    checkpoint, or a causal project's tree whose `wan_models/Wan2.1-T2V-1.3B` is the Wan2.1 folder."""
    project = Path(path)
    if not project.is_dir():
        raise ModelLayoutError(f"{project}: not a directory")
    root = project / PROJECT_BASE if (project / PROJECT_BASE).is_dir() else project
    top = read_json(root / "config.json") if (root / "config.json").is_file() else {}
    if (root / "transformer").is_dir() or not {"dim", "num_heads"} <= set(top):
        layout = "diffusers"
        for component in COMPONENTS:
            if not (root / component).is_dir():
                raise ModelLayoutError(
                    f"{root / component}: missing (expected the diffusers Wan2.1 layout: "
                    f"{', '.join(c + '/' for c in COMPONENTS)}, or the original one: config.json, "
                    f"{', '.join(WAN_FILES.values())})"
                )
        transformer = read_json(root / "transformer" / "config.json")
        vae = read_json(root / "vae" / "config.json")
    else:
        layout = "wan"
        transformer = top
        for name in WAN_FILES.values():
            if not (root / name).exists():
                raise ModelLayoutError(f"{root / name}: missing (the original Wan2.1 layout)")
        vae = {}  # the Wan2.1 VAE: 8× spatial, 4× temporal
    settings: dict[str, Any] = {}
    if (project / SETTINGS_FILE).is_file():
        settings = read_json(project / SETTINGS_FILE)
    known = {f.name for f in fields(WanCausalArchitecture)} - {"path", "extra", "patch", "layout", "base"}
    unknown = sorted(set(settings) - known)
    if unknown:
        raise ModelLayoutError(
            f"{project / SETTINGS_FILE}: unknown setting(s) {unknown}; known: {sorted(known)}"
        )
    for key in ("denoising_timesteps", "checkpoint_keys"):
        if key in settings:
            settings[key] = tuple(settings[key])
    temporal = vae.get("temperal_downsample", [False, True, True])
    return WanCausalArchitecture(
        path=str(project),
        base=str(root),
        layout=layout,
        patch=tuple(transformer.get("patch_size", (1, 2, 2))),
        spatial_upsample=2 ** len(vae.get("dim_mult", [1, 2, 4, 4])[1:]),
        temporal_upsample=2 ** sum(bool(t) for t in temporal),
        **settings,
    )


def register_model_path(name: str, path: str | Path) -> Preset:
    """Register preset `name` served from the checkpoint directory `path` (see the module docstring).

    Built-in presets cannot be replaced; registering the same name twice with the same directory is
    a no-op (settings may be loaded by several entry points of one process).
    """
    arch = read_wan_architecture(path)
    existing = PRESETS.get(name)
    if existing is not None:
        if isinstance(existing.architecture, WanCausalArchitecture) and existing.architecture == arch:
            return existing
        raise ValueError(f"preset {name!r} already exists; choose another name for {path}")
    generator = arch.generator_path()
    source = f"{generator.name} over {Path(path).name}" if generator else Path(path).name
    preset = Preset(
        name=name,
        description=f"Wan2.1 causal video model from {source} (local checkpoint; GPU)",
        model=WAN_CAUSAL,
        architecture=arch,  # type: ignore[arg-type]
    )
    PRESETS[name] = preset
    return preset
