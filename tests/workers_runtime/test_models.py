from __future__ import annotations

import pytest
import torch

from workers.runtime.models import MODEL_REGISTRY, UnknownPresetError, build_model
from workers.runtime.models.causal_dit import PRESETS


def test_unknown_preset_lists_the_presets():
    with pytest.raises(UnknownPresetError) as excinfo:
        build_model("gigantic")
    message = str(excinfo.value)
    assert "gigantic" in message
    for preset in MODEL_REGISTRY:
        assert preset in message


@pytest.mark.parametrize("preset", ["tiny", "small"])
def test_state_size_formula_matches_a_real_allocation(preset):
    model = build_model(preset) if preset == "small" else build_model("tiny")
    state = model.create_state("a prompt", 0)
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in state.tensors.values()}
    assert len(storages) == 1  # one contiguous region, the tensors are views of it
    allocated = sum(storages.values())
    tensor_bytes = sum(t.numel() * t.element_size() for t in state.tensors.values())
    assert allocated == model.cfg.state_bytes() == model.state_bytes(state) == model.state_bytes_for()
    assert tensor_bytes <= allocated < tensor_bytes + 256 * len(state.tensors)
    assert sum(p.numel() for p in model.net.parameters()) == model.cfg.parameter_count()


def test_wan_preset_has_wan_shapes_and_a_multi_gigabyte_state():
    cfg = PRESETS["wan-1.3b"]
    assert (cfg.blocks, cfg.dim, cfg.heads, cfg.tokens_per_frame) == (30, 1536, 12, 1560)
    assert (cfg.width, cfg.height, cfg.frames_per_chunk, cfg.window_frames) == (832, 480, 3, 12)
    kv_per_frame = cfg.blocks * 2 * cfg.tokens_per_frame * cfg.dim * 2
    assert 0.28e9 < kv_per_frame < 0.30e9  # ≈ 0.29 GB per latent frame (DESIGN.md)
    assert 3.3e9 < cfg.state_bytes() < 3.6e9
    assert 1.2e9 < cfg.parameter_count() < 1.6e9


def test_weights_round_trip_through_safetensors(tmp_path, tiny_model):
    path = tmp_path / "tiny.safetensors"
    tiny_model.save_weights(str(path))
    loaded = build_model("tiny", weights_path=str(path))
    other_seed = build_model("tiny", weights_seed=1)
    state_a = tiny_model.create_state("p", 1)
    state_b = loaded.create_state("p", 1)
    assert torch.equal(tiny_model.generate([state_a])[0].frames, loaded.generate([state_b])[0].frames)
    assert not torch.equal(tiny_model.net.dit.head.weight, other_seed.net.dit.head.weight)


def test_rng_is_per_session_and_per_chunk(tiny_model):
    a = tiny_model.create_state("same prompt", 1)
    b = tiny_model.create_state("same prompt", 2)
    fa, fb = (c.frames for c in tiny_model.generate([a, b]))
    assert not torch.equal(fa, fb)
    g1 = tiny_model.chunk_noise(a, 3)
    g2 = tiny_model.chunk_noise(a, 3)
    assert torch.equal(torch.randn(4, generator=g1), torch.randn(4, generator=g2))


def test_unknown_options_are_rejected(tiny_model):
    with pytest.raises(ValueError, match="options"):
        tiny_model.create_state("p", 0, {"resolution": 4})
