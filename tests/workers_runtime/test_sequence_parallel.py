"""Elastic sequence parallelism of a video job's step (issue 14, GenServe): the causal-DiT splits the
video's tokens across devices and gathers keys/values for self-attention. On CPU the devices repeat
``cpu``, so the split, the all-gather and the reassembly run for real; the result must be the one
device's: bit for bit where the shards are even (every part but self-attention is per token, and each
query row attends over the same keys in the same order), within float32 rounding where they are not
(CPU GEMM and attention kernels choose their blocking by the number of rows, so a shard of another
size may sum a row's products in another order: measured 7e-7 on latents of magnitude 4)."""

from __future__ import annotations

import queue
import time
import uuid
from typing import Any

import pytest
import redis
import torch

from workers.daemon import WorkerDaemon
from workers.daemon.jobs import JobRefused, JobRunner
from workers.ports import Reporter
from workers.runtime.engine import ChunkEngine
from workers.runtime.models import build_model

PROMPT = "a paper boat drifting down a gutter"
# tiny: 8× spatial, 2× temporal upsampling, patch 2 → 64×64 is 4×4 = 16 tokens per latent frame,
# and 8 frames are 4 latent frames: 64 tokens (even shards for 2 and 4 devices, not for 5).
VIDEO = {"kind": "video", "width": 64, "height": 64, "frames": 8}


@pytest.fixture(scope="module")
def model():
    return build_model("tiny", device="cpu")


def latents_per_step(model, devices: list[str], steps: int = 3) -> list[torch.Tensor]:
    state = model.create_job(prompt=PROMPT, seed=21, steps=steps, **VIDEO)
    seen = []
    with model.sequence_parallel(devices):
        for _ in range(steps):
            model.job_step([state])
            seen.append(state.tensors["latents"].clone())
    return seen


@pytest.mark.parametrize("degree", [2, 4])
def test_a_video_step_split_evenly_across_devices_gives_the_latents_of_one_device_bit_for_bit(model, degree):
    # Given a video job run on one device, and the same job split `degree` ways
    one = latents_per_step(model, ["cpu"])
    # When each step runs sequence-parallel
    split = latents_per_step(model, ["cpu"] * degree)
    # Then every step's latents are identical
    assert all(torch.equal(a, b) for a, b in zip(one, split, strict=True))
    assert not torch.equal(one[0], one[-1])  # the steps did change the latents


def test_uneven_shards_agree_with_one_device_within_float32_rounding(model):
    # Given 64 tokens split 5 ways (13, 13, 13, 13, 12)
    one = latents_per_step(model, ["cpu"])
    split = latents_per_step(model, ["cpu"] * 5)
    # Then every step's latents agree to float32 rounding (module docstring)
    for a, b in zip(one, split, strict=True):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-5)


def test_the_split_step_embeds_one_shard_of_the_token_sequence_per_device(model):
    # Given a forward hook counting the tokens each patch embedding sees
    seen: list[int] = []
    handle = model.net.dit.patch_embed.register_forward_hook(
        lambda _m, args, _out: seen.append(args[0].shape[1])
    )
    try:
        # When one step runs on 4 devices
        latents_per_step(model, ["cpu"] * 4, steps=1)
    finally:
        handle.remove()
    # Then the 64 tokens were embedded in 4 shards that cover the sequence once
    assert seen == [16, 16, 16, 16]


def test_an_image_batch_is_never_split(model):
    # Given an image job under a 4-device context
    state = model.create_job(kind="image", prompt=PROMPT, seed=2, width=64, height=64, frames=1, steps=2)
    seen: list[int] = []
    handle = model.net.dit.patch_embed.register_forward_hook(
        lambda _m, args, _out: seen.append(args[0].shape[1])
    )
    try:
        with model.sequence_parallel(["cpu"] * 4):
            model.job_step([state])
    finally:
        handle.remove()
    # Then its 16 tokens went through in one piece (images batch by resolution instead)
    assert seen == [16]


class CollectingReporter(Reporter):
    def __init__(self) -> None:
        self.completed: dict[str, bytes] = {}

    def job_progress(self, *args: Any, **kwargs: Any) -> None:
        pass

    def job_completed(self, job_id: str, *args: Any, content: bytes, **kwargs: Any) -> None:
        self.completed[job_id] = content

    def job_failed(self, job_id: str, *args: Any, reason: str, **kwargs: Any) -> None:
        raise AssertionError(f"job {job_id} failed: {reason}")


def run_on_runner(model, devices: list[str], command: dict[str, Any]) -> tuple[dict, bytes]:
    engine = ChunkEngine(model, encode_workers=1)
    reporter = CollectingReporter()
    runner = JobRunner(
        engine=engine, reporter=reporter, worker_name="w", capacity=2, clock=time.monotonic, devices=devices
    )
    try:
        answer = runner.run(command)
        while runner.jobs:
            runner.run_step(now=time.monotonic(), free_s=float("inf"), probe_s=0.0)
    finally:
        runner.close()
        engine.close()
    return answer, reporter.completed[command["job"]]


def job_run(**extra: Any) -> dict[str, Any]:
    return {"kind": "job_run", "job": "v", "epoch": 1, "job_kind": "video", "model": "tiny", "prompt": PROMPT,
            "width": 64, "height": 64, "frames": 8, "steps": 3, "seed": 4, "deadline": time.time() + 60,
            "priority": 0} | extra  # fmt: skip


def test_the_worker_runs_a_video_at_the_commanded_degree_capped_by_its_devices_with_the_same_mp4(model):
    # Given a worker with one device and a worker with four (cpu, repeated)
    # When both run the same video, the second asked for SP 8
    plain_answer, plain = run_on_runner(model, ["cpu"], job_run(sp_degree=8))
    split_answer, split = run_on_runner(model, ["cpu"] * 4, job_run(sp_degree=8))
    # Then the one-device worker runs it whole, the other at its 4 devices, and the MP4s are the same
    assert plain_answer == {"admitted": True}
    assert split_answer == {"admitted": True, "sp_degree": 4}
    assert plain == split and plain[4:8] == b"ftyp"


def test_a_job_run_with_a_bad_sp_degree_is_refused_naming_the_field(model):
    engine = ChunkEngine(model, encode_workers=1)
    runner = JobRunner(
        engine=engine, reporter=CollectingReporter(), worker_name="w", capacity=2, clock=time.monotonic
    )
    try:
        for bad in (0, "2", True):
            with pytest.raises(JobRefused, match="sp_degree"):
                runner.run(job_run(sp_degree=bad))
        assert not runner.jobs
    finally:
        runner.close()
        engine.close()


class BeatReporter(Reporter):
    def __init__(self) -> None:
        self.beats: queue.Queue = queue.Queue()

    def heartbeat(
        self, telemetry: dict[str, Any], resident: list[str], parked: list[str], stage: dict | None = None
    ) -> None:
        self.beats.put(telemetry)


def test_the_daemon_heartbeat_reports_how_many_devices_a_video_step_can_use(model, settings):
    # Given a worker daemon on CPU (one job device) beating every 10 ms
    client = redis.Redis.from_url(settings.REDIS_URL)
    reporter = BeatReporter()
    engine = ChunkEngine(model, encode_workers=1)
    daemon = WorkerDaemon(
        name=f"sp-{uuid.uuid4().hex[:8]}", engine=engine, redis_client=client, reporter=reporter, capacity=1,
        heartbeat_s=0.01,
    )  # fmt: skip
    daemon.heartbeat.start()
    try:
        # When it beats
        telemetry = reporter.beats.get(timeout=60)
    finally:
        daemon.stopping.set()
        daemon.heartbeat.join()
        daemon.jobs.close()
        engine.close()
    # Then the telemetry the control plane stores names its job devices (the dispatcher's SP degree)
    assert telemetry["job_devices"] == len(daemon.jobs.devices) == 1
