"""OpenAI's Images and Videos API on the live platform, driven by the official ``openai`` SDK (real
processes: ASGI server, Celery worker + beat, a local `tiny` worker that runs the jobs).

Order matters inside this module (one platform, started once): the images wait for the worker the
first test sees ready.
"""

from __future__ import annotations

import base64
import io
import time

import av
import httpx
import openai
import pytest
from django.core.management import call_command
from PIL import Image
from rest_framework.authtoken.models import Token

from contracts.catalog import PRESETS
from gpu.models import GpuWorker
from sessions.models import Job
from tests.e2e.conftest import Platform, wait_for
from tests.factories import UserFactory

pytestmark = [pytest.mark.e2e, pytest.mark.slow, pytest.mark.django_db]


@pytest.fixture(scope="module")
def served(django_db_setup, django_db_blocker, tmp_path_factory):
    """The platform with one worker, and an API token of a user."""
    from scheduling.models import SchedulerConfig
    from scheduling.services import beat_schedule_install

    with django_db_blocker.unblock():
        call_command("flush", "--noinput", verbosity=0)
        beat_schedule_install(tick_s=1)
        SchedulerConfig.objects.update_or_create(pk=1, defaults={"min_gpus": 1, "max_gpus": 1})
        # The first image may wait for the worker's start on a loaded machine.
        platform = Platform(
            tmp_path_factory.mktemp("openai-platform"), env={"OPENAI_IMAGES_TIMEOUT_S": "240"}
        )
        platform.start()
        try:
            yield platform, Token.objects.create(user=UserFactory()).key
        finally:
            platform.stop()
            call_command("flush", "--noinput", verbosity=0)


@pytest.fixture(scope="module")
def client(served) -> openai.OpenAI:
    platform, token = served
    return openai.OpenAI(base_url=f"{platform.url}/v1", api_key=token, max_retries=0, timeout=300)


def test_models_list_the_served_presets(client, served):
    models = client.models.list()
    assert [model.id for model in models.data] == ["tiny"]  # SERVED_MODELS of the suite
    assert models.data[0].model_extra["capabilities"] == {"streaming": True, "image": True, "video": True}
    wait_for(
        lambda: GpuWorker.objects.filter(status=GpuWorker.Status.READY).exists(),
        180,
        message=f"a ready worker\n{served[0].logs()}",
    )


def test_images_generate_returns_the_images_the_worker_made(client, served):
    result = client.images.generate(model="tiny", prompt="a lighthouse at dusk", n=2, size="64x64")
    assert len(result.data) == 2, served[0].logs()
    for item in result.data:
        image = Image.open(io.BytesIO(base64.b64decode(item.b64_json)))
        assert (image.format, image.size) == ("PNG", (64, 64))
    by_url = client.images.generate(model="tiny", prompt="a fox", response_format="url")
    (item,) = by_url.data
    png = httpx.get(item.url, headers={"Authorization": f"Bearer {client.api_key}"}, timeout=30)
    assert (png.status_code, png.headers["content-type"]) == (200, "image/png")
    assert Image.open(io.BytesIO(png.content)).size == (64, 64)
    assert Job.objects.filter(kind="image", state="done").count() == 3


def test_a_video_is_created_polled_to_completion_and_downloaded(client, served):
    video = client.videos.create(model="tiny", prompt="waves breaking on a rock", seconds="4", size="64x64")
    assert (video.status, video.seconds, video.size) == ("queued", "4", "64x64")
    seen = [video.status]
    deadline = time.monotonic() + 240
    while video.status not in ("completed", "failed") and time.monotonic() < deadline:
        time.sleep(0.2)
        video = client.videos.retrieve(video.id)
        if video.status != seen[-1]:
            seen.append(video.status)
    assert video.status == "completed", (video, served[0].logs())
    assert seen[0] == "queued" and seen[-1] == "completed"
    assert video.progress == 100 and video.completed_at >= video.created_at
    mp4 = client.videos.download_content(video.id, variant="video")
    assert mp4.response.headers["content-type"] == "video/mp4"
    with av.open(io.BytesIO(mp4.content)) as container:
        frames = [frame.to_ndarray(format="rgb24") for frame in container.decode(video=0)]
    # 4 s at the model's 8 fps (docs/openai.md: seconds × fps in whole latent frames).
    assert len(frames) == 4 * PRESETS["tiny"].fps == 32
    assert frames[0].shape == (64, 64, 3)
    assert video.id in [listed.id for listed in client.videos.list()]


def test_an_unsupported_size_is_a_bad_request_naming_size(client):
    with pytest.raises(openai.BadRequestError) as refused:
        client.videos.create(model="tiny", prompt="a fox", size="1280x720")
    assert refused.value.param == "size"
    assert "supported: 64x64" in refused.value.message


def test_deleting_a_video_in_flight_cancels_its_job(client, served):
    video = client.videos.create(model="tiny", prompt="a sunset", seconds="4")
    deleted = client.videos.delete(video.id)
    assert deleted.deleted and deleted.id == video.id
    with pytest.raises(openai.NotFoundError):
        client.videos.retrieve(video.id)
    job = Job.objects.get(pk=video.id)
    assert job.state == "cancelled" and job.deleted_at is not None
    assert video.id not in [listed.id for listed in client.videos.list()]
