"""One-shot jobs through the stages (issues 14 + 15): encode → diffuse → decode split across stage
workers, bit-identical latents and PNG to the model's own `create_job` / `job_step` / `job_frames`."""

from __future__ import annotations

import pytest
import torch

from workers.runtime.encoding import encode_png
from workers.runtime.models import build_model
from workers.runtime.stages.chain import StageChain, route
from workers.runtime.stages.contract import build_staged
from workers.runtime.stages.pipeline import StageMessage, StageProtocolError, StageRunner

# Two images of one shape (batched, as GenServe batches images by resolution), one video; the images
# share a prompt (one encode serves both on the encoder) but not a seed.
JOBS = {
    "tiny": {
        "i1": dict(kind="image", prompt="a red circle", seed=1, width=64, height=48, frames=1, steps=3),
        "i2": dict(kind="image", prompt="a red circle", seed=2, width=64, height=48, frames=1, steps=3),
        "v": dict(
            kind="video", prompt="a blue square moving up", seed=3, width=32, height=32, frames=4, steps=2
        ),
    },
    "demo": {
        "i1": dict(kind="image", prompt="a red circle", seed=1, width=64, height=48, frames=1, steps=3),
        "i2": dict(kind="image", prompt="a red circle", seed=2, width=64, height=48, frames=1, steps=3),
        "v": dict(
            kind="video", prompt="a blue square moving up", seed=3, width=48, height=32, frames=5, steps=2
        ),
    },
}
BATCHES = [["i1", "i2"], ["v"], ["i1", "i2"], ["v"], ["i1", "i2"]]  # the video finishes first


def monolithic_jobs(model, jobs, batches=BATCHES) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """(final latents, frames) of each job run by the model itself, in the same batches."""
    states = {name: model.create_job(**spec) for name, spec in jobs.items()}
    for batch in batches:
        model.job_step([states[name] for name in batch])
    return (
        {name: state.tensors["latents"].clone() for name, state in states.items()},
        {name: model.job_frames(state) for name, state in states.items()},
    )


def job_messages(jobs) -> list[StageMessage]:
    messages = [StageMessage("job", {"job": name, **spec}) for name, spec in jobs.items()]
    return messages + [StageMessage("jobstep", {"jobs": batch}) for batch in BATCHES]


def run_in_process(runners: list[StageRunner], messages: list[StageMessage]) -> list[StageMessage]:
    for runner in runners:
        messages = [out for message in messages for out in runner.handle(message)]
    return messages


@pytest.mark.parametrize(
    ("preset", "split"),
    [
        *(("tiny", split) for split in (["E", "D", "C"], ["ED", "C"], ["E", "DC"], ["EDC"])),
        # The demo's job step renders with the decoder's network: its jobs step on DC workers.
        *(("demo", split) for split in (["E", "DC"], ["EDC"])),
    ],
)
def test_split_one_shot_jobs_are_bit_identical_to_the_model(preset, split):
    jobs = JOBS[preset]
    want_latents, want_frames = monolithic_jobs(build_model(preset, device="cpu"), jobs)
    # Given one runner per role, each with only its stages' weights,
    runners = [StageRunner(build_staged(preset, role)) for role in split]
    # when the jobs and their batched steps go through them, the diffusion worker's output (before
    # decode) is each job's final latents, and the decode worker's is its frames, bit for bit.
    if "D" in "".join(split[:-1]):  # the last worker hosts decode only
        diffused = run_in_process(runners[:-1], job_messages(jobs))
        assert [m.meta["job"] for m in diffused] == ["v", "i1", "i2"]
        for message in diffused:
            assert message.kind == "job_latents"
            assert torch.equal(message.tensor, want_latents[message.meta["job"]])
    out = run_in_process(runners, job_messages(jobs))
    assert [(m.kind, m.meta["job"]) for m in out] == [
        ("job_frames", "v"),
        ("job_frames", "i1"),
        ("job_frames", "i2"),
    ]
    for message in out:
        name = message.meta["job"]
        assert message.meta["meta"]["step"] == jobs[name]["steps"]
        assert message.tensor.dtype == torch.uint8 and torch.equal(message.tensor, want_frames[name])
        if jobs[name]["kind"] == "image":
            assert encode_png(message.tensor[0].numpy()) == encode_png(want_frames[name][0].numpy())


def test_a_job_a_diffusion_worker_cannot_run_is_answered_with_the_reason():
    encoder, diffusion = StageRunner(build_staged("tiny", "E")), StageRunner(build_staged("tiny", "DC"))

    def submit(name: str, **spec) -> list[StageMessage]:
        (encoded,) = encoder.handle(StageMessage("job", {"job": name, **spec}))
        return diffusion.handle(encoded)

    # A size the model refuses is named as the model's own create_job names it,
    with pytest.raises(StageProtocolError, match=r"job 'x': width: must be a multiple of 16"):
        submit("x", **dict(JOBS["tiny"]["i1"], width=50))
    # a refused job never started, and one batch holds jobs of one shape only.
    with pytest.raises(StageProtocolError, match=r"job\(s\) \['x'\] are not running"):
        diffusion.handle(StageMessage("jobstep", {"jobs": ["x"]}))
    assert submit("a", **JOBS["tiny"]["i1"]) == [] and submit("b", **JOBS["tiny"]["v"]) == []
    with pytest.raises(StageProtocolError, match="a job step batches jobs of one shape"):
        diffusion.handle(StageMessage("jobstep", {"jobs": ["a", "b"]}))
    # A demo D worker lacks the decoder network its jobs step with.
    demo = StageRunner(build_staged("demo", "D"))
    (encoded,) = StageRunner(build_staged("demo", "E")).handle(
        StageMessage("job", {"job": "d", **JOBS["demo"]["i1"]})
    )
    with pytest.raises(StageProtocolError, match="step with the weights of DC; this D worker lacks C"):
        demo.handle(encoded)


def test_one_shot_jobs_through_three_worker_processes_are_bit_identical():
    jobs = JOBS["tiny"]
    _, want_frames = monolithic_jobs(build_model("tiny", device="cpu"), jobs)
    # Given E → D → C as three processes over Gloo,
    chain = StageChain("tiny", ["E", "D", "C"], timeout_s=30)
    try:
        # when the jobs and their steps are sent (and one step names a job no worker runs),
        chain.send(StageMessage("jobstep", {"jobs": ["nobody"]}))
        for message in job_messages(jobs):
            chain.send(message)
        error = chain.recv()
        received = [chain.recv() for _ in jobs]
    finally:
        codes = chain.close()
    # then the bad step is answered by the diffusion worker, and every job's frames — the images'
    # PNG bytes — equal the model's own one-shot run.
    assert error.kind == "error" and error.meta["worker"] == "D" and "['nobody']" in error.meta["error"]
    assert [m.meta["job"] for m in received] == ["v", "i1", "i2"]
    for message in received:
        want = want_frames[message.meta["job"]]
        assert message.kind == "job_frames" and torch.equal(message.tensor, want)
        if message.meta["meta"]["kind"] == "image":
            assert encode_png(message.tensor[0].numpy()) == encode_png(want[0].numpy())
    assert codes == [0, 0, 0]


def test_a_shared_encoder_routes_each_job_to_the_diffusion_worker_its_job_names():
    jobs = JOBS["tiny"]
    _, want_frames = monolithic_jobs(build_model("tiny", device="cpu"), {"v": jobs["v"]}, [["v"], ["v"]])
    # Given one E process routing to two DC processes, a job sent down each route,
    chain = StageChain("tiny", ["E", "DC"], branches=2, timeout_s=30)
    try:
        for branch in (0, 1):
            chain.send(StageMessage("job", {"job": f"v{branch}", **jobs["v"], "route": route(branch)}))
        for _ in range(jobs["v"]["steps"]):
            for branch in (0, 1):
                chain.send(StageMessage("jobstep", {"jobs": [f"v{branch}"]}))
        # then each branch returns its own job, equal to the model's one-shot run.
        received = {branch: chain.recv(branch) for branch in (0, 1)}
    finally:
        codes = chain.close()
    for branch, message in received.items():
        assert message.kind == "job_frames" and message.meta["job"] == f"v{branch}"
        assert torch.equal(message.tensor, want_frames["v"])
    assert codes == [0, 0, 0]
