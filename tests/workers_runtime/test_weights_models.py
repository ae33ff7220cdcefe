"""The weights contract of the model classes (`StreamingVideoModel.transferable_weights`).

A worker built from weights received from the parameter pool must run exactly those weights (not
the shipped file or a seeded init), and a model that loads from its own checkpoint directory (the
Wan adapter) is built from there by the loader and never offered to the pool.
"""

from __future__ import annotations

import pytest
import torch

from contracts.catalog.local_paths import register_model_path
from contracts.catalog.presets import PRESETS
from tests.workers_runtime.wan_layouts import write_diffusers_layout
from workers.ports import PoolLink
from workers.runtime.models import build_model
from workers.runtime.weights import PackedWeights, WeightsUnavailable, model_from_weights, pack_model
from workers.weights_loading import DISK, WeightsLoader

WAN_PRESET = "wan-weights-contract"


def first_chunk(model, prompt: str = "a red circle moving left on a blue background") -> torch.Tensor:
    state = model.create_state(prompt, seed=7)
    return model.generate([state])[0].frames


def test_the_demo_model_runs_the_weights_it_was_given():
    # given the demo model's weights packed as the pool moves them
    shipped = build_model("demo", device="cpu")
    reference = first_chunk(shipped)
    packed = pack_model(build_model("demo", device="cpu"))
    # when a model is built from them
    received = model_from_weights(packed, device="cpu")
    # then it runs on the received buffers themselves (no copy, no read of the shipped file) and
    # generates what the shipped model generates
    assert {t.data_ptr() for t in received.net.state_dict().values()} <= {
        t.data_ptr() for t in packed.state_dict().values()
    }
    assert torch.equal(first_chunk(received), reference)
    # and different weights give different frames: the model really uses what it was given
    altered = {name: tensor.clone() for name, tensor in packed.state_dict().items()}
    for tensor in altered.values():
        if tensor.is_floating_point():
            tensor.mul_(0.5)
    changed = model_from_weights(PackedWeights.from_state_dict("demo", altered), device="cpu")
    assert not torch.equal(first_chunk(changed), reference)


@pytest.fixture(scope="module")
def wan_preset(tmp_path_factory):
    register_model_path(WAN_PRESET, write_diffusers_layout(tmp_path_factory.mktemp("wan-w") / "Wan-tiny"))
    yield WAN_PRESET
    PRESETS.pop(WAN_PRESET, None)


def test_a_checkpoint_directory_model_is_built_from_its_directory_and_never_pooled(wan_preset, tmp_path):
    def loader(weights_from: str) -> WeightsLoader:
        return WeightsLoader(
            preset=wan_preset,
            device="cpu",
            host="127.0.0.1",
            weights_from=weights_from,
            weights_dir=tmp_path,
            pool=PoolLink(),
        )

    # when a worker of a MODEL_PATHS preset loads its weights under the default mode
    loaded = loader("auto").load()
    # then the model comes from its checkpoint directory, nothing is served or written to WEIGHTS_DIR
    assert (loaded.source, loaded.detail, loaded.address, loaded.packed) == (
        DISK,
        "checkpoint directory",
        "",
        None,
    )
    assert loaded.model.preset == wan_preset
    assert list(tmp_path.iterdir()) == []
    # and peers-only mode is refused with the reason, as is handing it transferred weights
    with pytest.raises(WeightsUnavailable, match="checkpoint directory"):
        loader("pool").load()
    with pytest.raises(NotImplementedError):
        pack_model(loaded.model)
