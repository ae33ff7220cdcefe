"""The live dispatcher on real rows (PostgreSQL, the command outbox): images of one model and size go to
a worker that already runs images of that size, where the worker's engine batches them into one step,
under both policies; and a video's ``job_run`` carries the SP degree of the worker's job devices."""

from __future__ import annotations

from datetime import timedelta

import pytest
from django.utils import timezone

from gpu.models import GpuWorker
from scheduling.live.jobs import jobs_dispatch
from scheduling.models import WorkerCommand
from sessions.models import Job
from tests.factories import GpuWorkerFactory, JobFactory

pytestmark = pytest.mark.django_db


def placed() -> dict[str, str]:
    return {
        str(j.pk): j.worker.name for j in Job.objects.filter(state=Job.State.RUNNING).select_related("worker")
    }


@pytest.mark.parametrize("name", ["edf", "genserve"])
def test_images_of_one_size_share_a_worker_and_another_size_takes_the_roomiest(settings, name):
    settings.STREAMSERVE = settings.STREAMSERVE | {"JOB_POLICY": name}
    # Given two idle workers of K = 4 and three queued images: two at 64×64, one at 128×64
    GpuWorkerFactory(model_preset="tiny", capacity=4)
    GpuWorkerFactory(model_preset="tiny", capacity=4)
    same = [JobFactory(width=64, height=64), JobFactory(width=64, height=64)]
    other = JobFactory(width=128, height=64)
    # When the dispatcher runs
    assert jobs_dispatch().assigned == 3
    # Then both 64×64 images are on one worker (one batched step there) and the 128×64 image on the other
    where = placed()
    assert where[str(same[0].pk)] == where[str(same[1].pk)]
    assert where[str(other.pk)] != where[str(same[0].pk)]


def test_a_new_image_joins_the_worker_running_its_size_rather_than_the_roomiest(settings):
    # Given a worker running a 64×64 image (room 3) and an idle worker (room 4)
    busy = GpuWorkerFactory(model_preset="tiny", capacity=4)
    GpuWorkerFactory(model_preset="tiny", capacity=4)
    JobFactory(state=Job.State.RUNNING, worker=busy, epoch=1)
    # When a 64×64 image and then a video are queued
    image = JobFactory(width=64, height=64)
    assert jobs_dispatch().assigned == 1
    # Then the image joins the running one's batch
    assert placed()[str(image.pk)] == busy.name
    # And a video still goes to the roomiest worker
    video = JobFactory(kind=Job.Kind.VIDEO, frames=16)
    jobs_dispatch()
    assert placed()[str(video.pk)] != busy.name


def test_a_full_batch_worker_sends_the_image_to_the_roomiest():
    # Given a worker of K = 1 running a 64×64 image and another worker with room
    full = GpuWorkerFactory(model_preset="tiny", capacity=1)
    roomy = GpuWorkerFactory(model_preset="tiny", capacity=2)
    JobFactory(state=Job.State.RUNNING, worker=full, epoch=1)
    image = JobFactory()
    # When the dispatcher runs, Then the image goes where there is room
    assert jobs_dispatch().assigned == 1
    assert placed()[str(image.pk)] == roomy.name


def test_a_video_job_run_names_the_sp_degree_of_a_worker_with_several_job_devices():
    # Given one worker that reports 4 job devices in its heartbeat
    GpuWorkerFactory(model_preset="tiny", capacity=4, telemetry={"job_devices": 4})
    video = JobFactory(kind=Job.Kind.VIDEO, frames=16)
    image = JobFactory()
    # When both jobs are dispatched
    assert jobs_dispatch().assigned == 2
    runs = {c.job_id: c.payload for c in WorkerCommand.objects.filter(kind=WorkerCommand.Kind.JOB_RUN)}
    # Then the video's job_run asks for SP 4 and the image's names none (it batches instead)
    assert runs[video.pk]["sp_degree"] == 4
    assert "sp_degree" not in runs[image.pk]


def test_a_worker_with_one_device_gets_no_sp_degree():
    GpuWorkerFactory(model_preset="tiny", capacity=4, status=GpuWorker.Status.READY)
    video = JobFactory(kind=Job.Kind.VIDEO, frames=16)
    assert jobs_dispatch().assigned == 1
    payload = WorkerCommand.objects.get(kind=WorkerCommand.Kind.JOB_RUN, job=video).payload
    assert "sp_degree" not in payload


@pytest.mark.parametrize(("name", "joins"), [("edf", True), ("genserve", False)])
def test_genserve_sends_an_image_elsewhere_when_joining_the_batch_would_miss_its_deadline(
    settings, name, joins
):
    settings.STREAMSERVE = settings.STREAMSERVE | {"JOB_POLICY": name}
    # Given a worker running a 64×64 image and an idle worker; by the built-in SD3.5 profile a
    # 64×64 step takes 0.745 ms alone and 0.864 ms in a batch of two
    busy = GpuWorkerFactory(model_preset="tiny", capacity=4)
    GpuWorkerFactory(model_preset="tiny", capacity=4)
    JobFactory(state=Job.State.RUNNING, worker=busy, epoch=1)
    # When an image of 10,000 steps due in 8 s is queued (7.45 s alone, 8.64 s in the batch)
    now = timezone.now()
    image = JobFactory(steps=10_000, submitted_at=now, deadline=now + timedelta(seconds=8))
    assert jobs_dispatch().assigned == 1
    # Then edf (cost-blind) joins the batch, genserve (costed) starts it on the idle worker
    assert (placed()[str(image.pk)] == busy.name) is joins
