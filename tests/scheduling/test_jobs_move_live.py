"""Issue 14's end-to-end target: a video job preempted for a stream's burst moves to another worker
and finishes there with the MP4 of an uninterrupted run.

Two real ``manage.py gpuworker`` processes (tiny preset, K = 1, seeded weights on disk) register with
the test database, read their Redis command streams and report through the real ``DjangoReporter``;
the test drives the real dispatcher (``jobs_dispatch``, its outbox and the workers' answers): the API
queues a video job, it starts on the first worker, a stream lands there, the dispatcher pauses the
job at a step boundary, moves its state to the second worker (``migrate_in``/``migrate_out`` with
``"job"``, torch.distributed Gloo between the two processes) and resumes it there. The MP4 the API
serves must be byte-identical to an uninterrupted run computed in-process with ``ChunkEngine``.
"""

from __future__ import annotations

import os
import signal
import uuid
from pathlib import Path

import pytest
import redis
import torch
from django.conf import settings as django_settings

from contracts.wire.channel import stream_key
from gpu.models import GpuWorker
from scheduling.live.jobs import jobs_dispatch
from scheduling.models import WorkerCommand
from sessions.models import Job
from tests.e2e.conftest import wait_for
from tests.factories import SessionFactory
from workers.benchmarks.live import ProcessGroup
from workers.runtime.encoding import encode_mp4
from workers.runtime.engine import ChunkEngine

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.slow]  # two worker processes

ROOT = Path(__file__).resolve().parents[2]
VIDEO = {"kind": "video", "prompt": "a heron over a lake", "model": "tiny", "frames": 32, "steps": 100}
VIDEO |= {"seed": 17, "slo_s": 600}
WORKER_ARGS = ("--device", "cpu", "--preset", "tiny", "--capacity", "1", "--weights-from", "disk")
WORKER_ARGS += ("--heartbeat", "60")


@pytest.fixture
def two_workers(transactional_db, tmp_path):
    """Two gpuworker processes on the test database, ready; stopped (and deregistered) afterwards."""
    db = django_settings.DATABASES["default"]
    env = {
        **os.environ,
        "DATABASE_URL": f"postgres://{db['USER']}@{db['HOST']}:{db['PORT']}/{db['NAME']}",
        "REDIS_URL": django_settings.REDIS_URL,
        # The workers' job reports enqueue dispatch tasks: onto this test's Redis db, never consumed.
        "CELERY_BROKER_URL": django_settings.REDIS_URL,
        "MEDIA_ROOT": str(tmp_path / "media"),
        "WEIGHTS_DIR": str(tmp_path / "weights"),
        "CHECKPOINT_DIR": str(tmp_path / "checkpoints"),
        "PYTHONUNBUFFERED": "1",
    }
    tag = uuid.uuid4().hex[:6]
    names = [f"move-a-{tag}", f"move-b-{tag}"]  # the dispatcher breaks ties by name: a first
    group = ProcessGroup(tmp_path / "logs", env, ROOT, grace_s=15.0)
    with group:
        processes = [
            group.spawn(name, "manage.py", "gpuworker", "--name", name, *WORKER_ARGS) for name in names
        ]
        wait_for(
            lambda: (
                group.dead() is None
                and GpuWorker.objects.filter(name__in=names, status=GpuWorker.Status.READY).count() == 2
            ),
            timeout=90,
            message=f"two ready workers ({group.dead()})",
        )
        yield [GpuWorker.objects.get(name=name) for name in names], processes, tmp_path / "media"
    client = redis.Redis.from_url(django_settings.REDIS_URL)
    client.delete(*(stream_key(name) for name in names), "default", "celery")


def uninterrupted_mp4(job: Job) -> bytes:
    """The job's video run alone to the end in this process, from the preset's seeded weights."""
    torch.set_num_threads(1)
    engine = ChunkEngine.from_preset("tiny", encode_workers=1)
    try:
        fields = {k: getattr(job, k) for k in ("prompt", "seed", "width", "height", "frames", "steps")}
        engine.add_job("reference", kind="video", **fields)
        while engine.job_progress("reference")[0] < job.steps:
            engine.job_step(["reference"])
        return encode_mp4(engine.job_frames("reference").numpy(), engine.model.fps)
    finally:
        engine.close()


def answered(job: Job, kind: str) -> WorkerCommand | None:
    return WorkerCommand.objects.filter(job=job, kind=kind).exclude(status="sent").first()


def test_a_video_job_preempted_by_a_stream_moves_to_another_worker_and_its_mp4_is_unchanged(
    two_workers, user_api, settings
):
    (first, second), (first_process, _), media = two_workers
    settings.MEDIA_ROOT = media
    response = user_api.post("/api/jobs/", VIDEO, format="json")
    assert response.status_code == 201, response.content
    job = Job.objects.get(pk=response.json()["id"])

    # Given the job running on the first worker, some steps in
    assert jobs_dispatch().assigned == 1
    job.refresh_from_db()
    assert job.worker == first
    wait_for(lambda: Job.objects.filter(pk=job.pk, steps_done__gt=0).exists(), 60, message="progress")
    # Freeze the first worker mid-job (a frozen process, as in the fault tests) so that the job
    # cannot run to its end before the preemption reaches it, however loaded the machine is; it
    # reads the pause at its next step boundary once it runs again.
    os.kill(first_process.pid, signal.SIGSTOP)
    try:
        job.refresh_from_db()
        assert job.state == "running" and job.steps_done < VIDEO["steps"], (job.state, job.steps_done)

        # When a stream's burst takes the first worker's only slot
        SessionFactory(status="executing", worker=first, state_location="worker")
        assert jobs_dispatch().paused == 1
    finally:
        os.kill(first_process.pid, signal.SIGCONT)
    pause = wait_for(lambda: answered(job, "job_pause"), 60, message="the pause's answer")
    assert pause.status == "acked" and 0 < pause.result["step"] < VIDEO["steps"], (pause.reason, pause.result)

    # Then the dispatcher moves it to the second worker (Gloo between the processes), resumes it
    # there once both sides answered, and the second worker finishes it
    assert jobs_dispatch().moved == 1
    wait_for(lambda: answered(job, "migrate_in") and answered(job, "migrate_out"), 60, message="the move")
    assert (answered(job, "migrate_in").status, answered(job, "migrate_out").status) == ("acked", "acked")
    assert jobs_dispatch().resumed == 1
    wait_for(lambda: Job.objects.filter(pk=job.pk, state__in=["done", "failed"]).exists(), 60, message="end")
    job.refresh_from_db()
    assert (job.state, job.worker, job.steps_done, job.error) == ("done", second, VIDEO["steps"], "")
    assert WorkerCommand.objects.get(job=job, kind="job_resume").worker == second

    download = user_api.get(f"/api/jobs/{job.pk}/result/")
    assert download.status_code == 200 and download["Content-Type"] == "video/mp4"
    assert b"".join(download.streaming_content) == uninterrupted_mp4(job)
