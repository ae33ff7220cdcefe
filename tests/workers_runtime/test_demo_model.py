"""The trained demo model (preset `demo`): the model contract, its data, its evaluator, its training."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch

from contracts.catalog.presets import DEFAULT_PRESET
from workers.runtime.engine import ChunkEngine
from workers.runtime.models import StateManifestError, build_model
from workers.runtime.models.demo_data import (
    ATTRIBUTES,
    COLOURS,
    DIRECTIONS,
    SHAPES,
    ClipSpec,
    all_combinations,
    describe,
    held_out_combinations,
    parse_prompt,
    positions,
    render_clip,
    sample_spec,
    tokenize,
)
from workers.runtime.models.demo_eval import evaluate, measure_clip, score, summarise


@pytest.fixture(scope="module")
def demo_model():
    return build_model("demo", device="cpu")


@pytest.fixture
def make_demo_engine(demo_model):
    engines: list[ChunkEngine] = []

    def factory(**kwargs) -> ChunkEngine:
        engine = ChunkEngine(demo_model, encode_workers=1, **kwargs)
        engines.append(engine)
        return engine

    yield factory
    for engine in engines:
        engine.close()


def run_chunks(engine: ChunkEngine, session_id: str, count: int) -> list[torch.Tensor]:
    return [engine.step(due=[session_id])[0].rgb.clone() for _ in range(count)]


def snapshot(engine: ChunkEngine, session_id: str) -> dict[str, torch.Tensor]:
    _manifest, tensors = engine.export_state(session_id)
    engine.thaw(session_id)
    return {name: t.clone() for name, t in tensors.items()}


# -- the model contract ----------------------------------------------------------------------------


def test_demo_is_the_default_preset_and_loads_the_shipped_weights(demo_model):
    assert DEFAULT_PRESET == "demo"
    assert (demo_model.width, demo_model.height, demo_model.fps, demo_model.frames_per_chunk) == (
        128,
        128,
        8.0,
        4,
    )
    state = demo_model.create_state("a red circle moving left on a blue background", 1)
    (chunk,) = demo_model.generate([state])
    assert chunk.frames.shape == (4, 128, 128, 3) and chunk.frames.dtype == torch.uint8
    assert state.next_chunk == 1
    # One contiguous region whose size the analytic formula gives
    storages = {t.untyped_storage().data_ptr() for t in state.tensors.values()}
    assert len(storages) == 1 and state.region is not None
    assert state.nbytes == demo_model.state_bytes_for() == demo_model.state_bytes(state)


def test_missing_weights_name_the_training_command(tmp_path):
    with pytest.raises(FileNotFoundError, match="train_demo_model"):
        build_model("demo", weights_path=str(tmp_path / "absent.safetensors"))


def test_suspend_resume_is_bit_identical(make_demo_engine):
    straight, interrupted = make_demo_engine(), make_demo_engine()
    for engine in (straight, interrupted):
        engine.add_session("s", "a green square moving up on a white background", seed=7)
    frames_a = run_chunks(straight, "s", 6)
    frames_b = run_chunks(interrupted, "s", 3)
    record = interrupted.suspend("s")
    assert record.nbytes == interrupted.model.state_bytes_for() > 0
    interrupted.resume("s", record)
    frames_b += run_chunks(interrupted, "s", 3)
    assert all(torch.equal(a, b) for a, b in zip(frames_a, frames_b, strict=True))
    a, b = snapshot(straight, "s"), snapshot(interrupted, "s")
    assert all(torch.equal(a[name], b[name]) for name in a)


def test_export_import_and_checkpoint_bytes_continue_byte_exact(make_demo_engine):
    source, target, reference, restored = (make_demo_engine() for _ in range(4))
    for engine in (source, reference):
        engine.add_session("s", "a fast orange diamond moving right on purple", seed=3)
    run_chunks(source, "s", 4)
    expected = run_chunks(reference, "s", 8)[4:]
    checkpoint = source.state_to_bytes("s")
    manifest, tensors = source.export_state("s")
    target.import_state("s", manifest, tensors)
    source.remove("s")
    restored.state_from_bytes("s", checkpoint)
    for engine in (target, restored):
        got = run_chunks(engine, "s", 4)
        assert all(torch.equal(a, b) for a, b in zip(expected, got, strict=True))


def test_a_manifest_of_another_model_is_rejected(make_demo_engine, tiny_model):
    engine = make_demo_engine()
    tiny_state = tiny_model.create_state("p", 0)
    with pytest.raises(StateManifestError, match="tiny"):
        engine.import_state("x", tiny_model.state_manifest(tiny_state), dict(tiny_state.tensors))
    assert engine.sessions() == {}


def test_batched_across_sessions_at_different_positions_matches_alone(make_demo_engine):
    alone, batched = make_demo_engine(), make_demo_engine()
    prompt = "a yellow triangle moving down on a black background"
    alone.add_session("s", prompt, seed=5)
    batched.add_session("s", prompt, seed=5)
    for i, warmup in enumerate([1, 4, 7]):
        batched.add_session(f"o{i}", f"a {list(COLOURS)[i]} circle moving left", seed=100 + i)
        run_chunks(batched, f"o{i}", warmup)
    for _ in range(4):
        (mine,) = alone.step(due=["s"])
        results = {r.session_id: r for r in batched.step(max_batch=4)}
        assert len(results) == 4 and {r.batch_size for r in results.values()} == {4}
        assert results["s"].chunk_index == mine.chunk_index
        # Rounding may differ with the batch; a pixel may move by one level at most
        diff = (results["s"].rgb.int() - mine.rgb.int()).abs()
        assert int(diff.max()) <= 1 and float((diff > 0).float().mean()) < 1e-3
        a, b = snapshot(alone, "s"), snapshot(batched, "s")
        for name in a:
            torch.testing.assert_close(a[name], b[name], rtol=1e-5, atol=1e-5)


def test_prompt_switch_takes_effect_from_the_next_chunk_and_motion_carries_on(make_demo_engine):
    changed, unchanged = make_demo_engine(), make_demo_engine()
    first = "a red circle moving right on a blue background"
    second = "a white square moving up on a green background"
    for engine in (changed, unchanged):
        engine.add_session("s", first, seed=9)
    a = run_chunks(changed, "s", 2)
    b = run_chunks(unchanged, "s", 2)
    assert all(torch.equal(x, y) for x, y in zip(a, b, strict=True))
    changed.set_prompt("s", second, from_chunk=2)
    after = torch.cat(run_chunks(changed, "s", 3)).numpy()
    before = torch.cat(a).numpy()
    assert measure_clip(before) == {
        "background": "blue", "colour": "red", "shape": "circle", "direction": "right", "speed": "slow"
    }  # fmt: skip
    assert measure_clip(after) == {
        "background": "green", "colour": "white", "shape": "square", "direction": "up", "speed": "slow"
    }  # fmt: skip
    manifest, tensors = changed.export_state("s")
    assert manifest["meta"]["active_prompt"] == second
    assert torch.equal(tensors["text_features"], changed.model.encode_prompt(second))
    with pytest.raises(ValueError):
        changed.set_prompt("s", "too late", from_chunk=1)


def test_the_seed_picks_the_start_and_weights_are_shared(demo_model):
    prompt = "a blue circle moving left on white"
    a, b, c = (demo_model.create_state(prompt, seed) for seed in (1, 2, 1))
    fa, fb, fc = (chunk.frames for chunk in demo_model.generate([a, b, c]))
    assert not torch.equal(fa, fb)
    assert torch.equal(fa, fc)
    other = build_model("demo")
    assert torch.equal(other.generate([other.create_state(prompt, 1)])[0].frames, fa)


def test_unknown_options_and_dtypes_are_rejected(demo_model):
    with pytest.raises(ValueError, match="options"):
        demo_model.create_state("p", 0, {"resolution": 4})
    with pytest.raises(ValueError, match="float32"):
        build_model("demo", dtype="bfloat16")


# -- the data ----------------------------------------------------------------------------------------


def test_held_out_combinations_leave_every_pair_in_training():
    held = held_out_combinations()
    train = [c for c in all_combinations() if c not in held]
    assert 0 < len(held) < len(all_combinations()) // 4
    for i, j in itertools.combinations(range(3), 2):
        every_pair = {(c[i], c[j]) for c in all_combinations()}
        assert {(c[i], c[j]) for c in train} == every_pair
    rng = np.random.default_rng(0)
    for _ in range(300):
        spec = sample_spec(rng, held_out=False)
        assert (spec.shape, spec.colour, spec.direction) not in held
        assert spec.colour != spec.background
    held_specs = {sample_spec(rng, held_out=True) for _ in range(300)}
    assert {(s.shape, s.colour, s.direction) for s in held_specs} == set(held)


def test_every_phrasing_names_the_clip_it_describes():
    rng = np.random.default_rng(1)
    for _ in range(500):
        spec = sample_spec(rng, held_out=bool(rng.integers(2)))
        prompt = describe(spec, rng)
        assert parse_prompt(prompt) == spec, prompt
        assert all(t != 1 for t in tokenize(prompt)), f"unknown word in {prompt!r}"
    assert parse_prompt("a lighthouse at dusk") is None
    assert tokenize("a Zebra circle")[:3] == [tokenize("a")[0], 1, tokenize("circle")[0]]


def test_ground_truth_clips_move_as_labelled():
    spec = ClipSpec("square", "red", "blue", "left", "fast")
    start = np.array([0.5, 0.5])
    track = positions(start, spec, 3)
    np.testing.assert_allclose(track[:, 0], [0.5, 0.45, 0.4])
    clip = render_clip(spec, start, 3, size=64)
    assert clip.shape == (3, 64, 64, 3)
    assert tuple(clip[0, 32, 32]) == COLOURS["red"] and tuple(clip[0, 0, 0]) == COLOURS["blue"]
    # The object wraps around the edge instead of leaving the frame
    wrapped = render_clip(spec, np.array([0.01, 0.5]), 1, size=64)[0]
    assert tuple(wrapped[32, 63]) == COLOURS["red"] and tuple(wrapped[32, 1]) == COLOURS["red"]


# -- the evaluator -----------------------------------------------------------------------------------


def test_evaluator_scores_ground_truth_clips_right_and_noise_wrong():
    rng = np.random.default_rng(2)
    truth, noise = [], []
    for shape, direction in itertools.product(SHAPES, DIRECTIONS):
        spec = sample_spec(rng, held_out=False)
        spec = ClipSpec(shape, spec.colour, spec.background, direction, spec.speed)
        truth.append(score(measure_clip(render_clip(spec, rng.random(2), 12)), spec))
        noise.append(score(measure_clip(rng.integers(0, 256, (12, 128, 128, 3), dtype=np.uint8)), spec))
    assert summarise(truth)["overall"] == 1.0
    assert summarise(noise)["overall"] == 0.0
    # A still object has no direction; a different colour is caught
    still = np.repeat(render_clip(ClipSpec("circle", "red", "black", "up", "slow"), rng.random(2), 1), 8, 0)
    measured = measure_clip(still)
    assert measured["direction"] == "none" and measured["colour"] == "red"
    assert not all(score(measured, ClipSpec("circle", "green", "black", "up", "slow")).values())


def test_shipped_weights_follow_held_out_prompts(demo_model):
    report = evaluate(demo_model, clips=16, seed=3, chunks=3)
    assert set(report["accuracy"]) == set(ATTRIBUTES)
    assert report["overall"] >= 0.75, report
