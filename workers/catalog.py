"""The catalogue of model presets users may ask for, as the control plane validates them.

Each preset names the resolutions a worker runtime serves for it, its frame rate and chunk length,
and its relative per-chunk cost (``load``) at each resolution, which the scheduler uses for
heterogeneous placement. Pure data: importable by the control plane and the runtime alike.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class ModelPreset:
    name: str
    description: str
    fps: int
    frames_per_chunk: int
    # "WxH" → relative per-chunk cost.
    resolutions: dict[str, float] = field(default_factory=dict)
    default_resolution: str = ""

    def load_for(self, resolution: str) -> float:
        return self.resolutions[resolution]


# Mirrors the runtime's presets (workers/runtime/models/causal_dit.py); a test keeps them in sync
# without making the web process import torch.
PRESETS: dict[str, ModelPreset] = {
    "tiny": ModelPreset(
        name="tiny",
        description="Small causal video DiT that runs on one CPU core (development and demo)",
        fps=8,
        frames_per_chunk=4,
        resolutions={"64x64": 1.0},
        default_resolution="64x64",
    ),
    "small": ModelPreset(
        name="small",
        description="Larger causal video DiT for CPU benchmarks and small GPUs",
        fps=16,
        frames_per_chunk=12,
        resolutions={"128x128": 1.0},
        default_resolution="128x128",
    ),
    "wan-1.3b": ModelPreset(
        name="wan-1.3b",
        description="Wan2.1-T2V-1.3B tensor shapes (random weights); needs a datacenter GPU",
        fps=16,
        frames_per_chunk=12,
        resolutions={"832x480": 1.0},
        default_resolution="832x480",
    ),
}


def parse_resolution(value: str) -> tuple[int, int]:
    """'832x480' → (832, 480); ValueError with a reason otherwise."""
    parts = value.lower().split("x")
    if len(parts) != 2 or not all(p.isdigit() for p in parts):
        raise ValueError(f"resolution must look like WIDTHxHEIGHT, got {value!r}")
    width, height = int(parts[0]), int(parts[1])
    if width <= 0 or height <= 0:
        raise ValueError("resolution must be positive")
    return width, height
