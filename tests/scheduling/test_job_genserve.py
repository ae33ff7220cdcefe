"""``JOB_POLICY=genserve`` on real rows (the live dispatcher, PostgreSQL, the command outbox): GenServe's
round solver pauses the job with the most slack when streams take the room — where ``edf`` pauses
the latest deadline — and pauses a video with slack for an image that would otherwise miss its
deadline, which ``edf`` never does. Steps are costed from a one-shot profile JSON (``JOB_PROFILES``)."""

from __future__ import annotations

import json
from datetime import timedelta

import pytest
from django.utils import timezone

from scheduling.core.jobs.genserve import GenServeJobPolicy
from scheduling.core.jobs.policy import JobView, load_job_policy
from scheduling.live.jobs import jobs_dispatch
from sessions.models import Job
from tests.factories import GpuWorkerFactory, JobFactory, SessionFactory

pytestmark = pytest.mark.django_db

# What ``profile_model --one-shot`` writes, for the tiny preset's 16-frame 64×64 video: 2 s a step.
PROFILE = {"model": "tiny", "kind": "video", "points": [{"width": 64, "height": 64, "frames": 16, "batch": 1,
                                                        "step_s": 2.0}]}  # fmt: skip


@pytest.fixture
def policy(settings, tmp_path):
    path = tmp_path / "tiny-video.json"
    path.write_text(json.dumps(PROFILE))

    def use(name: str) -> None:
        settings.STREAMSERVE = settings.STREAMSERVE | {"JOB_POLICY": name, "JOB_PROFILES": [str(path)]}

    return use


def video_due_in(seconds: float, **fields) -> Job:
    now = timezone.now()
    return JobFactory(
        kind="video",
        frames=16,
        steps=100,
        submitted_at=now,
        deadline=now + timedelta(seconds=seconds),
        **fields,
    )


@pytest.mark.parametrize(("name", "paused"), [("edf", "later"), ("genserve", "nearly_done")])
def test_streams_arriving_pause_the_most_slack_video_under_genserve_the_latest_deadline_under_edf(
    policy, name, paused
):
    policy(name)
    worker = GpuWorkerFactory(model_preset="tiny", capacity=2)
    # Due sooner but 5 steps (10 s) from done: 290 s of slack; due later but 100 steps (200 s) left: 200 s
    videos = {"nearly_done": video_due_in(300), "later": video_due_in(400)}
    assert jobs_dispatch().assigned == 2
    Job.objects.filter(pk=videos["nearly_done"].pk).update(steps_done=95)

    SessionFactory(worker=worker, status="executing", state_location="worker")
    assert jobs_dispatch().paused == 1
    states = {key: Job.objects.get(pk=job.pk).state for key, job in videos.items()}
    assert states == {key: "paused" if key == paused else "running" for key in videos}


@pytest.mark.parametrize(("name", "preempts"), [("edf", False), ("genserve", True)])
def test_genserve_pauses_a_video_with_slack_for_an_image_that_would_miss_its_deadline(policy, name, preempts):
    policy(name)
    worker = GpuWorkerFactory(model_preset="tiny", capacity=1)
    video = video_due_in(1000)
    assert jobs_dispatch().assigned == 1
    now = timezone.now()
    image = JobFactory(submitted_at=now, deadline=now + timedelta(seconds=5))
    result = jobs_dispatch()
    video.refresh_from_db()
    image.refresh_from_db()
    assert (result.paused, result.assigned) == ((1, 1) if preempts else (0, 0))
    assert (video.state, image.state) == (("paused", "running") if preempts else ("running", "queued"))
    assert image.worker == (worker if preempts else None)


def test_genserve_costs_other_models_by_their_kinds_default_profile_and_names_a_bad_profile():
    policy = load_job_policy("genserve")
    assert isinstance(policy, GenServeJobPolicy)
    video = JobView(id="v", model="tiny", state="queued", priority=0, deadline=0.0, steps=10, steps_done=4,
                    kind="video", frames=16)  # fmt: skip
    wan = policy.costs.catalog.profile("video", None)
    assert policy.costs.profile(video) is wan
    assert policy.costs.remaining_s(video) == pytest.approx(
        6 * wan.step_ms(64, 64, 16) / 1000 + wan.decode_ms(64, 64, 16, 10) / 1000
    )
    with pytest.raises(ValueError, match=r"JOB_PROFILES.*no-such-profile"):
        load_job_policy("genserve", job_profiles=["no-such-profile"])
