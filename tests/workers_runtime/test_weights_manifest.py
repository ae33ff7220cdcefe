"""Weights by block: manifest, packing, the safetensors disk source, installing into a model."""

from __future__ import annotations

import json

import pytest
import torch

from workers.runtime.models import build_model
from workers.runtime.weights import (
    LinkPacer,
    PackedWeights,
    WeightsManifest,
    WeightsManifestError,
    chain_sources,
    load_weights,
    model_from_weights,
    pack_model,
    read_manifest,
    save_weights,
)
from workers.runtime.weights.manifest import ALIGNMENT, block_name


@pytest.fixture(scope="module")
def packed_tiny() -> PackedWeights:
    return PackedWeights.from_state_dict("tiny", build_model("tiny").net.state_dict(), piece_bytes=64 << 10)


def test_block_names_follow_layers():
    assert block_name("dit.blocks.3.q.weight") == "dit.blocks.3"
    assert block_name("text.layers.0.mlp.2.bias") == "text.layers.0"
    assert block_name("dit.patch_embed.weight") == "dit.patch_embed"
    assert block_name("dit.head_modulation") == "dit.head_modulation"


def test_manifest_covers_the_state_dict_in_order(packed_tiny):
    # given the tiny model's weights packed by block
    state_dict = build_model("tiny").net.state_dict()
    manifest = packed_tiny.manifest
    # then every tensor is in exactly one block, in state-dict order, aligned, with its bytes
    names = [t.name for block in manifest.blocks for t in block.tensors]
    assert names == list(state_dict)
    assert [b.name for b in manifest.blocks][:1] == ["text.pos_embed"]
    assert any(b.name == "dit.blocks.3" for b in manifest.blocks)
    assert all(t.offset % ALIGNMENT == 0 for b in manifest.blocks for t in b.tensors)
    unpacked = packed_tiny.state_dict()
    assert all(torch.equal(unpacked[name], tensor) for name, tensor in state_dict.items())
    # and every block has one checksum per piece
    assert all(len(b.pieces) == -(-b.nbytes // manifest.piece_bytes) for b in manifest.blocks)
    packed_tiny.verify()


def test_manifest_json_round_trip_and_errors_name_the_field(packed_tiny):
    raw = packed_tiny.manifest.to_json()
    assert WeightsManifest.from_json(json.dumps(raw)) == packed_tiny.manifest
    broken = json.loads(json.dumps(raw))
    broken["blocks"][2]["pieces"].pop()
    with pytest.raises(WeightsManifestError, match=r"blocks\[2\]\.pieces"):
        WeightsManifest.from_json(broken)
    tampered = json.loads(json.dumps(raw))
    tampered["blocks"][0]["checksum"] = "0" * 16
    with pytest.raises(WeightsManifestError, match="weights_id"):
        WeightsManifest.from_json(tampered)
    with pytest.raises(WeightsManifestError, match="piece_bytes"):
        WeightsManifest.from_json({**raw, "piece_bytes": 0})


def test_other_weights_have_another_id(packed_tiny):
    other = PackedWeights.from_state_dict(
        "tiny", build_model("tiny", weights_seed=1).net.state_dict(), piece_bytes=64 << 10
    )
    assert other.manifest.weights_id != packed_tiny.manifest.weights_id


def test_safetensors_round_trip_verifies_blocks(packed_tiny, tmp_path):
    path = tmp_path / "tiny.safetensors"
    save_weights(path, packed_tiny)
    assert read_manifest(path) == packed_tiny.manifest
    loaded = load_weights(path, packed_tiny.manifest)
    assert all(torch.equal(a, b) for a, b in zip(loaded.buffers, packed_tiny.buffers, strict=True))
    # a flipped byte in the file's data section fails its block's checksum
    raw = bytearray(path.read_bytes())
    raw[-1000] ^= 0xFF
    path.write_bytes(bytes(raw))
    with pytest.raises(WeightsManifestError, match="fails its checksum"):
        load_weights(path, packed_tiny.manifest)


def test_disk_file_of_other_weights_is_refused(packed_tiny, tmp_path):
    other = PackedWeights.from_state_dict("tiny", build_model("tiny", weights_seed=2).net.state_dict())
    path = tmp_path / "other.safetensors"
    save_weights(path, other)
    with pytest.raises(WeightsManifestError, match="other weights"):
        load_weights(path, packed_tiny.manifest)


def test_model_built_from_packed_weights_shares_them_and_generates_the_same():
    # given a seeded model whose weights are packed (the model now uses the packed buffers)
    reference = build_model("tiny")
    expected = reference.generate([reference.create_state("a red kite", 7)])[0].frames
    packed = pack_model(reference)
    buffer = packed.buffers[0]
    first = next(iter(reference.net.parameters()))
    assert buffer.data_ptr() <= first.data_ptr() < buffer.data_ptr() + buffer.numel()
    # when a model is built around a copy of those buffers
    copy = PackedWeights(packed.manifest, [b.clone() for b in packed.buffers])
    model = model_from_weights(copy)
    # then it adopts them without a copy and generates the same chunk
    assert next(iter(model.net.parameters())).data_ptr() == copy.buffers[0].data_ptr()
    got = model.generate([model.create_state("a red kite", 7)])[0].frames
    assert torch.equal(got, expected)


def test_chain_sources_walk_back_to_the_source():
    chain = ["S", "T1", "T2", "T3"]
    assert chain_sources(chain, 1) == ["S"]
    assert chain_sources(chain, 3) == ["T2", "T1", "S"]
    with pytest.raises(ValueError, match="position"):
        chain_sources(chain, 0)


def test_pacer_rejects_a_non_positive_rate():
    with pytest.raises(ValueError, match="link_mbps"):
        LinkPacer(0)
