"""One-shot jobs through the whole control plane and a real worker daemon, stepped in the test:
the API queues a job, the dispatcher sends ``job_run`` on the worker's Redis command stream, arriving
streams make it pause the job (``job_pause``) and leaving ones resume it, the real tiny engine runs
its steps, and the real ``DjangoReporter`` (its own thread, so the test is transactional) reports
progress and the PNG, which the API serves back from the default storage."""

from __future__ import annotations

import io
import uuid

import pytest
from django.utils import timezone
from PIL import Image

from scheduling.live.jobs import jobs_dispatch
from scheduling.models import WorkerCommand
from sessions.models import GenerationSession, Job
from tests.daemons import stepped_daemon, steps_until
from tests.factories import GpuWorkerFactory, SessionFactory

pytestmark = pytest.mark.django_db(transaction=True)


@pytest.fixture
def daemon():
    worker = GpuWorkerFactory(
        name=f"jobs-{uuid.uuid4().hex[:8]}", model_preset="tiny", gpu_type="cpu", capacity=1
    )
    with stepped_daemon(worker, max_batch=1, capacity=1, heartbeat_s=60.0) as instance:
        yield instance


def answered(kind: str, job: Job) -> WorkerCommand | None:
    return WorkerCommand.objects.filter(job=job, kind=kind).exclude(status="sent").first()


def test_a_job_is_preempted_by_streams_resumed_when_they_leave_and_its_png_is_served(
    daemon, user_api, settings, tmp_path
):
    settings.MEDIA_ROOT = tmp_path
    body = {"kind": "image", "prompt": "a red fox", "model": "tiny", "steps": 6, "seed": 5, "slo_s": 600}
    response = user_api.post("/api/jobs/", body, format="json")
    assert response.status_code == 201, response.content
    job = Job.objects.get(pk=response.json()["id"])

    assert jobs_dispatch().assigned == 1
    # A stream lands on the worker (K=1) before it has even read the job_run: the job gives way.
    stream = SessionFactory(status="executing", worker=daemon.worker, state_location="worker")
    assert jobs_dispatch().paused == 1
    run = steps_until(daemon, lambda: answered("job_run", job))
    pause = steps_until(daemon, lambda: answered("job_pause", job))
    assert (run.status, run.result) == ("acked", {"admitted": True})
    assert pause.status == "acked" and pause.result["step"] < job.steps
    job.refresh_from_db()
    assert (job.state, job.worker, job.epoch) == ("paused", daemon.worker, 1)

    GenerationSession.objects.filter(pk=stream.pk).update(
        status="terminated", worker=None, state_location="none", terminated_at=timezone.now()
    )
    assert jobs_dispatch().resumed == 1
    steps_until(daemon, lambda: Job.objects.filter(pk=job.pk, state="done").exists())
    assert answered("job_resume", job).status == "acked"

    job.refresh_from_db()
    assert (job.steps_done, job.result_content_type, job.run_s > 0) == (job.steps, "image/png", True)
    download = user_api.get(f"/api/jobs/{job.pk}/result/")
    assert download.status_code == 200 and download["Content-Type"] == "image/png"
    png = b"".join(download.streaming_content)
    assert png == (tmp_path / job.result.name).read_bytes()
    image = Image.open(io.BytesIO(png))
    assert (image.format, image.size, image.mode) == ("PNG", (64, 64), "RGB")
