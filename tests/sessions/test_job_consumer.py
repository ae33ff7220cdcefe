"""The job WebSocket over the real Redis channel layer: a user's job progress as the control plane
and a worker's reports change it (queued with position, running step i/n, done with the result's
URL, failed with reason), stale-epoch reports never reaching it, and bad frames answered in place."""

from __future__ import annotations

import json

import pytest
from asgiref.sync import sync_to_async
from channels.testing import WebsocketCommunicator
from django.db import transaction
from django.utils import timezone

from sessions import jobs
from sessions.models import Job
from tests.factories import GpuWorkerFactory, JobFactory, UserFactory
from tests.sessions.sockets import communicator_as, connect_as

pytestmark = [
    pytest.mark.django_db(transaction=True),
    pytest.mark.asyncio,
    pytest.mark.usefixtures("close_thread_connections"),
]


async def connect(user) -> WebsocketCommunicator:
    return await connect_as(user, "/ws/jobs/")


async def receive(communicator) -> dict:
    return json.loads(await communicator.receive_from(timeout=5))


def submit(user) -> Job:
    spec = jobs.job_spec_build(
        kind="image", prompt="a lighthouse", model_name="tiny", resolution="64x64", frames=None,
        steps=4, seed=3, slo_s=60.0, deadline=None, priority=0, now=timezone.now(),
    )  # fmt: skip
    return jobs.job_submit(owner=user, spec=spec)


def assign(job: Job, worker) -> Job:
    with transaction.atomic():
        assert jobs.job_assign(job=job, worker=worker)
    return job


async def test_progress_reaches_the_owner_from_queued_to_done(settings, tmp_path):
    settings.MEDIA_ROOT = tmp_path
    user = await sync_to_async(UserFactory)()
    worker = await sync_to_async(GpuWorkerFactory)(model_preset="tiny")
    communicator = await connect(user)
    job = await sync_to_async(submit)(user)
    queued = await receive(communicator)
    assert (queued["type"], queued["job"], queued["state"], queued["position"]) == (
        "job",
        str(job.pk),
        "queued",
        1,
    )

    await sync_to_async(assign)(job, worker)
    running = await receive(communicator)
    assert (running["state"], running["step"], running["steps"], running["worker"]) == (
        "running",
        0,
        4,
        worker.name,
    )

    # A report from an older epoch (a worker that lost the job) changes nothing and sends nothing:
    # the next message the socket sees is the current holder's.
    await sync_to_async(jobs.job_progress)(
        str(job.pk), job.epoch - 1, worker.name, state="running", step=3, steps=4
    )
    await sync_to_async(jobs.job_progress)(
        str(job.pk), job.epoch, worker.name, state="running", step=2, steps=4
    )
    step = await receive(communicator)
    assert (step["state"], step["step"]) == ("running", 2)

    await sync_to_async(jobs.job_completed)(
        str(job.pk), job.epoch, worker.name, content=b"\x89PNG", content_type="image/png", extension="png", run_s=0.5
    )  # fmt: skip
    done = await receive(communicator)
    assert (done["state"], done["step"], done["result_url"]) == ("done", 4, f"/api/jobs/{job.pk}/result/")
    stored = await sync_to_async(Job.objects.get)(pk=job.pk)
    assert (tmp_path / stored.result.name).read_bytes() == b"\x89PNG"
    await communicator.disconnect()


async def test_a_dispatch_round_tells_the_jobs_left_in_line_their_new_place():
    from scheduling.live.jobs import jobs_dispatch

    user = await sync_to_async(UserFactory)()
    await sync_to_async(GpuWorkerFactory)(model_preset="tiny", capacity=1)
    first, second = await sync_to_async(submit)(user), await sync_to_async(submit)(user)
    communicator = await connect(user)
    on_connect = [await receive(communicator), await receive(communicator)]
    assert [(m["job"], m["position"]) for m in on_connect] == [(str(first.pk), 1), (str(second.pk), 2)]
    assert (await sync_to_async(jobs_dispatch)()).assigned == 1
    started, moved_up = await receive(communicator), await receive(communicator)
    assert (started["job"], started["state"]) == (str(first.pk), "running")
    assert (moved_up["job"], moved_up["state"], moved_up["position"]) == (str(second.pk), "queued", 1)
    await communicator.disconnect()


async def test_a_failure_arrives_with_its_reason_and_stale_reports_cannot_end_a_job():
    user = await sync_to_async(UserFactory)()
    worker = await sync_to_async(GpuWorkerFactory)(model_preset="tiny")
    job = await sync_to_async(JobFactory)(owner=user)
    await sync_to_async(assign)(job, worker)
    communicator = await connect(user)
    snapshot = await receive(communicator)  # the job in flight, on connect
    assert (snapshot["job"], snapshot["state"]) == (str(job.pk), "running")
    await sync_to_async(jobs.job_failed)(str(job.pk), job.epoch - 1, worker.name, reason="stale")
    await sync_to_async(jobs.job_failed)(str(job.pk), job.epoch, "another-worker", reason="not the holder")
    await sync_to_async(jobs.job_failed)(str(job.pk), job.epoch, worker.name, reason="out of memory")
    failed = await receive(communicator)
    assert (failed["state"], failed["error"]) == ("failed", "out of memory")
    await communicator.disconnect()


async def test_bad_frames_get_error_frames_and_the_socket_stays_open():
    user, other = await sync_to_async(UserFactory)(), await sync_to_async(UserFactory)()
    theirs = await sync_to_async(JobFactory)(owner=other)
    communicator = await connect(user)
    for frame, reason in [
        ("not json", "not valid JSON"),
        (json.dumps({"type": "delete"}), "'type' must be one of cancel"),
        (json.dumps({"type": "cancel"}), "needs a 'job' id"),
        (json.dumps({"type": "cancel", "job": [1]}), "flat object"),
    ]:
        await communicator.send_to(text_data=frame)
        error = await receive(communicator)
        assert (error["type"], error["code"]) == ("error", "bad_message")
        assert reason in error["detail"]
    await communicator.send_to(text_data=json.dumps({"type": "cancel", "job": str(theirs.pk)}))
    assert (await receive(communicator))["code"] == "not_found"
    assert (await sync_to_async(Job.objects.get)(pk=theirs.pk)).state == "queued"
    mine = await sync_to_async(JobFactory)(owner=user)
    await communicator.send_to(text_data=json.dumps({"type": "cancel", "job": str(mine.pk)}))
    cancelled = await receive(communicator)
    assert (cancelled["job"], cancelled["state"]) == (str(mine.pk), "cancelled")
    await communicator.disconnect()


async def test_anonymous_sockets_are_refused_with_a_reason():
    from django.contrib.auth.models import AnonymousUser

    communicator = communicator_as(AnonymousUser(), "/ws/jobs/")
    await communicator.connect()
    assert (await receive(communicator))["code"] == "not_authenticated"
    assert (await communicator.receive_output(timeout=5))["code"] == 4401
