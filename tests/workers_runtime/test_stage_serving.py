"""Stage roles of a worker (issue 15, ``stages/host.py``) without the control plane: role changes
with lazy loads, their refusals, and a DC engine fed by an encoder service over a real link."""

from __future__ import annotations

import json
from io import StringIO

import pytest
import torch
from django.core.management import CommandError, call_command

from workers.runtime.engine import ChunkEngine
from workers.runtime.stages.contract import stage_weight_bytes
from workers.runtime.stages.host import RoleRefused, StageHost, pending_switch
from workers.runtime.stages.restage import hosted_stages
from workers.runtime.stages.staged_model import staged_engine_model
from workers.runtime.transport import MigrationListener


@pytest.fixture
def listener():
    with MigrationListener() as instance:
        yield instance


def chunks(engine: ChunkEngine, count: int) -> dict[tuple[str, int], torch.Tensor]:
    out: dict[tuple[str, int], torch.Tensor] = {}
    while len(out) < count:
        for result in engine.step():
            out[(result.session_id, result.chunk_index)] = result.rgb.clone()
    return out


def test_pending_switch_names_the_first_chunk_that_needs_new_embeddings():
    meta = {"next_chunk": 3, "active_prompt": "a", "prompt_schedule": [[0, "a"], [5, "b"]]}
    assert pending_switch(meta) == 5
    assert pending_switch({**meta, "prompt_schedule": [[0, "a"], [2, "b"]]}) == 3
    assert pending_switch({**meta, "prompt_schedule": [[0, "a"]]}) is None


@pytest.mark.parametrize("preset", ["demo", "tiny"])
def test_a_worker_changes_role_loading_and_dropping_stages_and_streams_the_same_frames(preset, listener):
    torch.set_num_threads(1)
    # Given a monolithic engine and a reference one,
    engine = ChunkEngine.from_preset(preset, max_batch=2)
    reference = ChunkEngine.from_preset(preset, max_batch=2)
    host = StageHost(engine, store_address=listener.address)
    for target in (engine, reference):
        target.add_session("s", "a heron", seed=4)
        target.set_prompt("s", "a heron at dusk", 2)
    # a role that drops a resident session's stages (E, or the one-shot ED), and DC while a
    # prompt switch still needs embeddings no encoder is known to provide are refused, naming why;
    with pytest.raises(RoleRefused, match=r"session s .*drops"):
        host.set_role("E", {"s": engine.meta("s")})
    with pytest.raises(RoleRefused, match=r"session s .*role ED drops"):
        host.set_role("ED", {"s": engine.meta("s")})
    with pytest.raises(RoleRefused, match="session s needs a prompt's embeddings at chunk 2"):
        host.set_role("DC", {"s": engine.meta("s")})
    first = chunks(engine, 3)
    engine.remove("s")
    # when it becomes an encoder worker (the diffuse and decode weights dropped),
    result = host.set_role("E", {})
    weights = stage_weight_bytes(preset)
    assert result["role"] == "E" and result["dropped"] == "DC" and result["loaded"] == ""
    assert host.service is not None and engine.model.staged.loaded_weight_bytes() == weights["E"]
    assert host.report()["session_capacity"] == 0
    # then back to EDC (loaded lazily from the preset's weights),
    result = host.set_role("EDC", {})
    assert result["loaded"] == "DC" and result["load_ms"] > 0 and host.service is None
    assert len(hosted_stages(engine.model)) == 3
    # it streams exactly what the untouched monolithic engine streams.
    engine.add_session("s", "a heron", seed=4)
    engine.set_prompt("s", "a heron at dusk", 2)
    again = chunks(engine, 3)
    expected = chunks(reference, 3)
    assert first.keys() == again.keys() == expected.keys()
    assert all(torch.equal(first[k], expected[k]) and torch.equal(again[k], expected[k]) for k in expected)
    host.close()


def test_a_dc_session_region_restores_on_a_monolithic_engine(listener):
    # Given an encoder service and a DC engine fed by it,
    torch.set_num_threads(1)
    encoder = StageHost(ChunkEngine(staged_engine_model("tiny", "E")), store_address=listener.address)
    encoder.start()
    dc = ChunkEngine(staged_engine_model("tiny", "DC"))
    host = StageHost(dc)
    host.use_encoder({"worker": "e", "address": listener.address})
    mono = ChunkEngine.from_preset("tiny")
    for engine in (dc, mono):
        engine.add_session("s", "rain on a lake", seed=9)
    chunks(dc, 2)
    chunks(mono, 2)
    # when the DC session's region (diffusion state and decoder cache in one) is checkpointed
    # and restored on a monolithic engine, then both go on with the same frames and the same state.
    data = dc.state_to_bytes("s")
    assert data == mono.state_to_bytes("s")
    other = ChunkEngine.from_preset("tiny")
    other.state_from_bytes("s", data)
    assert torch.equal(chunks(other, 1)[("s", 2)], chunks(mono, 1)[("s", 2)])
    assert encoder.report()["encoder"]["served"] == 1
    host.close()
    encoder.close()


def test_bench_stage_roles_reports_both_roles_and_the_round_trip():
    out = StringIO()
    call_command(
        "bench_stage_roles", "--preset", "demo", "--repeats", "2", "--warmup", "0", "--json", stdout=out
    )
    report = json.loads(out.getvalue())
    assert set(report["chunk_ms"]) == set(report["switch_chunk_ms"]) == {"DC", "EDC"}
    assert report["chunk_ms"]["DC"]["count"] == report["encode_round_trip_ms"]["count"] == 2
    weights = stage_weight_bytes("demo")
    assert report["weights_bytes"]["DC"] == weights["D"] + weights["C"]
    # the encoder process answered the first prompt once (the second session's is the DC worker's
    # cached copy), then per round one switch (shared by both sessions) and one fresh prompt
    assert report["encoder"]["served"] == 1 + 2 * 2
    with pytest.raises(CommandError, match="--sessions"):
        call_command("bench_stage_roles", "--sessions", "0")


def test_bench_stage_decode_reports_the_round_trip_and_equal_frames():
    out = StringIO()
    call_command(
        "bench_stage_decode", "--kind", "image", "--repeats", "2", "--warmup", "0", "--json", stdout=out
    )
    report = json.loads(out.getvalue())
    assert report["decode_round_trip_ms"]["count"] == report["local_decode_ms"]["count"] == 2
    # the decoder process decoded every round's latents into the in-process frames
    assert report["identical"] is True and report["decoder"]["served"] == 2
    with pytest.raises(CommandError, match="--frames"):
        call_command("bench_stage_decode", "--frames", "0")
