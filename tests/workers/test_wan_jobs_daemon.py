"""Wan one-shot jobs through the worker daemon: two real worker processes serving a tiny Wan
checkpoint saved in the published diffusers layout (a ``MODEL_PATHS`` preset), commanded through
their Redis command streams. A video job paused mid-rollout moves from one to the other over Gloo
and finishes there with the MP4 bytes of an uninterrupted run; an image comes back as the PNG of
the first frame a streaming session of the same prompt and seed shows. The harness (reporter queue,
command helpers) is tests/workers/test_jobs_daemon.py's."""

from __future__ import annotations

import os
import time
import uuid
from typing import Any

import pytest
import redis
import torch
from django.conf import settings

from contracts.catalog.local_paths import read_wan_architecture
from tests.workers.test_jobs_daemon import CONTEXT, QueueReporter, Worker
from tests.workers_runtime.wan_layouts import TINY_SETTINGS, write_diffusers_layout
from workers.runtime.encoding import encode_mp4, encode_png
from workers.runtime.models.wan_causal import WanCausalModel

pytestmark = pytest.mark.filterwarnings("ignore::FutureWarning")

PRESET = "wan-jobs-test"
PROMPT = "a red fox running through snow"
# The tiny checkpoint at 128x128 sampling each chunk in 100 steps, so that a video of 2 chunks (16
# frames, 200 steps: the most a job may take) runs long enough to be paused while it runs.
SETTINGS = TINY_SETTINGS | {"width": 128, "height": 128, "denoising_timesteps": list(range(1000, 0, -10))}
VIDEO = {"job_kind": "video", "model": PRESET, "prompt": PROMPT, "width": 128, "height": 128}
VIDEO |= {"frames": 16, "steps": 200, "seed": 11, "priority": 0}
IMAGE = VIDEO | {"job_kind": "image", "frames": 1, "steps": 100, "seed": 12}


def _wan_worker_main(name: str, redis_url: str, reports: Any, wan_dir: str) -> None:
    os.environ["DJANGO_SETTINGS_MODULE"] = "controlplane.settings"
    os.environ["MODEL_PATHS"] = f"{PRESET}={wan_dir}"  # registered at django.setup(), as a worker does
    import django

    django.setup()
    # The daemon and the engine after django.setup(): the MODEL_PATHS preset is registered there.
    from workers.daemon import WorkerDaemon
    from workers.runtime.engine import ChunkEngine
    from workers.runtime.transport import MigrationListener

    torch.set_num_threads(1)
    engine = ChunkEngine.from_preset(PRESET, encode_workers=1)
    listener = MigrationListener(engine.device)
    daemon = WorkerDaemon(
        name=name,
        engine=engine,
        redis_client=redis.Redis.from_url(redis_url),
        reporter=QueueReporter(reports),
        capacity=2,
        migration_listener=listener,
        heartbeat_s=60.0,
    )
    reports.put(("address", (listener.address,), {}))
    daemon.run()


class WanWorker(Worker):
    def __init__(self, client: redis.Redis, wan_dir: str) -> None:
        self.name = f"wanjobs-{uuid.uuid4().hex[:8]}"
        self.client = client
        self.reports = CONTEXT.Queue()
        self.process = CONTEXT.Process(
            target=_wan_worker_main, args=(self.name, settings.REDIS_URL, self.reports, wan_dir), daemon=True
        )
        self.process.start()
        self.seen: list[tuple[str, tuple, dict]] = []
        (self.address,) = self.expect(lambda r: r[0] == "address")[1]


@pytest.fixture(scope="module")
def wan_dir(tmp_path_factory):
    return write_diffusers_layout(
        tmp_path_factory.mktemp("wandaemon") / "Wan2.1-T2V-tiny-Diffusers", settings=SETTINGS
    )


@pytest.fixture(scope="module")
def workers(wan_dir):
    client = redis.Redis.from_url(settings.REDIS_URL)
    pair = [WanWorker(client, str(wan_dir)), WanWorker(client, str(wan_dir))]
    yield pair
    for worker in pair:
        worker.stop()


@pytest.fixture(scope="module")
def reference(wan_dir) -> dict[str, bytes]:
    """The uninterrupted video's MP4 and a streaming session's first frame as a PNG, in this process."""
    torch.set_num_threads(1)
    model = WanCausalModel(read_wan_architecture(wan_dir), preset=PRESET)
    fields = {k: VIDEO[k] for k in ("prompt", "seed", "width", "height", "frames", "steps")}
    job = model.create_job(kind="video", **fields)
    while job.meta["step"] < job.meta["steps"]:
        model.job_step([job])
    session = model.create_state(PROMPT, IMAGE["seed"])
    first = model.generate([session])[0].frames[0]
    return {
        "mp4": encode_mp4(model.job_frames(job).numpy(), model.fps),
        "png": encode_png(first.numpy()),
    }


def test_a_paused_wan_video_moves_to_another_worker_and_finishes_with_the_uninterrupted_mp4(
    workers, reference
):
    source, target = workers
    job = str(uuid.uuid4())
    # Given a Wan video job running on the source, paused once it has made progress
    run = source.send("job_run", job=job, epoch=1, deadline=time.time() + 600, **VIDEO)
    assert source.answer(run) == ("acked", "", {"admitted": True})
    source.expect(lambda r: r[0] == "job_progress" and r[2]["step"] > 0)
    status, _, paused = source.answer(source.send("job_pause", job=job, epoch=1))
    steps_done = paused["step"]
    assert status == "acked" and 0 < steps_done < VIDEO["steps"], paused

    # When it migrates (its latents, KV ring and embeddings) and resumes on the target
    incoming = target.send("migrate_in", job=job, epoch=2, source=source.name)
    assert target.answer(incoming)[0] == "acked"
    outgoing = source.send("migrate_out", job=job, epoch=1, new_epoch=2, target_address=target.address)
    status, reason, _ = source.answer(outgoing)
    assert status == "acked", reason
    arrived = target.expect(lambda r: r[0] == "job_progress" and r[1][0] == job)
    assert arrived[2] == {"state": "paused", "step": steps_done, "steps": VIDEO["steps"]}
    assert target.answer(target.send("job_resume", job=job, epoch=2))[0] == "acked"

    # Then it finishes there with the MP4 of an uninterrupted run, byte for byte
    _, (job_id, epoch, worker), done = target.expect(
        lambda r: r[0] in ("job_completed", "job_failed") and r[1][0] == job
    )
    assert (job_id, epoch, worker) == (job, 2, target.name) and "reason" not in done, done
    assert done["content_type"] == "video/mp4" and done["content"] == reference["mp4"]


def test_a_wan_image_is_the_sessions_first_frame_and_bad_sizes_are_refused(workers, reference):
    worker, _ = workers
    job = str(uuid.uuid4())
    status, reason, _ = worker.answer(
        worker.send("job_run", job=job, epoch=1, deadline=time.time() + 60, **(IMAGE | {"width": 64}))
    )
    assert status == "refused" and "width" in reason and "128x128 only" in reason
    status, reason, _ = worker.answer(
        worker.send("job_run", job=job, epoch=1, deadline=time.time() + 60, **(VIDEO | {"steps": 4}))
    )
    assert status == "refused" and "steps must be 200" in reason
    run = worker.send("job_run", job=job, epoch=1, deadline=time.time() + 60, **IMAGE)
    assert worker.answer(run)[0] == "acked"
    _, _, done = worker.expect(lambda r: r[0] in ("job_completed", "job_failed") and r[1][0] == job)
    assert done.get("content_type") == "image/png", done
    assert done["content"] == reference["png"]
