"""The control plane's model catalogue mirrors the runtime presets without importing torch there."""

from __future__ import annotations

from workers.catalog import PRESETS
from workers.runtime.models.causal_dit import PRESETS as RUNTIME_PRESETS


def test_catalogue_matches_runtime_presets():
    assert set(PRESETS) == set(RUNTIME_PRESETS)
    for name, preset in PRESETS.items():
        config = RUNTIME_PRESETS[name]
        assert preset.resolutions == {f"{config.width}x{config.height}": 1.0}, name
        assert preset.fps == int(config.fps), name
        assert preset.frames_per_chunk == config.video_frames_per_chunk, name
