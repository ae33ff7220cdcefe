"""The catalogue of model presets users may ask for, as the control plane validates them.

Derived from the one preset table (``contracts.catalog.presets``, pure Python, so the web process never
imports torch): each entry names the resolutions a worker runtime serves for the preset, its frame
rate and chunk length, and its relative per-chunk cost (``load``) at each resolution, which the
scheduler uses for heterogeneous placement.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from contracts.catalog.local_paths import register_model_path
from contracts.catalog.presets import PRESETS as RUNTIME_PRESETS
from contracts.catalog.presets import Preset


@dataclass(frozen=True)
class ModelPreset:
    name: str
    description: str
    fps: int
    frames_per_chunk: int
    # "WxH" → relative per-chunk cost.
    resolutions: dict[str, float] = field(default_factory=dict)
    default_resolution: str = ""
    # A one-shot video's frames: a multiple of the unit, at most the maximum (None: the runtime's
    # `check_job` alone decides, e.g. for a MODEL_PATHS checkpoint).
    job_frame_unit: int = 1
    max_job_frames: int | None = None

    @classmethod
    def of(cls, preset: Preset) -> ModelPreset:
        """A runtime preset serves the one resolution its architecture decodes to, at cost 1."""
        shape = preset.architecture
        resolution = f"{shape.width}x{shape.height}"
        return cls(
            name=preset.name,
            description=preset.description,
            fps=int(shape.fps),
            frames_per_chunk=shape.video_frames_per_chunk,
            resolutions={resolution: 1.0},
            default_resolution=resolution,
            job_frame_unit=getattr(shape, "job_frame_unit", 1),
            max_job_frames=getattr(shape, "max_job_frames", None),
        )

    def load_for(self, resolution: str) -> float:
        return self.resolutions[resolution]


PRESETS: dict[str, ModelPreset] = {name: ModelPreset.of(preset) for name, preset in RUNTIME_PRESETS.items()}


def register_model_paths(paths: dict[str, str]) -> list[ModelPreset]:
    """Register a preset per local checkpoint directory (``MODEL_PATHS``) in the runtime's preset
    table and in this catalogue. Reads only the directory's JSON files (no torch); a bad layout
    raises ValueError naming the preset, the directory and the missing or malformed file."""
    registered = []
    for name, path in paths.items():
        try:
            preset = register_model_path(name, path)
        except ValueError as exc:
            raise ValueError(f"{name}={path}: {exc}") from exc
        PRESETS[name] = ModelPreset.of(preset)
        registered.append(PRESETS[name])
    return registered


def parse_resolution(value: str) -> tuple[int, int]:
    """'832x480' → (832, 480); ValueError with a reason otherwise."""
    parts = value.lower().split("x")
    if len(parts) != 2 or not all(p.isdigit() for p in parts):
        raise ValueError(f"resolution must look like WIDTHxHEIGHT, got {value!r}")
    width, height = int(parts[0]), int(parts[1])
    if width <= 0 or height <= 0:
        raise ValueError("resolution must be positive")
    return width, height
