"""The control plane's model catalogue is derived from the one preset table, without importing torch."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from contracts.catalog import PRESETS
from contracts.catalog.presets import PRESETS as DEFINITIONS
from workers.runtime.models import MODEL_REGISTRY
from workers.runtime.models.causal_dit import PRESETS as CAUSAL_DIT_CONFIGS
from workers.runtime.models.demo import PRESETS as DEMO_CONFIGS

ROOT = Path(__file__).resolve().parents[2]
RUNTIME_CONFIGS = {**DEMO_CONFIGS, **CAUSAL_DIT_CONFIGS}


def test_catalogue_registry_and_runtime_configs_cover_every_preset():
    assert list(PRESETS) == list(DEFINITIONS) == list(RUNTIME_CONFIGS) == list(MODEL_REGISTRY)


def test_catalogue_shows_what_the_runtime_generates():
    for name, preset in PRESETS.items():
        config = RUNTIME_CONFIGS[name]
        assert preset.resolutions == {f"{config.width}x{config.height}": 1.0}, name
        assert preset.default_resolution == f"{config.width}x{config.height}", name
        assert preset.fps == int(config.fps), name
        assert preset.frames_per_chunk == config.video_frames_per_chunk, name
        assert preset.description == DEFINITIONS[name].description, name
    assert (PRESETS["tiny"].default_resolution, PRESETS["tiny"].frames_per_chunk) == ("64x64", 4)
    assert PRESETS["wan-1.3b"].default_resolution == "832x480"
    assert (PRESETS["demo"].default_resolution, PRESETS["demo"].fps) == ("128x128", 8)


def test_the_catalogue_does_not_import_torch():
    probe = "import sys, contracts.catalog; print('torch' in sys.modules)"
    result = subprocess.run(
        [sys.executable, "-c", probe], cwd=ROOT, capture_output=True, text=True, timeout=60
    )
    assert result.stdout.strip() == "False", result.stderr
