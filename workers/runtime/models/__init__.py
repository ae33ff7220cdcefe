"""Registry of streaming video models: preset name -> ``package.module:ClassName`` of the model class.

The built-in entries come from the one preset table (``contracts.catalog.presets``). A model class is
built with `cls.from_preset(preset, device=..., weights_path=..., dtype=...)`. Plug another model in
with `register_model("my-preset", "package.module:MyModel")`.
"""

from __future__ import annotations

import pkgutil
from typing import Any

from contracts.catalog.presets import PRESETS
from workers.runtime.models.base import (
    GeneratedChunk,
    SessionState,
    StateManifestError,
    StreamingVideoModel,
)

MODEL_REGISTRY: dict[str, str] = {name: preset.model for name, preset in PRESETS.items()}


class UnknownPresetError(ValueError):
    """The requested model preset is not registered."""


def register_model(preset: str, dotted_path: str) -> None:
    MODEL_REGISTRY[preset] = dotted_path


def model_class(preset: str) -> type[StreamingVideoModel]:
    # Presets registered after import (``MODEL_PATHS``, ``contracts.catalog.local_paths``) are found
    # in the preset table.
    dotted = MODEL_REGISTRY.get(preset) or (PRESETS[preset].model if preset in PRESETS else None)
    if dotted is None:
        available = sorted(set(MODEL_REGISTRY) | set(PRESETS))
        raise UnknownPresetError(
            f"unknown model preset {preset!r}; available presets: {', '.join(available)}"
        )
    return pkgutil.resolve_name(dotted)


def build_model(preset: str, **kwargs: Any) -> StreamingVideoModel:
    """Instantiate the model registered under `preset` (kwargs: device, weights_path, dtype)."""
    return model_class(preset).from_preset(preset, **kwargs)  # type: ignore[attr-defined]


__all__ = [
    "MODEL_REGISTRY",
    "GeneratedChunk",
    "SessionState",
    "StateManifestError",
    "StreamingVideoModel",
    "UnknownPresetError",
    "build_model",
    "model_class",
    "register_model",
]
