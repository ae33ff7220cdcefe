"""The model presets, defined once (pure Python: no torch, so the web process can read them).

A preset is a name users ask for, the model class that builds it (``package.module:ClassName``,
resolved by ``workers.runtime.models``), a description, and the model's architecture. Everything
else is derived from this table: the runtime's model registry and configurations
(``workers.runtime.models``, ``causal_dit.PRESETS``) and the control plane's catalogue
(``contracts.catalog``: resolution, frame rate and chunk length users see).
"""

from __future__ import annotations

from dataclasses import dataclass

DEFAULT_PRESET = "demo"

# The longest video each model family denoises as one one-shot job (issue 14): the runtime's
# `check_job` refuses longer ones, and the control plane (`sessions.jobs`) refuses them before they
# reach a worker, which would refuse the job again at every dispatch.
CAUSAL_DIT_MAX_JOB_LATENT_FRAMES = 16
DEMO_MAX_JOB_FRAMES = 64


@dataclass(frozen=True)
class CausalDiTArchitecture:
    """Shapes of the reference causal video DiT (see ``workers.runtime.models.causal_dit``)."""

    latent_channels: int
    latent_height: int
    latent_width: int
    patch: int
    frames_per_chunk: int
    dim: int
    heads: int
    ffn_dim: int
    blocks: int
    window_frames: int
    sink_frames: int
    text_len: int
    text_dim: int
    text_heads: int
    text_layers: int
    decoder_dim: int
    spatial_upsample: int
    temporal_upsample: int
    fps: float
    dtype: str
    denoising_steps: int = 4

    def __post_init__(self) -> None:
        if self.latent_height % self.patch or self.latent_width % self.patch:
            raise ValueError("latent size must be a multiple of the patch size")
        if self.dim % self.heads or (self.dim // self.heads) % 2:
            raise ValueError("dim must split into heads of even size")
        if self.window_frames - self.sink_frames < self.frames_per_chunk:
            raise ValueError("the local KV window must hold at least one chunk")
        if self.sink_frames < 0 or self.denoising_steps < 1:
            raise ValueError("sink_frames >= 0 and denoising_steps >= 1 required")

    @property
    def tokens_per_frame(self) -> int:
        return (self.latent_height // self.patch) * (self.latent_width // self.patch)

    @property
    def head_dim(self) -> int:
        return self.dim // self.heads

    @property
    def width(self) -> int:
        return self.latent_width * self.spatial_upsample

    @property
    def height(self) -> int:
        return self.latent_height * self.spatial_upsample

    @property
    def video_frames_per_chunk(self) -> int:
        return self.frames_per_chunk * self.temporal_upsample

    @property
    def job_frame_unit(self) -> int:
        """A one-shot video is whole latent frames, each decoded to this many frames."""
        return self.temporal_upsample

    @property
    def max_job_frames(self) -> int:
        return CAUSAL_DIT_MAX_JOB_LATENT_FRAMES * self.temporal_upsample


@dataclass(frozen=True)
class DemoArchitecture:
    """Shapes of the trained demo model (see ``workers.runtime.models.demo``, docs/models.md)."""

    width: int
    height: int
    frames_per_chunk: int
    fps: float
    embed_dim: int
    slots: int
    hidden: int
    shape_dim: int
    # Trained weights shipped in the repository, relative to workers/runtime/models/.
    weights: str

    @property
    def video_frames_per_chunk(self) -> int:
        return self.frames_per_chunk

    @property
    def job_frame_unit(self) -> int:
        return 1

    @property
    def max_job_frames(self) -> int:
        return DEMO_MAX_JOB_FRAMES


@dataclass(frozen=True)
class Preset:
    name: str
    description: str
    # The StreamingVideoModel subclass that builds it, as ``package.module:ClassName``.
    model: str
    architecture: CausalDiTArchitecture | DemoArchitecture


CAUSAL_DIT = "workers.runtime.models.causal_dit:CausalDiTModel"
DEMO = "workers.runtime.models.demo:DemoModel"

PRESETS: dict[str, Preset] = {
    # Trained in minutes on a CPU: follows its prompt; 4 frames of 128×128 per chunk at 8 fps.
    "demo": Preset(
        name="demo",
        description=(
            "Trained demo: draws the shape (circle, square, triangle, diamond), colour, background, "
            "direction and speed its prompt names, e.g. a red circle moving left on a blue background"
        ),
        model=DEMO,
        architecture=DemoArchitecture(
            width=128, height=128, frames_per_chunk=4, fps=8.0, embed_dim=32, slots=5, hidden=64,
            shape_dim=16, weights="weights/demo.safetensors",
        ),
    ),
    # One CPU core: 4 frames of 64×64 per chunk in a few tens of milliseconds.
    "tiny": Preset(
        name="tiny",
        description="Small causal video DiT that runs on one CPU core (development and demo)",
        model=CAUSAL_DIT,
        architecture=CausalDiTArchitecture(
            latent_channels=4, latent_height=8, latent_width=8, patch=2, frames_per_chunk=2,
            dim=128, heads=4, ffn_dim=512, blocks=4, window_frames=8, sink_frames=2,
            text_len=32, text_dim=64, text_heads=4, text_layers=1,
            decoder_dim=32, spatial_upsample=8, temporal_upsample=2, fps=8.0, dtype="float32",
        ),
    ),
    # A few CPU cores or any GPU: 12 frames of 128×128 per chunk.
    "small": Preset(
        name="small",
        description="Larger causal video DiT for CPU benchmarks and small GPUs",
        model=CAUSAL_DIT,
        architecture=CausalDiTArchitecture(
            latent_channels=8, latent_height=16, latent_width=16, patch=2, frames_per_chunk=3,
            dim=256, heads=4, ffn_dim=1024, blocks=6, window_frames=12, sink_frames=3,
            text_len=64, text_dim=128, text_heads=4, text_layers=2,
            decoder_dim=64, spatial_upsample=8, temporal_upsample=4, fps=16.0, dtype="float32",
        ),
    ),
    # Wan2.1-T2V-1.3B shapes (random weights): 30 blocks, width 1536, 12 heads, FFN 8960,
    # 1,560 tokens per latent frame at 832×480, 3 latent frames (12 video frames) per chunk,
    # KV window of 12 latent frames (3 sink + 9 local, LongLive) → ≈ 3.45 GB of state per session.
    "wan-1.3b": Preset(
        name="wan-1.3b",
        description="Wan2.1-T2V-1.3B tensor shapes (random weights); needs a datacenter GPU",
        model=CAUSAL_DIT,
        architecture=CausalDiTArchitecture(
            latent_channels=16, latent_height=60, latent_width=104, patch=2, frames_per_chunk=3,
            dim=1536, heads=12, ffn_dim=8960, blocks=30, window_frames=12, sink_frames=3,
            text_len=512, text_dim=512, text_heads=8, text_layers=2,
            decoder_dim=128, spatial_upsample=8, temporal_upsample=4, fps=16.0, dtype="bfloat16",
        ),
    ),
}  # fmt: skip
