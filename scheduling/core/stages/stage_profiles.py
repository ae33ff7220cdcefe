"""Stage profiles: time and memory of encode (E), diffuse (D) and decode (C) per request shape and degree.

TridentServe's planners read everything from an offline profiler (§5.1): per stage, the expected
running time and peak activation memory under each parallel degree. We have no GPU to profile on,
so each figure comes from one of two places, and docs/stages.md lists which is which:

* **Published figures** — parameter counts (paper Table 2: T5-XXL 4.8 B, SD3-DiT 2 B, AE-KL 0.1 B;
  Wan2.1 14 B DiT, UMT5-XXL ≈ 11 GB bf16 per NOTES-wave2; wan-1.3b ≈ 2.6 GB bf16), the L20 testbed
  (48 GB, 119.5 TFLOPS bf16, 864 GB/s, PCIe 4.0 x16 between GPUs), the degree set {1, 2, 4, 8} and the
  0.8 efficiency threshold (§6.2, Hetu-DiT ``EFF_TH``).
* **Analytic models** — diffuse per step = CFG × (2·P·L + 4·L²·d·layers) FLOPs at a fixed MFU, plus
  Ulysses all-to-all (4 per layer per step: bytes over the link and a fixed latency each); encode =
  2·P·text_len FLOPs; decode = conv FLOPs per output pixel at a low MFU (memory-bound) with an Amdahl
  serial fraction when patch-parallel; activation memory = live hidden-size tensors of the local
  sequence share (diffuse) or of the pixel-space chunk in flight (decode).

The shapes of the curves — low resolutions stop scaling early, decode scales worse than diffuse
(§3, Fig. 3) — come out of these models; no constant is fitted to a result.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

STAGES = ("E", "D", "C")
DEGREES = (1, 2, 4, 8)
# §6.2 footnote / Hetu-DiT EFF_TH: a degree is efficient while (T1 / Tk) / k >= 0.8.
EFFICIENCY_THRESHOLD = 0.8
GB = 1_000_000_000


class StageProfileError(ValueError):
    pass


@dataclass(frozen=True)
class GpuSpec:
    """One GPU type as the analytic models see it."""

    name: str
    memory_bytes: float
    peak_flops: float  # dense bf16
    hbm_bytes_per_s: float
    link_bytes_per_s: float  # GPU-to-GPU inside a machine (all-to-all, P2P weight loads)
    link_latency_s: float  # per collective
    host_load_bytes_per_s: float  # pinned host memory -> GPU (a stage's weights from the host cache)
    price_per_hour: float
    gpus_per_machine: int = 8
    # CUDA context, allocator slack and communication buffers kept free on every GPU.
    reserve_bytes: float = 2 * GB


# The paper's testbed (§8.1): L20 48 GB, PCIe 4.0 x16, 8 per server. The price is our assumption
# (an on-demand L20 rents for about $1/h); it only scales gpu_cost_usd.
L20 = GpuSpec(
    name="L20",
    memory_bytes=48 * GB,
    peak_flops=119.5e12,
    hbm_bytes_per_s=864e9,
    link_bytes_per_s=25e9,
    link_latency_s=100e-6,
    host_load_bytes_per_s=12e9,
    price_per_hour=1.0,
)
# For the encoder-pool memory model on the GPUs this project rents (prices as in
# scheduling/core/gpu_profiles.py for the H100; the H200's is our assumption).
H100 = GpuSpec(
    name="H100",
    memory_bytes=80 * GB,
    peak_flops=989e12,
    hbm_bytes_per_s=3.35e12,
    link_bytes_per_s=300e9,
    link_latency_s=20e-6,
    host_load_bytes_per_s=25e9,
    price_per_hour=2.99,
)
H200 = GpuSpec(
    name="H200",
    memory_bytes=141 * GB,
    peak_flops=989e12,
    hbm_bytes_per_s=4.8e12,
    link_bytes_per_s=300e9,
    link_latency_s=20e-6,
    host_load_bytes_per_s=25e9,
    price_per_hour=3.50,
)
GPUS = {"l20": L20, "h100": H100, "h200": H200}


@dataclass(frozen=True)
class Shape:
    """What a request asks for: the size of the output and the number of denoising steps."""

    width: int
    height: int
    frames: int
    steps: int

    def __post_init__(self) -> None:
        if min(self.width, self.height, self.frames, self.steps) < 1:
            raise StageProfileError(f"a request shape needs positive sizes, got {self}")


@dataclass(frozen=True)
class PipelineProfile:
    """One diffusion pipeline's three stages (architecture numbers; the times follow from them)."""

    name: str
    kind: str  # "image" | "video"
    encoder_params: float
    encoder_hidden: int
    text_len: int
    dit_params: float
    dit_hidden: int
    dit_layers: int
    vae_params: float
    spatial_down: int  # VAE spatial compression
    temporal_down: int  # VAE temporal compression (1 for images)
    patch: int
    cfg: int  # forward passes per step (2 with classifier-free guidance)
    decode_flops_per_pixel: float
    decode_channels: int  # widest pixel-space feature map of the decoder
    decode_frames_in_flight: int  # a causal video VAE decodes a few frames at a time
    default_steps: int
    mfu: float = 0.45  # diffuse / encode
    decode_mfu: float = 0.25  # decode is memory-bound (§2.1)
    decode_serial_fraction: float = 0.15  # halo exchange and the non-split layers of patch-parallel decode
    activation_factor: int = (
        24  # live hidden-size tensors per token in a DiT block (FFN 4x, attention, norms)
    )
    decode_live_tensors: int = 6
    step_overhead_s: float = 0.004  # kernel launches and scheduler per step
    stage_overhead_s: float = 0.01
    bytes_per_param: int = 2  # bf16

    # -- sizes -----------------------------------------------------------------------------------

    def latent_frames(self, shape: Shape) -> int:
        if self.kind == "image":
            return 1
        return (shape.frames - 1) // self.temporal_down + 1

    def tokens(self, shape: Shape) -> int:
        """Diffuse processing length L (§2.1): patches of the latent, over all latent frames."""
        per_frame = math.ceil(shape.height / (self.spatial_down * self.patch)) * math.ceil(
            shape.width / (self.spatial_down * self.patch)
        )
        return per_frame * self.latent_frames(shape)

    def weight_bytes(self, stage: str) -> float:
        params = {"E": self.encoder_params, "D": self.dit_params, "C": self.vae_params}[stage]
        return params * self.bytes_per_param

    # -- time ------------------------------------------------------------------------------------

    def _effective_flops(self, gpu: GpuSpec) -> float:
        return gpu.peak_flops * self.mfu

    def encode_s(self, shape: Shape, gpu: GpuSpec) -> float:
        flops = 2 * self.encoder_params * self.text_len
        return flops / self._effective_flops(gpu) + self.stage_overhead_s

    def diffuse_step_s(self, shape: Shape, degree: int, gpu: GpuSpec) -> float:
        length = self.tokens(shape)
        flops = self.cfg * (
            2 * self.dit_params * length + 4 * length * length * self.dit_hidden * self.dit_layers
        )
        compute = flops / degree / self._effective_flops(gpu)
        comm = 0.0
        if degree > 1:
            # Ulysses: 4 all-to-alls per layer per forward; each GPU sends (k-1)/k of its L/k share.
            per_all_to_all = (
                (length / degree) * self.dit_hidden * self.bytes_per_param * (degree - 1) / degree
            )
            count = 4 * self.dit_layers * self.cfg
            comm = count * (per_all_to_all / gpu.link_bytes_per_s + gpu.link_latency_s)
        return compute + comm + self.step_overhead_s

    def diffuse_s(self, shape: Shape, degree: int, gpu: GpuSpec) -> float:
        return shape.steps * self.diffuse_step_s(shape, degree, gpu) + self.stage_overhead_s

    def output_pixels(self, shape: Shape) -> int:
        return shape.width * shape.height * (1 if self.kind == "image" else shape.frames)

    def decode_s(self, shape: Shape, degree: int, gpu: GpuSpec) -> float:
        single = self.output_pixels(shape) * self.decode_flops_per_pixel / (gpu.peak_flops * self.decode_mfu)
        serial = self.decode_serial_fraction
        return single * (1 / degree + serial * (1 - 1 / degree)) + self.stage_overhead_s

    def stage_s(self, stage: str, shape: Shape, degree: int, gpu: GpuSpec) -> float:
        if stage == "E":
            return self.encode_s(shape, gpu)
        if stage == "D":
            return self.diffuse_s(shape, degree, gpu)
        if stage == "C":
            return self.decode_s(shape, degree, gpu)
        raise StageProfileError(f"unknown stage {stage!r} (expected one of {STAGES})")

    # -- memory ----------------------------------------------------------------------------------

    def activation_bytes(self, stage: str, shape: Shape, degree: int) -> float:
        """Peak activation memory on each GPU of a degree-``degree`` run of ``stage``."""
        if stage == "E":
            return self.text_len * self.encoder_hidden * self.bytes_per_param * self.activation_factor
        if stage == "D":
            local = math.ceil(self.tokens(shape) / degree)
            return local * self.dit_hidden * self.bytes_per_param * self.activation_factor * self.cfg
        if stage == "C":
            frames = 1 if self.kind == "image" else min(shape.frames, self.decode_frames_in_flight)
            pixels = shape.width * shape.height * frames
            return pixels * self.decode_channels * self.bytes_per_param * self.decode_live_tensors / degree
        raise StageProfileError(f"unknown stage {stage!r} (expected one of {STAGES})")

    # -- degrees ---------------------------------------------------------------------------------

    def efficiency(self, stage: str, shape: Shape, degree: int, gpu: GpuSpec) -> float:
        return self.stage_s(stage, shape, 1, gpu) / self.stage_s(stage, shape, degree, gpu) / degree

    def efficient_degrees(self, stage: str, shape: Shape, gpu: GpuSpec) -> tuple[int, ...]:
        """Degrees passing the 0.8 efficiency filter (C0); encode never parallelises (§3)."""
        if stage == "E":
            return (1,)
        return tuple(k for k in DEGREES if self.efficiency(stage, shape, k, gpu) >= EFFICIENCY_THRESHOLD)

    def best_degree(self, stage: str, shape: Shape, gpu: GpuSpec) -> int:
        """The profiled optimal degree: the highest efficient one (§6.2 footnote)."""
        return max(self.efficient_degrees(stage, shape, gpu))

    def best_latency_s(self, shape: Shape, gpu: GpuSpec) -> float:
        """End-to-end latency with every stage at its best degree on one machine, no queueing.

        The SLO of a request is 2.5x this (§8.1, after AlpaServe)."""
        return sum(self.stage_s(s, shape, self.best_degree(s, shape, gpu), gpu) for s in STAGES)

    def best_gpu_seconds(self, shape: Shape, gpu: GpuSpec) -> float:
        """GPU-seconds one request costs with every stage at its best degree (workload sizing)."""
        total = 0.0
        for stage in STAGES:
            degree = self.best_degree(stage, shape, gpu)
            total += degree * self.stage_s(stage, shape, degree, gpu)
        return total


# Wan2.1-T2V-14B-like: UMT5-XXL encoder (≈ 5.7 B params, ≈ 11.4 GB bf16), 14 B DiT (hidden 5120,
# 40 layers), Wan-VAE (≈ 127 M params, 8x spatial / 4x temporal compression, causal: decodes a few
# frames at a time). Video decode costs about 3x an image VAE per pixel (3-D convolutions).
WAN_T2V = PipelineProfile(
    name="wan-t2v",
    kind="video",
    encoder_params=5.7e9,
    encoder_hidden=4096,
    text_len=512,
    dit_params=14e9,
    dit_hidden=5120,
    dit_layers=40,
    vae_params=0.127e9,
    spatial_down=8,
    temporal_down=4,
    patch=2,
    cfg=2,
    decode_flops_per_pixel=12e6,
    decode_channels=384,
    decode_frames_in_flight=4,
    default_steps=6,
)

# An SD3-Medium-like image pipeline with the paper's Table 2 sizes: T5-XXL (+CLIPs) 4.8 B, DiT 2 B
# (hidden 1536, 24 layers), AE-KL 0.1 B (512 channels at the widest).
SD3_IMAGE = PipelineProfile(
    name="sd3-image",
    kind="image",
    encoder_params=4.8e9,
    encoder_hidden=4096,
    text_len=333,
    dit_params=2e9,
    dit_hidden=1536,
    dit_layers=24,
    vae_params=0.1e9,
    spatial_down=8,
    temporal_down=1,
    patch=2,
    cfg=2,
    decode_flops_per_pixel=4.6e6,
    decode_channels=512,
    decode_frames_in_flight=1,
    default_steps=20,
)

# The ``wan-1.3b`` streaming preset (workers/runtime/presets.py) with a UMT5-XXL-sized encoder in
# place of its small test encoder: 1.3 B DiT (hidden 1536, 30 layers; ≈ 2.6 GB bf16) and the
# Wan-VAE. Streams generate chunk by chunk; this profile serves the encoder-pool memory model and
# the sessions' encode requests in the simulator.
WAN_13B_STREAM = PipelineProfile(
    name="wan-1.3b",
    kind="video",
    encoder_params=5.7e9,
    encoder_hidden=4096,
    text_len=512,
    dit_params=1.3e9,
    dit_hidden=1536,
    dit_layers=30,
    vae_params=0.127e9,
    spatial_down=8,
    temporal_down=4,
    patch=2,
    cfg=1,
    decode_flops_per_pixel=12e6,
    decode_channels=384,
    decode_frames_in_flight=4,
    default_steps=4,
)

PIPELINES = {p.name: p for p in (WAN_T2V, SD3_IMAGE, WAN_13B_STREAM)}


def get_pipeline(name: str) -> PipelineProfile:
    try:
        return PIPELINES[name]
    except KeyError:
        raise StageProfileError(f"unknown pipeline {name!r} (expected one of {sorted(PIPELINES)})") from None


def get_gpu(name: str) -> GpuSpec:
    try:
        return GPUS[name.lower()]
    except KeyError:
        raise StageProfileError(f"unknown GPU {name!r} (expected one of {sorted(GPUS)})") from None
