"""Coalesced chunk engine: determinism across suspend/resume and export/import, batching, prompts."""

from __future__ import annotations

import io
import json

import pytest
import torch
from PIL import Image

from workers.runtime.engine import ChunkEngine, HostStateRecord, SessionStateError, region_from_bytes
from workers.runtime.models import StateManifestError, build_model


def run_chunks(engine: ChunkEngine, session_id: str, count: int) -> list[torch.Tensor]:
    frames = []
    for _ in range(count):
        (result,) = engine.step(due=[session_id])
        frames.append(result.rgb.clone())
    return frames


def snapshot(engine: ChunkEngine, session_id: str) -> dict[str, torch.Tensor]:
    _manifest, tensors = engine.export_state(session_id)
    engine.thaw(session_id)
    return {name: t.clone() for name, t in tensors.items()}


def assert_identical(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert list(a) == list(b)
    for name in a:
        assert torch.equal(a[name], b[name]), name


def test_suspend_resume_is_bit_identical(make_engine):
    # Given two engines running the same session, one suspended and resumed half-way
    straight, interrupted = make_engine(), make_engine()
    for engine in (straight, interrupted):
        engine.add_session("s", "a red fox running through snow", seed=7)
    frames_a = run_chunks(straight, "s", 6)
    frames_b = run_chunks(interrupted, "s", 3)
    record = interrupted.suspend("s")
    # Then the state left the device and came back byte-exact
    assert interrupted.status("s") == "suspended"
    assert record.nbytes == interrupted.model.state_bytes_for() > 0
    assert interrupted.step() == []
    report = interrupted.resume("s", record)
    assert report.nbytes == record.nbytes
    frames_b += run_chunks(interrupted, "s", 3)
    # When compared chunk by chunk and state by state
    for fa, fb in zip(frames_a, frames_b, strict=True):
        assert torch.equal(fa, fb)
    assert_identical(snapshot(straight, "s"), snapshot(interrupted, "s"))


def test_export_import_into_fresh_engine_is_bit_identical(make_engine):
    source, target, reference = make_engine(), make_engine(), make_engine()
    source.add_session("s", "waves on a beach at dusk", seed=3)
    reference.add_session("s", "waves on a beach at dusk", seed=3)
    run_chunks(source, "s", 4)
    expected = run_chunks(reference, "s", 8)
    manifest, tensors = source.export_state("s")
    assert source.step() == []  # frozen on the source while migrating
    target.import_state("s", manifest, tensors)
    source.remove("s")
    got = run_chunks(target, "s", 4)
    for fa, fb in zip(expected[4:], got, strict=True):
        assert torch.equal(fa, fb)
    assert_identical(snapshot(reference, "s"), snapshot(target, "s"))


def test_fresh_model_instance_reproduces_seeded_weights_and_chunks(tiny_model):
    other = build_model("tiny", device="cpu")
    for (name, a), (_, b) in zip(
        tiny_model.net.state_dict().items(), other.net.state_dict().items(), strict=True
    ):
        assert torch.equal(a, b), name
    s1 = tiny_model.create_state("city at night", 11)
    s2 = other.create_state("city at night", 11)
    assert torch.equal(tiny_model.generate([s1])[0].frames, other.generate([s2])[0].frames)


def test_batched_with_other_sessions_is_close_to_alone(make_engine):
    alone, batched = make_engine(), make_engine()
    alone.add_session("s", "forest in autumn", seed=5)
    batched.add_session("s", "forest in autumn", seed=5)
    # Other sessions at different stream positions (cache partly full, full, wrapped)
    for i, warmup in enumerate([1, 4, 7]):
        batched.add_session(f"o{i}", f"other prompt {i}", seed=100 + i)
        run_chunks(batched, f"o{i}", warmup)
    latents_alone, latents_batched = [], []
    for _ in range(6):
        alone.step(due=["s"])
        results = batched.step(max_batch=4)
        assert len(results) == 4 and {r.batch_size for r in results} == {4}
        latents_alone.append(snapshot(alone, "s"))
        latents_batched.append(snapshot(batched, "s"))
    for a, b in zip(latents_alone, latents_batched, strict=True):
        for name in a:
            torch.testing.assert_close(a[name], b[name], rtol=1e-4, atol=1e-4)


def test_step_respects_max_batch_and_serves_least_recent_first(make_engine):
    engine = make_engine(max_batch=3)
    for i in range(5):
        engine.add_session(f"s{i}", "prompt", seed=i)
    first = engine.step()
    second = engine.step(max_batch=2)
    assert [r.session_id for r in first] == ["s0", "s1", "s2"]
    assert [r.session_id for r in second] == ["s3", "s4"]
    assert all(r.batch_size == len(first) for r in first)
    assert [r.chunk_index for r in engine.step(max_batch=1)] == [1]
    with pytest.raises(ValueError):
        engine.step(max_batch=0)


def test_prompt_change_applies_from_the_given_chunk(make_engine):
    changed, unchanged = make_engine(), make_engine()
    for engine in (changed, unchanged):
        engine.add_session("s", "a quiet lake", seed=9)
    changed.set_prompt("s", "a volcano erupting", from_chunk=2)
    a = run_chunks(changed, "s", 4)
    b = run_chunks(unchanged, "s", 4)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
    assert not torch.equal(a[2], b[2])
    model = changed.model
    expected = model.encode_prompt("a volcano erupting")
    manifest, tensors = changed.export_state("s")
    assert torch.equal(tensors["prompt_embeds"], expected)
    assert manifest["meta"]["active_prompt"] == "a volcano erupting"
    with pytest.raises(ValueError):
        changed.set_prompt("s", "too late", from_chunk=1)


def test_manifest_mismatch_is_rejected_and_leaves_session_intact(make_engine):
    source, target = make_engine(), make_engine()
    source.add_session("s", "mountains", seed=1)
    run_chunks(source, "s", 2)
    manifest, tensors = source.export_state("s")
    bad_model = dict(manifest, model="small")
    bad_shape = dict(
        manifest, tensors=[dict(manifest["tensors"][0], shape=[1, 2, 3]), *manifest["tensors"][1:]]
    )
    corrupted = dict(tensors, latent_history=tensors["latent_history"] + 1.0)
    for bad_manifest, bad_tensors, needle in [
        (bad_model, tensors, "small"),
        (bad_shape, tensors, "do not match"),
        (manifest, corrupted, "checksum"),
        (dict(manifest, version=99), tensors, "version"),
    ]:
        with pytest.raises(StateManifestError, match=needle):
            target.import_state("s", bad_manifest, bad_tensors)
        assert target.sessions() == {}
    # The source still owns an intact, runnable session
    source.thaw("s")
    assert source.status("s") == "resident" and source.next_chunk("s") == 2
    assert len(source.step()) == 1


def test_state_bytes_round_trip_through_safetensors(make_engine):
    source, target = make_engine(), make_engine()
    source.add_session("s", "desert road", seed=4)
    run_chunks(source, "s", 3)
    data = source.state_to_bytes("s")
    manifest, _ = region_from_bytes(data)
    assert manifest["meta"]["next_chunk"] == 3
    target.state_from_bytes("s", data)
    target.resume("s", target.suspend("s"))
    expected = run_chunks(source, "s", 2)
    got = run_chunks(target, "s", 2)
    assert all(torch.equal(a, b) for a, b in zip(expected, got, strict=True))
    tampered = bytearray(data)
    tampered[-1] ^= 0xFF
    with pytest.raises(StateManifestError):
        make_engine().state_from_bytes("s", bytes(tampered))


def test_chunks_are_encoded_off_the_step_as_jpeg(make_engine):
    seen = []
    engine = make_engine(on_chunk=lambda result, encoded: seen.append((result.session_id, encoded)))
    engine.add_session("s", "sunrise", seed=2)
    (result,) = engine.step()
    frames = result.frames(timeout=30)
    assert len(frames) == result.frame_count == engine.model.frames_per_chunk
    image = Image.open(io.BytesIO(frames[0]))
    assert image.format == "JPEG" and image.size == (result.width, result.height)
    assert result.encode_ms() >= 0 and result.generation_ms > 0
    engine.close()
    assert seen and seen[0][0] == "s"


def test_lifecycle_errors(make_engine):
    engine = make_engine()
    engine.add_session("s", "x", seed=0)
    with pytest.raises(SessionStateError):
        engine.add_session("s", "x", seed=0)
    record = engine.suspend("s")
    with pytest.raises(SessionStateError):
        engine.suspend("s")
    with pytest.raises(SessionStateError):
        engine.export_state("s")
    engine.resume("s", record)
    engine.export_state("s")
    with pytest.raises(SessionStateError):
        engine.suspend("s")
    engine.remove("s")
    with pytest.raises(KeyError):
        engine.remove("s")


def test_start_chunk_sets_the_first_chunk_index(make_engine):
    engine = make_engine()
    engine.add_session("s", "x", seed=0, start_chunk=5)
    assert [r.chunk_index for r in engine.step()] == [5]


def test_a_suspended_record_resumes_on_another_engine(make_engine):
    source, target, reference = make_engine(), make_engine(), make_engine()
    for engine in (source, reference):
        engine.add_session("s", "harbour at dawn", seed=12)
    run_chunks(source, "s", 2)
    expected = run_chunks(reference, "s", 4)[2:]
    record = source.suspend("s")
    target.resume("s", record)
    source.remove("s")
    got = run_chunks(target, "s", 2)
    assert all(torch.equal(a, b) for a, b in zip(expected, got, strict=True))


def test_a_bad_record_leaves_the_session_suspended(make_engine):
    engine = make_engine()
    engine.add_session("s", "x", seed=0)
    run_chunks(engine, "s", 1)
    record = engine.suspend("s")
    good_manifest = record.manifest
    record.manifest = dict(good_manifest, model="wan-1.3b")
    with pytest.raises(StateManifestError):
        engine.resume("s", record)
    record.manifest = good_manifest
    original = record.region
    record.region = original[:-1]  # truncated
    with pytest.raises(StateManifestError):
        engine.resume("s", record)
    assert engine.status("s") == "suspended" and engine.step() == []
    record.region = original
    # A record assembled from separate host tensors (no flat region) resumes too
    record = HostStateRecord(
        "s",
        record.manifest,
        {k: v.clone() for k, v in record.tensors.items()},
        record.nbytes,
        0.0,
        pinned=False,
    )
    engine.resume("s", record)
    assert [r.chunk_index for r in engine.step()] == [1]


def test_process_pool_encoder_produces_the_same_jpeg(tiny_model):
    threaded = ChunkEngine(tiny_model, encode_workers=1)
    processes = ChunkEngine(tiny_model, encode_workers=1, encode_in_processes=True)
    try:
        for engine in (threaded, processes):
            engine.add_session("s", "lanterns", seed=8)
        (a,) = threaded.step()
        (b,) = processes.step()
        assert b.frames(timeout=120) == a.frames(timeout=30)
    finally:
        threaded.close()
        processes.close()


def test_no_session_starves_when_more_are_due_than_k(make_engine):
    engine = make_engine(max_batch=2)
    for i in range(5):
        engine.add_session(f"s{i}", "crowd", seed=i)
    served = {f"s{i}": 0 for i in range(5)}
    for _ in range(5):
        results = engine.step()
        assert len(results) == 2
        for result in results:
            served[result.session_id] += 1
    assert set(served.values()) == {2}
    assert {r.session_id for r in engine.step(due=["s3", "s4", "unknown"])} == {"s3", "s4"}


def test_exported_manifest_is_json_and_matches_the_contract(make_engine):
    engine = make_engine()
    engine.add_session("s", "contract", seed=1)
    manifest, tensors = engine.export_state("s")
    decoded = json.loads(json.dumps(manifest))
    assert decoded["model"] == "tiny" and decoded["version"] == 1
    assert [e["name"] for e in decoded["tensors"]] == list(tensors)
    for entry in decoded["tensors"]:
        tensor = tensors[entry["name"]]
        assert entry["shape"] == list(tensor.shape) and isinstance(entry["checksum"], int)
        assert tensor.device == engine.device and tensor.is_contiguous()
    assert decoded["meta"]["next_chunk"] == 0 and decoded["meta"]["seed"] == 1


def test_adopted_tensors_without_a_flat_region_offload_and_continue_identically(make_engine):
    source, target = make_engine(), make_engine()
    source.add_session("s", "river delta", seed=6)
    run_chunks(source, "s", 3)
    manifest, tensors = source.export_state("s")
    received = {name: t.clone() for name, t in tensors.items()}  # like a transport's receive buffers
    target.import_state("s", manifest, received, copy=False)
    assert target.state_bytes("s") == source.state_bytes("s")
    source.thaw("s")
    target.resume("s", target.suspend("s"))
    expected = run_chunks(source, "s", 2)
    got = run_chunks(target, "s", 2)
    assert all(torch.equal(a, b) for a, b in zip(expected, got, strict=True))


def test_same_batch_composition_is_bit_identical_across_suspend_and_import(make_engine):
    straight, interrupted, fresh = make_engine(), make_engine(), make_engine()
    for engine in (straight, interrupted):
        engine.add_session("a", "storm over the sea", seed=1)
        engine.add_session("b", "quiet library", seed=2)
    for _ in range(3):
        straight.step(max_batch=2)
        interrupted.step(max_batch=2)
    interrupted.resume("a", interrupted.suspend("a"))
    for sid in ("a", "b"):  # move both to a fresh engine, in the same order
        manifest, tensors = interrupted.export_state(sid)
        fresh.import_state(sid, manifest, tensors)
        interrupted.remove(sid)
    for _ in range(3):
        expected = {r.session_id: r.rgb for r in straight.step(max_batch=2)}
        got = {r.session_id: r.rgb for r in fresh.step(max_batch=2)}
        assert expected.keys() == got.keys() == {"a", "b"}
        assert all(torch.equal(expected[sid], got[sid]) for sid in expected)
    for sid in ("a", "b"):
        assert_identical(snapshot(straight, sid), snapshot(fresh, sid))
