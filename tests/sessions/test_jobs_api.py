"""The jobs API: submission with per-field validation, ownership, cancel, the in-flight limit, the
result download through the default storage, and the staff audit."""

from __future__ import annotations

from datetime import timedelta

import pytest
from django.core.files.base import ContentFile
from django.utils import timezone

from sessions.models import Job
from tests.factories import GpuWorkerFactory, JobFactory

pytestmark = pytest.mark.django_db


def submit(client, **overrides):
    body = {
        "kind": "image",
        "prompt": "a lighthouse at dusk",
        "model": "tiny",
        "resolution": "64x64",
        **overrides,
    }
    body = {k: v for k, v in body.items() if v is not None}
    return client.post("/api/jobs/", body, format="json")


def test_submit_queues_an_image_job_with_its_position_and_deadline(user_api, user):
    before = timezone.now()
    response = submit(user_api, seed=7, steps=3, slo_s=30)
    assert response.status_code == 201, response.content
    body = response.json()
    assert (body["state"], body["position"], body["frames"], body["steps"]) == ("queued", 1, 1, 3)
    assert (body["width"], body["height"], body["seed"], body["epoch"]) == (64, 64, 7, 0)
    job = Job.objects.get(pk=body["id"])
    assert job.owner == user
    assert timedelta(seconds=29) < job.deadline - before < timedelta(seconds=31)
    second = submit(user_api, kind="video", frames=8).json()
    assert second["position"] == 2  # same priority, later deadline (the default SLO is longer)
    assert second["steps"] == 4  # the tiny preset's denoising steps


def test_priority_puts_a_job_ahead_in_the_queue(user_api):
    first = submit(user_api, slo_s=10).json()
    urgent = submit(user_api, slo_s=100, priority=5).json()
    assert urgent["position"] == 1
    assert user_api.get(f"/api/jobs/{first['id']}/").json()["position"] == 2


@pytest.mark.parametrize(
    ("overrides", "field", "reason"),
    [
        ({"kind": "audio"}, "kind", "not a valid choice"),
        ({"model": "sora-9"}, "model", "not a valid choice"),
        ({"model": "demo"}, "model", "not served"),
        ({"resolution": "1920x1080"}, "resolution", "not supported by tiny"),
        ({"resolution": "wide"}, "resolution", "WIDTHxHEIGHT"),
        ({"kind": "video"}, "frames", "a video needs frames"),
        ({"kind": "video", "frames": 1}, "frames", "between 2 and"),
        ({"kind": "video", "frames": 10_000}, "frames", "less than or equal to"),
        # The model's own bounds (the catalogue's): a worker would refuse the job at every dispatch.
        ({"kind": "video", "frames": 7}, "frames", "a multiple of 2 for tiny"),
        ({"kind": "video", "frames": 64}, "frames", "at most 32 for tiny"),
        ({"frames": 4}, "frames", "an image is one frame"),
        ({"steps": 0}, "steps", "greater than or equal to 1"),
        ({"steps": 101}, "steps", "less than or equal to 100"),
        ({"prompt": "   "}, "prompt", "must not be empty"),
        # The schema's maxLength counts the text as sent, surrounding whitespace included.
        ({"prompt": "\v" + "x" * 2000}, "prompt", "at most 2000 characters (got 2001)"),
        ({"seed": -1}, "seed", "greater than or equal to 0"),
        ({"priority": 10}, "priority", "less than or equal to 9"),
        ({"slo_s": 0}, "slo_s", "greater than or equal to"),
        ({"deadline": "2020-01-01T00:00:00Z"}, "deadline", "in the past"),
        ({"slo_s": 30, "deadline": "2999-01-01T00:00:00Z"}, "deadline", "not both"),
    ],
)
def test_bad_input_is_a_400_naming_the_field(user_api, overrides, field, reason):
    response = submit(user_api, **overrides)
    assert response.status_code == 400, response.content
    errors = response.json()
    assert field in errors, errors
    assert reason in str(errors[field])
    assert not Job.objects.exists()


def test_a_future_deadline_is_accepted_as_given(user_api):
    deadline = timezone.now() + timedelta(minutes=5)
    body = submit(user_api, deadline=deadline.isoformat()).json()
    assert body["slo_s"] is None
    assert Job.objects.get(pk=body["id"]).deadline == deadline


def test_owners_see_only_their_jobs_and_others_get_404(user_api, other_user, staff_api):
    mine = submit(user_api).json()
    theirs = JobFactory(owner=other_user)
    listed = user_api.get("/api/jobs/").json()["results"]
    assert [j["id"] for j in listed] == [mine["id"]]
    for url in (
        f"/api/jobs/{theirs.pk}/",
        f"/api/jobs/{theirs.pk}/cancel/",
        f"/api/jobs/{theirs.pk}/result/",
    ):
        method = user_api.post if url.endswith("cancel/") else user_api.get
        assert method(url).status_code == 404, url
    assert Job.objects.get(pk=theirs.pk).state == "queued"
    assert {j["id"] for j in staff_api.get("/api/jobs/").json()["results"]} == {mine["id"], str(theirs.pk)}


def test_list_filters_by_state_and_kind(user_api, user):
    JobFactory(owner=user, kind="video", frames=8)
    JobFactory(owner=user, state="cancelled", finished_at=timezone.now())
    assert [j["kind"] for j in user_api.get("/api/jobs/?kind=video").json()["results"]] == ["video"]
    assert [j["state"] for j in user_api.get("/api/jobs/?state=cancelled").json()["results"]] == ["cancelled"]
    assert user_api.get("/api/jobs/?state=lost").status_code == 400
    queued = JobFactory(owner=user)
    assert user_api.get(f"/api/jobs/{queued.pk}/?state=cancelled").status_code == 200  # list filters only


def test_cancel_ends_a_queued_job_and_is_idempotent(user_api):
    job = submit(user_api).json()
    response = user_api.post(f"/api/jobs/{job['id']}/cancel/")
    assert response.status_code == 200
    assert response.json()["state"] == "cancelled"
    finished = response.json()["finished_at"]
    again = user_api.post(f"/api/jobs/{job['id']}/cancel/").json()
    assert (again["state"], again["finished_at"]) == ("cancelled", finished)


def test_jobs_in_flight_are_limited_per_user(user_api, settings):
    settings.STREAMSERVE = {**settings.STREAMSERVE, "MAX_JOBS_IN_FLIGHT_PER_USER": 2}
    first = submit(user_api).json()
    submit(user_api)
    refused = submit(user_api)
    assert refused.status_code == 429
    assert "2 jobs in flight" in refused.json()["detail"]
    user_api.post(f"/api/jobs/{first['id']}/cancel/")  # an ended job no longer counts
    assert submit(user_api).status_code == 201


def test_the_result_is_served_through_the_storage_only_once_done(user_api, user, tmp_path, settings):
    settings.MEDIA_ROOT = tmp_path
    job = JobFactory(owner=user)
    assert user_api.get(f"/api/jobs/{job.pk}/result/").status_code == 404
    job.result.save("x.png", ContentFile(b"\x89PNG-bytes"), save=False)
    job.state, job.finished_at, job.result_content_type = "done", timezone.now(), "image/png"
    job.worker = GpuWorkerFactory()
    job.save()
    response = user_api.get(f"/api/jobs/{job.pk}/result/")
    assert response.status_code == 200
    assert response["Content-Type"] == "image/png"
    assert b"".join(response.streaming_content) == b"\x89PNG-bytes"
    assert user_api.get(f"/api/jobs/{job.pk}/").json()["result_url"] == f"/api/jobs/{job.pk}/result/"
    assert (tmp_path / job.result.name).exists()
    Job.objects.filter(pk=job.pk).update(result_content_type="text/html")
    download = user_api.get(f"/api/jobs/{job.pk}/result/")
    assert download["Content-Type"] == "application/octet-stream"
    assert download["Content-Disposition"].startswith("attachment")


def test_job_audit_buckets_latency_and_slo_attainment_as_json_and_csv(staff_api, user_api, user):
    now = timezone.now()
    for latency_s, slo_s, state in [(10, 30, "done"), (50, 30, "done"), (5, 30, "failed")]:
        JobFactory(
            owner=user,
            state=state,
            submitted_at=now - timedelta(seconds=latency_s + 60),
            started_at=now - timedelta(seconds=latency_s + 59),
            finished_at=now - timedelta(seconds=60),
            deadline=now - timedelta(seconds=latency_s + 60 - slo_s),
            result="jobs/x.png" if state == "done" else "",
        )
    assert user_api.get("/api/audit/jobs/").status_code == 403
    report = staff_api.get("/api/audit/jobs/").json()
    assert report["totals"] == {"count": 3, "slo_met": 1, "slo_attainment": pytest.approx(1 / 3)}
    (bucket,) = report["buckets"]
    assert bucket["done"] == 2
    assert bucket["latency_max_s"] == pytest.approx(50, abs=0.01)
    assert bucket["latency_p50_s"] == pytest.approx(30, abs=0.01)
    assert bucket["wait_p50_s"] == pytest.approx(1, abs=0.01)
    csv = staff_api.get("/api/audit/jobs/?format=csv")
    assert csv["Content-Type"].startswith("text/csv")
    lines = csv.content.decode().splitlines()
    assert lines[0].startswith("bucket_start,count,done,slo_met,slo_attainment")
    assert lines[1].split(",")[1:4] == ["3", "2", "1"]
    assert staff_api.get("/api/audit/jobs/?kind=audio").status_code == 400
