"""One-shot jobs of the Wan adapter (issue 14) on a tiny random checkpoint saved in the published
diffusers layout: a job is the causal generator's own rollout, so its frames are a streaming
session's for the same prompt and seed; it pauses, moves and resumes at any step of any chunk bit
for bit; split stages give the monolithic model's latents and frames; the sizes it cannot run are
refused naming the field. Across worker processes: tests/workers/test_wan_jobs_daemon.py."""

from __future__ import annotations

import threading

import pytest
import torch

from contracts.catalog.local_paths import read_wan_architecture
from tests.workers_runtime.wan_layouts import write_diffusers_layout
from workers.benchmarks.jobs import bench_pause_resume, step_seconds
from workers.runtime.encoding import encode_mp4
from workers.runtime.engine import ChunkEngine
from workers.runtime.models.base import JobSpecError, StateManifestError
from workers.runtime.models.wan_causal import WanCausalModel
from workers.runtime.stages.contract import StageNotHosted, parse_role
from workers.runtime.stages.pipeline import StageMessage, StageRunner
from workers.runtime.stages.wan_causal import WanCausalStages

pytestmark = pytest.mark.filterwarnings("ignore::FutureWarning")

PROMPT = "a red fox running through snow"
STEPS_PER_CHUNK = 4  # the tiny checkpoint's denoising_timesteps
FRAMES_PER_CHUNK = 8  # 2 latent frames × the VAE's 4


@pytest.fixture(scope="module")
def wan_dir(tmp_path_factory):
    return write_diffusers_layout(tmp_path_factory.mktemp("wanjobs") / "Wan2.1-T2V-tiny-Diffusers")


@pytest.fixture(scope="module")
def wan_model(wan_dir):
    return WanCausalModel(read_wan_architecture(wan_dir), preset="wan-test")


def video(frames: int, *, seed: int = 7) -> dict:
    chunks = -(-frames // FRAMES_PER_CHUNK)
    return dict(
        kind="video",
        prompt=PROMPT,
        seed=seed,
        width=64,
        height=64,
        frames=frames,
        steps=chunks * STEPS_PER_CHUNK,
    )


def image(*, seed: int = 7, prompt: str = PROMPT) -> dict:
    return dict(kind="image", prompt=prompt, seed=seed, width=64, height=64, frames=1, steps=STEPS_PER_CHUNK)


def run(model, state) -> torch.Tensor:
    while state.meta["step"] < state.meta["steps"]:
        model.job_step([state])
    return model.job_frames(state)


def test_a_video_job_is_the_streaming_sessions_rollout_and_an_image_its_first_frame(wan_model):
    model = wan_model
    assert (model.frames_per_chunk, len(model.sigmas)) == (FRAMES_PER_CHUNK, STEPS_PER_CHUNK)
    # Given a session streaming 4 chunks (8 latent frames: the 6-frame KV window wraps), and a job
    # of 29 frames (4 chunks, the last cut short) for the same prompt and seed
    session = model.create_state(PROMPT, 7)
    streamed = torch.cat([model.generate([session])[0].frames for _ in range(4)])
    job = model.create_job(**video(29))
    assert job.meta["steps"] == 16
    # When the job runs step by step (one denoising step of one chunk each)
    frames = run(model, job)
    # Then its frames are the session's, bit for bit, and its KV ring holds what the session's does
    assert frames.shape == (29, 64, 64, 3) and frames.dtype == torch.uint8
    assert torch.equal(frames, streamed[:29])
    assert torch.equal(job.tensors["kv_cache"], session.tensors["kv_cache"])
    # and an image is the first frame of a one-chunk rollout: the session's first frame
    picture = run(model, model.create_job(**image()))
    assert picture.shape == (1, 64, 64, 3) and torch.equal(picture, streamed[:1])
    # while another seed gives another picture
    assert not torch.equal(run(model, model.create_job(**image(seed=8))), picture)


@pytest.mark.parametrize("pause_at", [3, 5, 9])  # mid-chunk, just after a chunk, mid-chunk after a wrap
def test_a_job_exported_at_any_step_and_imported_into_another_model_finishes_bit_identically(
    wan_dir, wan_model, pause_at
):
    spec = video(24, seed=3)
    straight = run(wan_model, wan_model.create_job(**spec))
    # Given a job paused after `pause_at` steps, its region exported with checksums
    source = ChunkEngine(wan_model, encode_workers=1)
    target = ChunkEngine(WanCausalModel(read_wan_architecture(wan_dir), preset="wan-test"), encode_workers=1)
    try:
        source.add_job("j", **spec)
        for _ in range(pause_at):
            source.job_step(["j"])
        record = source.suspend("j")
        source.resume("j", record)  # offload to host memory and back on the way
        manifest, _ = source.export_state("j")
        assert [t["name"] for t in manifest["tensors"]] == ["latents", "prompt_embeds", "kv_cache"]
        assert manifest["meta"]["step"] == pause_at
        # When another model instance imports it (through checkpoint bytes) and runs the rest
        target.state_from_bytes("j", source.state_to_bytes("j"))
        source.remove("j")
        while target.job_progress("j")[0] < target.job_progress("j")[1]:
            target.job_step(["j"])
        moved = target.job_frames("j")
    finally:
        source.close()
        target.close()
    # Then the frames and the MP4 are an uninterrupted run's
    assert torch.equal(moved, straight)
    assert encode_mp4(moved.numpy(), wan_model.fps) == encode_mp4(straight.numpy(), wan_model.fps)


def test_image_jobs_batched_at_different_steps_match_their_runs_alone(wan_model):
    model = wan_model
    specs = [image(seed=1), image(seed=2, prompt="a quiet lake at dawn"), image(seed=3)]
    alone = [run(model, model.create_job(**spec)) for spec in specs]
    # Given three images of one shape, the second one step ahead (a batch then holds two jobs at one
    # step, run together, and one at another)
    states = [model.create_job(**spec) for spec in specs]
    model.job_step(states[1:2])
    # When they are stepped as one batch until each is done
    while any(s.meta["step"] < s.meta["steps"] for s in states):
        model.job_step([s for s in states if s.meta["step"] < s.meta["steps"]])
    # Then each picture is its run alone's, up to floating-point rounding of the batch
    for state, want in zip(states, alone, strict=True):
        got = model.job_frames(state)
        assert (got.int() - want.int()).abs().max().item() <= 1


@pytest.mark.parametrize("split", [["E", "DC"], ["E", "D", "C"]])
def test_split_stages_give_the_models_own_job_latents_and_frames(wan_dir, wan_model, split):
    arch = read_wan_architecture(wan_dir)
    jobs = {"v": video(16, seed=5), "i": image(seed=6)}
    states = {name: wan_model.create_job(**spec) for name, spec in jobs.items()}
    want = {name: run(wan_model, state) for name, state in states.items()}
    runners = [
        StageRunner(WanCausalStages.build(arch, preset="wan-test", stages=parse_role(r))) for r in split
    ]
    messages = [StageMessage("job", {"job": name, **spec}) for name, spec in jobs.items()]
    messages += [StageMessage("jobstep", {"jobs": ["v"]}) for _ in range(8)]
    messages += [StageMessage("jobstep", {"jobs": ["i"]}) for _ in range(4)]
    for index, runner in enumerate(runners):
        messages = [out for message in messages for out in runner.handle(message)]
        if index == len(runners) - 2 and split[-1] == "C":  # what leaves diffusion: the final latents
            assert [m.kind for m in messages] == ["job_latents", "job_latents"]
            for message in messages:
                assert torch.equal(message.tensor, states[message.meta["job"]].tensors["latents"])
    assert [(m.kind, m.meta["job"]) for m in messages] == [("job_frames", "v"), ("job_frames", "i")]
    for message in messages:
        assert torch.equal(message.tensor, want[message.meta["job"]])


def test_jobs_the_wan_adapter_cannot_run_are_refused_naming_the_field(wan_dir, wan_model):
    model = wan_model
    refusals = [
        (image() | {"width": 128}, "width", "renders 64x64 only"),
        (image() | {"height": 32}, "height", "renders 64x64 only"),
        (image() | {"steps": 3}, "steps", "steps must be 4, not 3"),
        (video(29) | {"steps": 4}, "steps", "4 chunk\\(s\\) of 8 frames, so steps must be 16"),
        (video(8 * 32 + 1), "frames", "at most 256"),
        (image() | {"frames": 2}, "frames", "an image has 1 frame"),
    ]
    for spec, field, message in refusals:
        with pytest.raises(JobSpecError, match=message) as caught:
            model.create_job(**spec)
        assert caught.value.field == field
    # The causal generator steps a job on one device: no sequence parallelism
    assert model.SEQUENCE_PARALLEL is False
    # A region whose step counter does not fit its steps is refused before anything is installed
    manifest = model.state_manifest(model.create_job(**image()))
    manifest["meta"]["step"] = 5
    with pytest.raises(StateManifestError, match="step counter is out of range"):
        model.validate_manifest(manifest)
    # A stage worker without the DiT cannot step a job, and says so
    decoder = WanCausalStages.build(read_wan_architecture(wan_dir), preset="wan-test", stages=parse_role("C"))
    embeddings = model.encode_prompt(PROMPT)
    with pytest.raises(StageNotHosted, match="lacks D"):
        decoder.create_job(embeddings, **image())


def test_the_job_benchmarks_run_wan_jobs_past_their_fixed_step_count(wan_model):
    # An image takes 4 steps; 6 measured rounds (+1 warm-up) start it again when it ends
    shape = ("image", 64, 64, 1)
    assert wan_model.job_steps_for(kind="image", frames=1, steps=8) == STEPS_PER_CHUNK
    assert wan_model.job_steps_for(kind="video", frames=17, steps=8) == 3 * STEPS_PER_CHUNK
    report = bench_pause_resume(wan_model, shape, repeats=6)
    layout_bytes = sum(t.numel() * t.element_size() for t in wan_model.create_job(**image()).tensors.values())
    assert report["state_bytes"] >= layout_bytes and report["step_ms"]["count"] == 6
    assert step_seconds(wan_model, shape, 2, repeats=6) > 0


class SetAfter(threading.Event):
    """An abandon flag that reads as set from its `after`-th look on (a block boundary deep into a
    step, as a stream claiming the device mid-step)."""

    def __init__(self, after: int) -> None:
        super().__init__()
        self.after, self.looks = after, 0

    def is_set(self) -> bool:
        self.looks += 1
        return self.looks > self.after


# Two denoising groups of the 2-block DiT: boundaries 1-2 (first group), 3-4 (second), 5 (before the
# writes). Abandoned at the first block, at the second group's first, at the last boundary.
@pytest.mark.parametrize("after", [0, 2, 4])
def test_an_abandoned_wan_job_step_writes_nothing_and_the_job_ends_as_if_uninterrupted(wan_model, after):
    # Given two videos at different steps of their chunk (two denoising groups in one step), one at
    # the last step of its chunk (the step that also writes the KV ring)
    specs = [video(16, seed=4), video(16, seed=5)]
    straight = ChunkEngine(wan_model, encode_workers=1)
    engine = ChunkEngine(wan_model, encode_workers=1)
    try:
        for eng in (straight, engine):
            for i, spec in enumerate(specs):
                eng.add_job(f"j{i}", **spec)
            for _ in range(3):
                eng.job_step(["j0"])
            eng.job_step(["j1"])
        before = {job: engine.state_to_bytes(job) for job in ("j0", "j1")}
        # When a step of both is abandoned at a block boundary
        report = engine.job_step(["j0", "j1"], abandon=SetAfter(after))
        # Then it says so and nothing of either region changed
        assert report.abandoned
        assert {job: engine.state_to_bytes(job) for job in ("j0", "j1")} == before
        # (while a flag that stays clear through the step's 5 boundaries abandons nothing),
        clear = SetAfter(5)
        assert not straight.job_step(["j0", "j1"], abandon=clear).abandoned and clear.looks == 5
        engine.job_step(["j0", "j1"])
        # and both finish with the frames of a run that was never interrupted
        for eng in (straight, engine):
            while eng.job_progress("j1")[0] < eng.job_progress("j1")[1]:
                eng.job_step([j for j in ("j0", "j1") if eng.job_progress(j)[0] < eng.job_progress(j)[1]])
            while eng.job_progress("j0")[0] < eng.job_progress("j0")[1]:
                eng.job_step(["j0"])
        for job in ("j0", "j1"):
            assert torch.equal(engine.job_frames(job), straight.job_frames(job))
    finally:
        straight.close()
        engine.close()
