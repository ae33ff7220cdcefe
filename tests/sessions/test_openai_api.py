"""OpenAI's Images and Videos API over the jobs (sessions/openai/), in process: the official ``openai``
SDK through a WSGI transport where the client's encoding matters (multipart videos, errors), DRF's
test client elsewhere. A test plays the worker (assign, then report) where a job must progress; the
live path with real workers is tests/e2e/test_openai_live.py."""

from __future__ import annotations

import base64
import io
from decimal import Decimal
from uuid import uuid4

import httpx
import openai
import pytest
from django.contrib.auth import get_user_model
from django.core.cache import cache
from django.core.exceptions import ValidationError
from django.core.files.base import ContentFile
from django.core.signals import request_finished, request_started
from django.core.wsgi import get_wsgi_application
from django.db import close_old_connections
from django.utils import timezone
from PIL import Image
from rest_framework.authtoken.models import Token
from rest_framework.test import APIClient
from rest_framework.throttling import UserRateThrottle

from contracts.catalog import PRESETS
from controlplane.wsauth import _token_from
from sessions import jobs
from sessions.models import Job
from sessions.openai import services
from sessions.openai.auth import LOCAL_USERNAME
from tests.factories import GpuWorkerFactory, JobFactory

pytestmark = pytest.mark.django_db

WSGI = get_wsgi_application()


def png_bytes(color=(200, 40, 40)) -> bytes:
    buffer = io.BytesIO()
    Image.new("RGB", (64, 64), color).save(buffer, format="PNG")
    return buffer.getvalue()


@pytest.fixture
def media(settings, tmp_path):
    settings.MEDIA_ROOT = tmp_path
    return tmp_path


@pytest.fixture
def token(user) -> str:
    return Token.objects.create(user=user).key


@pytest.fixture
def bearer(token) -> APIClient:
    client = APIClient()
    client.credentials(HTTP_AUTHORIZATION=f"Bearer {token}")
    return client


def in_this_transaction(environ, start_response):
    """Django's WSGI application, as Django's test client calls it: neither the request's start nor
    its end (the response's close) may close the test's connection, whose transaction is rolled back
    after the test."""
    request_started.disconnect(close_old_connections)
    request_finished.disconnect(close_old_connections)
    try:
        response = WSGI(environ, start_response)
        try:
            return [b"".join(response)]
        finally:
            response.close()
    finally:
        request_started.connect(close_old_connections)
        request_finished.connect(close_old_connections)


@pytest.fixture
def sdk(token):
    """The official client, calling the application in this process (and this transaction)."""

    def client(api_key: str = token) -> openai.OpenAI:
        http = httpx.Client(transport=httpx.WSGITransport(app=in_this_transaction))
        return openai.OpenAI(
            base_url="http://testserver/v1", api_key=api_key, http_client=http, max_retries=0
        )

    return client


def run_as_worker(job: Job, *, done: bool = True, content: bytes = b"mp4-bytes") -> Job:
    """What the dispatcher and a worker do: assign, then report the result or the failure."""
    worker = GpuWorkerFactory()
    assert jobs.job_assign(job=job, worker=worker)
    if done:
        content_type = "image/png" if job.kind == Job.Kind.IMAGE else "video/mp4"
        extension = content_type.split("/")[1]
        jobs.job_completed(
            str(job.pk), job.epoch, worker.name, content=content, content_type=content_type, extension=extension,
            run_s=0.5,
        )  # fmt: skip
    else:
        jobs.job_failed(str(job.pk), job.epoch, worker.name, reason="the worker ran out of memory")
    return Job.objects.get(pk=job.pk)


def assert_openai_error(response, status: int, *, param=None, code=None) -> dict:
    assert response.status_code == status, response.content
    body = response.json()
    assert set(body) == {"error"}
    assert set(body["error"]) == {"message", "type", "param", "code"}
    assert body["error"]["message"]
    assert body["error"]["param"] == param
    if code is not None:
        assert body["error"]["code"] == code
    return body["error"]


# --- mapping ------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("model", "seconds", "frames"),
    [
        ("tiny", "4", 32),  # 8 fps
        ("tiny", "4.1", 32),  # 32.8 frames: 16.4 latent frames of 2 → 16
        ("tiny", "3.9", 32),  # 31.2 frames: 15.6 → 16 latent frames
        ("tiny", "0.25", 2),
        ("demo", "1.5", 12),  # 8 fps, frame by frame
        ("small", "2", 32),  # 16 fps, latent frames of 4
    ],
)
def test_seconds_are_frames_at_the_models_fps_in_whole_latent_frames(model, seconds, frames):
    assert services.seconds_to_frames(PRESETS[model], Decimal(seconds)) == frames


@pytest.mark.parametrize("seconds", ["0.1", "4.2", "8", "100"])
def test_seconds_beyond_the_frame_bounds_name_the_range_in_seconds(seconds):
    with pytest.raises(ValidationError) as caught:
        services.seconds_to_frames(PRESETS["tiny"], Decimal(seconds))
    assert caught.value.message_dict == {
        "seconds": [f"tiny makes videos of 0.25 to 4 seconds (8 fps, in steps of 0.25 s); got {seconds}"]
    }


@pytest.mark.parametrize("name", ["tiny", "small", "demo"])
def test_the_catalogues_video_bounds_are_the_runtimes(name):
    # What the control plane refuses is what a worker would refuse (it would refuse at every dispatch).
    from workers.runtime.models import build_model
    from workers.runtime.models.base import JobSpecError

    preset = PRESETS[name]
    width, height = map(int, preset.default_resolution.split("x"))
    model = build_model(name)
    low, high = services.frames_bounds(preset)
    for frames in (low, high):
        model.check_job(kind="video", width=width, height=height, frames=frames, steps=4)
    for frames in (high + preset.job_frame_unit, low + 1 if preset.job_frame_unit > 1 else None):
        if frames is not None:
            with pytest.raises(JobSpecError):
                model.check_job(kind="video", width=width, height=height, frames=frames, steps=4)


def test_every_model_class_of_the_catalogue_has_a_one_shot_mode():
    # What GET /v1/models says of every preset (capabilities image and video).
    from workers.runtime.models import model_class
    from workers.runtime.models.base import StreamingVideoModel

    for preset in PRESETS.values():
        assert model_class(preset.name).check_job is not StreamingVideoModel.check_job, preset.name


# --- models -------------------------------------------------------------------------------------------


def test_models_lists_the_served_presets_with_what_they_make(sdk, settings):
    settings.STREAMSERVE = {**settings.STREAMSERVE, "SERVED_MODELS": ["tiny", "demo"]}
    models = sdk().models.list()
    assert [m.id for m in models.data] == ["tiny", "demo"]
    tiny = models.data[0]
    assert (tiny.object, tiny.owned_by) == ("model", "streamserve")
    extra = tiny.model_extra
    assert extra["capabilities"] == {"streaming": True, "image": True, "video": True}
    assert (extra["sizes"], extra["default_size"], extra["fps"]) == (["64x64"], "64x64", 8)
    assert extra["video_seconds"] == [0.25, 4]
    assert sdk().models.retrieve("demo").id == "demo"
    with pytest.raises(openai.NotFoundError) as missing:
        sdk().models.retrieve("small")  # in the catalogue, not served here
    assert missing.value.code == "model_not_found"


# --- videos -------------------------------------------------------------------------------------------


def test_a_video_is_a_video_job_of_seconds_times_fps_frames(sdk, user):
    video = sdk().videos.create(model="tiny", prompt="a lighthouse in a storm", seconds="4", size="64x64")
    assert (video.object, video.status, video.progress, video.model) == ("video", "queued", 0, "tiny")
    assert (video.seconds, video.size, video.prompt) == ("4", "64x64", "a lighthouse in a storm")
    assert video.completed_at is None and video.error is None
    job = Job.objects.get(pk=video.id)
    assert (job.owner, job.kind, job.frames, job.width, job.height) == (user, "video", 32, 64, 64)
    assert job.steps == 4  # the model's denoising steps
    assert abs(video.created_at - job.submitted_at.timestamp()) < 1


def test_a_video_takes_json_too_with_the_models_defaults(bearer):
    response = bearer.post("/v1/videos", {"prompt": "waves", "model": "tiny", "seconds": 2}, format="json")
    assert response.status_code == 200, response.content
    assert (response.json()["seconds"], response.json()["size"]) == ("2", "64x64")
    defaults = bearer.post("/v1/videos", {"prompt": "waves"}, format="json").json()
    assert (defaults["model"], defaults["seconds"]) == ("tiny", "4")  # SERVED_MODELS=tiny; 4 s


def test_an_unsupported_size_is_a_bad_request_naming_size_and_the_accepted_ones(sdk):
    with pytest.raises(openai.BadRequestError) as refused:
        sdk().videos.create(model="tiny", prompt="a fox", size="1280x720")
    assert refused.value.status_code == 400
    assert refused.value.param == "size"
    assert refused.value.code == "invalid_value"
    assert "supported: 64x64" in refused.value.message
    assert refused.value.body["type"] == "invalid_request_error"
    assert not Job.objects.exists()


@pytest.mark.parametrize(
    ("body", "param", "code", "says"),
    [
        ({"model": "tiny"}, "prompt", "missing_required_parameter", "required"),
        ({"prompt": "  "}, "prompt", "invalid_value", "must not be empty"),
        ({"prompt": "a fox", "model": "sora-2"}, "model", "invalid_value", "not a valid choice"),
        ({"prompt": "a fox", "seconds": "forever"}, "seconds", "invalid_value", "positive number"),
        ({"prompt": "a fox", "seconds": "-4"}, "seconds", "invalid_value", "positive number"),
        ({"prompt": "a fox", "seconds": "8"}, "seconds", "invalid_value", "0.25 to 4 seconds"),
        ({"prompt": "a fox", "seconds": True}, "seconds", "invalid_value", "a number of seconds"),
        ({"prompt": "a fox", "size": "wide"}, "size", "invalid_value", "WIDTHxHEIGHT"),
        (
            {"prompt": "a fox", "input_reference": "x"},
            "input_reference",
            "unsupported_parameter",
            "text to video",
        ),
    ],
)
def test_bad_video_requests_are_openai_errors_naming_the_param(bearer, body, param, code, says):
    error = assert_openai_error(bearer.post("/v1/videos", body, format="json"), 400, param=param, code=code)
    assert says in error["message"], error
    assert not Job.objects.exists()


def test_the_model_must_be_served(bearer, settings):
    settings.STREAMSERVE = {**settings.STREAMSERVE, "SERVED_MODELS": ["tiny"]}
    error = assert_openai_error(
        bearer.post("/v1/videos", {"prompt": "x", "model": "demo"}), 400, param="model"
    )
    assert "served: tiny" in error["message"]


def test_retrieve_maps_the_job_states_and_progress(sdk, user):
    job = JobFactory(owner=user, kind="video", frames=32, steps=4)
    client = sdk()
    assert client.videos.retrieve(str(job.pk)).status == "queued"
    worker = GpuWorkerFactory()
    jobs.job_assign(job=job, worker=worker)
    jobs.job_progress(str(job.pk), job.epoch, worker.name, state="running", step=1, steps=4)
    running = client.videos.retrieve(str(job.pk))
    assert (running.status, running.progress) == ("in_progress", 25)
    jobs.job_pause(job=Job.objects.get(pk=job.pk))
    assert client.videos.retrieve(str(job.pk)).status == "in_progress"  # paused for a stream: still going
    jobs.job_failed(str(job.pk), job.epoch, worker.name, reason="decoder exploded")
    failed = client.videos.retrieve(str(job.pk))
    assert failed.status == "failed"
    assert (failed.error.code, failed.error.message) == ("generation_failed", "decoder exploded")
    assert failed.completed_at is not None


def test_a_completed_video_streams_its_mp4_and_an_unfinished_one_is_a_conflict(sdk, bearer, user, media):
    job = JobFactory(owner=user, kind="video", frames=32)
    not_yet = bearer.get(f"/v1/videos/{job.pk}/content")
    assert_openai_error(not_yet, 409, code="video_not_ready")
    assert not_yet["x-should-retry"] == "false"  # the SDK would otherwise retry a 409 at once
    run_as_worker(job, content=b"\x00\x00\x00\x18ftypmp42")
    video = sdk().videos.retrieve(str(job.pk))
    assert (video.status, video.progress) == ("completed", 100)
    content = sdk().videos.download_content(str(job.pk), variant="video")
    assert content.content == b"\x00\x00\x00\x18ftypmp42"
    assert content.response.headers["content-type"] == "video/mp4"
    assert_openai_error(bearer.get(f"/v1/videos/{job.pk}/content?variant=thumbnail"), 400, param="variant")


def test_a_failed_videos_content_is_a_conflict_saying_so(bearer, user):
    job = run_as_worker(JobFactory(owner=user, kind="video", frames=32), done=False)
    assert_openai_error(bearer.get(f"/v1/videos/{job.pk}/content"), 409, code="video_failed")


def test_videos_are_their_owners_only(bearer, other_user, user):
    theirs = JobFactory(owner=other_user, kind="video", frames=32)
    image = JobFactory(owner=user, kind="image")
    for path in (f"/v1/videos/{theirs.pk}", f"/v1/videos/{theirs.pk}/content", f"/v1/videos/{image.pk}"):
        assert_openai_error(bearer.get(path), 404, param="id", code="not_found")
    assert_openai_error(bearer.delete(f"/v1/videos/{theirs.pk}"), 404, param="id")
    assert Job.objects.get(pk=theirs.pk).deleted_at is None
    assert bearer.get("/v1/videos").json()["data"] == []


def test_the_list_pages_by_creation_time_with_openais_cursor(sdk, bearer, user):
    now = timezone.now()
    videos = [
        JobFactory(owner=user, kind="video", frames=32, submitted_at=now - timezone.timedelta(seconds=10 - i))
        for i in range(5)
    ]
    JobFactory(owner=user, kind="image")  # not a video
    newest = [str(v.pk) for v in reversed(videos)]
    page = bearer.get("/v1/videos?limit=2").json()
    assert page["object"] == "list"
    assert [v["id"] for v in page["data"]] == newest[:2]
    assert (page["first_id"], page["last_id"], page["has_more"]) == (newest[0], newest[1], True)
    second = bearer.get(f"/v1/videos?limit=2&after={page['last_id']}").json()
    assert [v["id"] for v in second["data"]] == newest[2:4]
    oldest_first = bearer.get("/v1/videos?order=asc&limit=10").json()
    assert [v["id"] for v in oldest_first["data"]] == newest[::-1] and not oldest_first["has_more"]
    # The SDK follows the cursor through every page.
    assert [v.id for v in sdk().videos.list(limit=2)] == newest
    assert_openai_error(bearer.get(f"/v1/videos?after={uuid4()}"), 400, param="after")
    assert_openai_error(bearer.get("/v1/videos?limit=0"), 400, param="limit")
    assert_openai_error(bearer.get("/v1/videos?order=sideways"), 400, param="order")
    # An empty value is no "leave it to the default" (DRF's reading): the client meant something.
    assert_openai_error(bearer.get("/v1/videos?after="), 400, param="after")
    assert_openai_error(bearer.get("/v1/videos?limit="), 400, param="limit")


def test_an_empty_form_field_is_refused_not_taken_for_the_default(bearer):
    response = bearer.post("/v1/videos", {"prompt": "a fox", "size": ""}, format="multipart")
    assert_openai_error(response, 400, param="size", code="invalid_value")
    assert not Job.objects.exists()


def test_deleting_a_running_video_cancels_it_and_hides_it(
    sdk, bearer, user, django_capture_on_commit_callbacks
):
    job = JobFactory(owner=user, kind="video", frames=32)
    worker = GpuWorkerFactory()
    jobs.job_assign(job=job, worker=worker)
    with django_capture_on_commit_callbacks() as callbacks:
        deleted = sdk().videos.delete(str(job.pk))
    assert (deleted.id, deleted.object, deleted.deleted) == (str(job.pk), "video.deleted", True)
    job.refresh_from_db()
    assert job.state == "cancelled" and job.deleted_at is not None
    assert callbacks  # the cancel's broadcast and the scheduler's job_cancel to the worker, after commit
    assert_openai_error(bearer.get(f"/v1/videos/{job.pk}"), 404, param="id")
    assert_openai_error(bearer.delete(f"/v1/videos/{job.pk}"), 404, param="id")
    assert bearer.get(f"/api/jobs/{job.pk}/").status_code == 404
    assert bearer.get("/api/jobs/").json()["count"] == 0


def test_deleting_a_completed_video_removes_its_mp4_and_keeps_the_row(
    bearer, user, media, django_capture_on_commit_callbacks
):
    job = run_as_worker(JobFactory(owner=user, kind="video", frames=32))
    stored = media / job.result.name
    assert stored.exists()
    with django_capture_on_commit_callbacks(execute=True):
        assert bearer.delete(f"/v1/videos/{job.pk}").json()["deleted"] is True
    assert not stored.exists()
    job.refresh_from_db()
    assert (job.state, job.result.name) == ("done", "")  # the audit still counts a done job
    assert job.deleted_at is not None


# --- images -------------------------------------------------------------------------------------------


@pytest.fixture
def worker_finishes_images(monkeypatch):
    """While the request waits, a worker finishes (or fails) every queued image."""
    outcome = {"done": True, "calls": 0}

    def step(_seconds):
        outcome["calls"] += 1
        for index, job in enumerate(Job.objects.filter(state="queued", kind="image").order_by("seed")):
            run_as_worker(job, done=outcome["done"], content=png_bytes((index * 80, 0, 0)))

    monkeypatch.setattr(services.time, "sleep", step)
    return outcome


def test_images_generate_waits_for_n_image_jobs_and_returns_base64_pngs(
    sdk, user, media, worker_finishes_images
):
    result = sdk().images.generate(
        model="tiny", prompt="a red fox", n=2, size="64x64", extra_body={"seed": 7}
    )
    assert len(result.data) == 2 and result.created > 0
    images = [Image.open(io.BytesIO(base64.b64decode(item.b64_json))) for item in result.data]
    assert [(image.format, image.size) for image in images] == [("PNG", (64, 64))] * 2
    assert [image.getpixel((0, 0))[0] for image in images] == [0, 80]  # in the order of their seeds
    submitted = Job.objects.filter(owner=user, kind="image").order_by("seed")
    assert [(job.seed, job.state) for job in submitted] == [(7, "done"), (8, "done")]
    # The client waits: the deadline is the wait.
    assert all(round((job.deadline - job.submitted_at).total_seconds()) == 120 for job in submitted)


def test_images_as_urls_are_fetched_with_the_same_token(bearer, media, worker_finishes_images):
    response = bearer.post(
        "/v1/images/generations", {"prompt": "a fox", "response_format": "url", "size": "auto"}, format="json"
    )
    assert response.status_code == 200, response.content
    (item,) = response.json()["data"]
    assert item["url"].startswith("http://testserver/v1/images/") and "b64_json" not in item
    image = bearer.get(item["url"])
    assert (image.status_code, image["Content-Type"]) == (200, "image/png")
    assert b"".join(image.streaming_content).startswith(b"\x89PNG")
    assert_openai_error(APIClient().get(item["url"]), 401, code="missing_api_key")


def test_images_not_ready_in_time_are_cancelled_and_a_504_not_retried(bearer, user, settings, monkeypatch):
    settings.STREAMSERVE = {**settings.STREAMSERVE, "OPENAI_IMAGES_TIMEOUT_S": 0.05}
    response = bearer.post("/v1/images/generations", {"prompt": "a fox", "n": 3}, format="json")
    assert_openai_error(response, 504, code="timeout")
    assert response["x-should-retry"] == "false"
    assert response.json()["error"]["type"] == "server_error"
    assert list(Job.objects.filter(owner=user).values_list("state", flat=True)) == ["cancelled"] * 3


def test_a_failed_image_is_a_500_not_retried(bearer, worker_finishes_images):
    worker_finishes_images["done"] = False
    response = bearer.post("/v1/images/generations", {"prompt": "a fox", "n": 2}, format="json")
    error = assert_openai_error(response, 500, code="generation_failed")
    assert "ran out of memory" in error["message"] and response["x-should-retry"] == "false"


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"prompt": "a fox", "n": 11}, "n"),
        ({"prompt": "a fox", "n": 0}, "n"),
        ({"prompt": "a fox", "size": "1024x1024"}, "size"),
        ({"prompt": "a fox", "response_format": "jpeg"}, "response_format"),
        ({"prompt": "a fox", "output_format": "webp"}, "output_format"),
        ({"prompt": "a fox", "stream": True}, "stream"),
        ({"n": 1}, "prompt"),
    ],
)
def test_bad_image_requests_are_openai_errors_naming_the_param(bearer, body, param):
    assert_openai_error(bearer.post("/v1/images/generations", body, format="json"), 400, param=param)
    assert not Job.objects.exists()


def test_n_images_pass_the_in_flight_limit_together_or_not_at_all(bearer, user, settings):
    settings.STREAMSERVE = {**settings.STREAMSERVE, "MAX_JOBS_IN_FLIGHT_PER_USER": 3}
    JobFactory(owner=user, kind="video", frames=32)
    response = bearer.post("/v1/images/generations", {"prompt": "a fox", "n": 3}, format="json")
    error = assert_openai_error(response, 429, code="too_many_jobs_in_flight")
    assert "the limit is 3" in error["message"] and error["type"] == "rate_limit_error"
    assert Job.objects.filter(owner=user).count() == 1  # none of the three
    one_more = bearer.post("/v1/videos", {"prompt": "a fox"}, format="json")
    assert one_more.status_code == 200  # 1 of 3 in flight: one more fits


# --- authentication, throttling, routes ----------------------------------------------------------------


def test_without_a_token_it_is_a_401_asking_for_a_bearer_token(sdk, api):
    response = api.get("/v1/models")
    assert_openai_error(response, 401, code="missing_api_key")
    assert response["WWW-Authenticate"].startswith("Bearer")
    assert response.json()["error"]["type"] == "authentication_error"
    with pytest.raises(openai.AuthenticationError) as refused:
        sdk("not-a-token").videos.list()
    assert refused.value.code == "invalid_api_key"


def test_the_same_tokens_work_as_token_or_bearer_on_both_apis(api, token):
    for header in (f"Bearer {token}", f"Token {token}"):
        api.credentials(HTTP_AUTHORIZATION=header)
        assert api.get("/v1/models").status_code == 200, header
        assert api.get("/api/jobs/").status_code == 200, header


def test_the_sockets_take_a_bearer_token_too():
    def scope(authorization: bytes) -> dict:
        return {"type": "websocket", "headers": [(b"authorization", authorization)]}

    assert _token_from(scope(b"Bearer k3y")) == "k3y"
    assert _token_from(scope(b"Token k3y")) == "k3y"
    assert _token_from(scope(b"Basic k3y")) is None


def test_anonymous_mode_acts_as_the_local_user_and_a_token_still_as_its_own(sdk, api, token, user, settings):
    assert_openai_error(api.post("/v1/videos", {"prompt": "x"}), 401)
    settings.STREAMSERVE = {**settings.STREAMSERVE, "OPENAI_API_ANONYMOUS": True}
    assert api.post("/v1/videos", {"prompt": "a fox"}, format="json").status_code == 200
    local = get_user_model().objects.get(username=LOCAL_USERNAME)
    assert not local.has_usable_password() and not local.is_staff
    # The SDK needs some key: one that is no token is the local user too.
    video = sdk("local").videos.create(prompt="a hen")
    assert Job.objects.get(pk=video.id).owner == local
    assert sdk(token).videos.create(prompt="a cat") and Job.objects.filter(owner=user).count() == 1
    assert [v.prompt for v in sdk("anything").videos.list()] == ["a hen", "a fox"]


def test_requests_are_throttled_per_user_in_openais_shape(bearer, settings, monkeypatch):
    cache.clear()
    monkeypatch.setattr(UserRateThrottle, "THROTTLE_RATES", {"user": "2/minute", "anon": "2/minute"})
    try:
        codes = [bearer.get("/v1/models").status_code for _ in range(2)]
        throttled = bearer.get("/v1/models")
    finally:
        cache.clear()
    assert codes == [200, 200]
    assert_openai_error(throttled, 429, code="rate_limit_exceeded")
    assert int(throttled["Retry-After"]) > 0


def test_other_routes_and_methods_are_openai_errors_too(bearer):
    assert_openai_error(bearer.post("/v1/chat/completions", {}, format="json"), 404, code="not_found")
    assert_openai_error(bearer.put("/v1/models", {}, format="json"), 405, code="method_not_allowed")
    assert_openai_error(bearer.get("/v1/videos/not-a-uuid"), 404)
    assert_openai_error(bearer.get("/v1/videos/K%C3%84%06H%3F%0A%C2%84"), 404)  # a newline in the path
    unsupported = bearer.post("/v1/images/generations", "prompt=x", content_type="text/plain")
    assert_openai_error(unsupported, 415, code="unsupported_media_type")


def test_an_unexpected_error_is_a_logged_500_in_openais_shape(bearer, monkeypatch, caplog):
    def broken(*args, **kwargs):
        raise RuntimeError("boom")

    monkeypatch.setattr(services, "video_submit", broken)
    error = assert_openai_error(bearer.post("/v1/videos", {"prompt": "x"}, format="json"), 500)
    assert error["type"] == "server_error" and "boom" not in error["message"]
    assert "openai.unhandled" in caplog.text


def test_a_deleted_result_is_not_served_to_staff_either(staff_api, user, media):
    job = JobFactory(owner=user, kind="image")
    job.result.save("x.png", ContentFile(png_bytes()), save=False)
    job.state, job.finished_at, job.result_content_type = "done", timezone.now(), "image/png"
    job.worker = GpuWorkerFactory()
    job.save()
    jobs.job_delete(job=job)
    assert staff_api.get(f"/api/jobs/{job.pk}/result/").status_code == 404
    assert staff_api.get(f"/api/jobs/{job.pk}/").status_code == 404
