"""OpenAI's request bodies (field types only: the rules are ``services``' and the jobs system's) and
its objects, rendered from jobs and presets; the schema (drf-spectacular) reads both."""

from __future__ import annotations

import time

from django.conf import settings
from drf_spectacular.utils import extend_schema_field
from rest_framework import serializers
from rest_framework.utils import html

from contracts.catalog import PRESETS, ModelPreset
from contracts.catalog.presets import DEFAULT_PRESET
from contracts.http.api import StrictCharField
from sessions.models import Job
from sessions.openai import services
from sessions.serializers import SERVED_RESOLUTIONS, PromptField, ServedModelField

# OpenAI's `created` of a model; the presets have no date of their own, so (as vLLM does) the time
# this process started serving them.
SERVING_SINCE = int(time.time())
# OpenAI's `n`: dall-e-2 takes 1 to 10 images per request.
MAX_IMAGES = 10
# `GET /v1/videos`: OpenAI's page sizes.
DEFAULT_PAGE, MAX_PAGE = 20, 100
SECONDS_PATTERN = r"^\s*[0-9]{1,6}(\.[0-9]{1,6})?\s*$"
# `Job.State` → OpenAI's video status.
VIDEO_STATUS = {
    Job.State.QUEUED: "queued",
    Job.State.RUNNING: "in_progress",
    Job.State.PAUSED: "in_progress",
    Job.State.DONE: "completed",
    Job.State.FAILED: "failed",
    Job.State.CANCELLED: "failed",
}


def _unix(moment) -> int | None:
    return None if moment is None else int(moment.timestamp())


def default_model() -> str:
    """As for sessions and ``/api/jobs/``: the default preset, or the first served when it is not."""
    served = settings.STREAMSERVE["SERVED_MODELS"]
    return DEFAULT_PRESET if DEFAULT_PRESET in served or not served else served[0]


# --- requests ------------------------------------------------------------------------------------------


class NoEmptyValues(serializers.Serializer):
    """A field sent empty is a 400 naming it. DRF reads an empty form or query value as "not given"
    (the default) or as null: a client that meant something would silently get something else."""

    def to_internal_value(self, data):
        if html.is_html_input(data):
            empty = [name for name in self.fields if data.get(name) == ""]
            if empty:
                raise serializers.ValidationError(
                    {name: ["must not be empty (leave it out)"] for name in empty}
                )
        return super().to_internal_value(data)


IMAGE_SIZES = [*SERVED_RESOLUTIONS, "auto"]


@extend_schema_field({"type": "string", "enum": IMAGE_SIZES})
class ImageSizeField(StrictCharField):
    """``WIDTHxHEIGHT`` of the model's resolutions, or ``auto`` (the model's default)."""


@extend_schema_field({"type": "string", "enum": SERVED_RESOLUTIONS})
class VideoSizeField(StrictCharField):
    """``WIDTHxHEIGHT`` of the model's resolutions."""


@extend_schema_field(
    {
        "oneOf": [
            {"type": "string", "pattern": SECONDS_PATTERN},
            {"type": "number", "minimum": 0, "exclusiveMinimum": True, "maximum": services.MAX_SECONDS},
        ],
        "description": "the clip's length in seconds (\"4\"), made frames at the model's fps; default 4",
    }
)
class SecondsField(serializers.Field):
    """A string (OpenAI's form, and all a multipart body has) or a JSON number, parsed by
    ``services.parse_seconds``."""

    def to_internal_value(self, data):
        return services.parse_seconds(data)

    def to_representation(self, value):
        return str(value)


class ImageGeneration(NoEmptyValues):
    """``client.images.generate``. OpenAI's other parameters (``quality``, ``style``, ``background``,
    ``moderation``, ``user`` …) are accepted and ignored; ``seed`` is ours."""

    prompt = PromptField(trim_whitespace=False)
    # Any preset is parsed: a known but unserved one gets its own message (the schema lists the served).
    model = ServedModelField(choices=sorted(PRESETS), default=default_model)
    n = serializers.IntegerField(min_value=1, max_value=MAX_IMAGES, default=1, allow_null=True)
    size = ImageSizeField(required=False, allow_null=True, help_text="default: the model's resolution")
    response_format = serializers.ChoiceField(
        choices=["b64_json", "url"], default="b64_json", allow_null=True,
        help_text="b64_json (default) or url: a /v1/images/{id}/content URL fetched with the same token",
    )  # fmt: skip
    output_format = serializers.ChoiceField(choices=["png"], required=False, allow_null=True)
    stream = serializers.BooleanField(required=False, allow_null=True, help_text="false: no streaming")
    seed = serializers.IntegerField(
        required=False, allow_null=True, min_value=0, max_value=2**63 - 1 - MAX_IMAGES,
        help_text="not OpenAI's: the first image's seed (the next ones +1 each); default: random",
    )  # fmt: skip

    def validate_stream(self, value):
        if value:
            raise serializers.ValidationError("streaming partial images is not supported: leave stream out")
        return value


class VideoCreate(NoEmptyValues):
    """``client.videos.create`` (multipart, as the SDK sends it, or JSON). ``input_reference`` is
    refused: text to video only."""

    prompt = PromptField(trim_whitespace=False)
    # Any preset is parsed: a known but unserved one gets its own message (the schema lists the served).
    model = ServedModelField(choices=sorted(PRESETS), default=default_model)
    seconds = SecondsField(required=False, allow_null=True)
    size = VideoSizeField(required=False, allow_null=True, help_text="default: the model's resolution")


class VideoListQuery(NoEmptyValues):
    after = serializers.UUIDField(required=False, help_text="the id of the last video of the previous page")
    limit = serializers.IntegerField(required=False, default=DEFAULT_PAGE, min_value=1, max_value=MAX_PAGE)
    order = serializers.ChoiceField(choices=["asc", "desc"], default="desc", help_text="by creation time")


class VideoContentQuery(NoEmptyValues):
    variant = serializers.ChoiceField(choices=["video"], default="video", help_text="the MP4 (no thumbnail)")


# --- objects -------------------------------------------------------------------------------------------


class VideoErrorSerializer(serializers.Serializer):
    code = serializers.CharField()
    message = serializers.CharField()


class VideoSerializer(serializers.Serializer):
    """OpenAI's ``Video`` of a video job."""

    id = serializers.UUIDField(source="pk")
    object = serializers.SerializerMethodField()
    created_at = serializers.SerializerMethodField()
    completed_at = serializers.SerializerMethodField()
    expires_at = serializers.SerializerMethodField(help_text="null: kept until deleted")
    error = serializers.SerializerMethodField()
    model = serializers.CharField(source="model_name")
    progress = serializers.SerializerMethodField(help_text="denoising steps done, in percent")
    prompt = serializers.CharField()
    seconds = serializers.SerializerMethodField(help_text="frames / the model's fps")
    size = serializers.CharField(source="resolution")
    status = serializers.SerializerMethodField()

    @extend_schema_field({"type": "string", "enum": ["video"]})
    def get_object(self, job: Job) -> str:
        return "video"

    def get_created_at(self, job: Job) -> int:
        return _unix(job.submitted_at)

    @extend_schema_field({"type": "integer", "nullable": True})
    def get_completed_at(self, job: Job) -> int | None:
        return _unix(job.finished_at) if job.state in (Job.State.DONE, Job.State.FAILED) else None

    @extend_schema_field({"type": "integer", "nullable": True})
    def get_expires_at(self, job: Job) -> int | None:
        return None

    @extend_schema_field(VideoErrorSerializer(allow_null=True))
    def get_error(self, job: Job) -> dict | None:
        if job.state == Job.State.FAILED:
            return {"code": "generation_failed", "message": job.error or "the generation failed"}
        if job.state == Job.State.CANCELLED:
            return {"code": "cancelled", "message": "cancelled before it completed"}
        return None

    @extend_schema_field({"type": "integer", "minimum": 0, "maximum": 100})
    def get_progress(self, job: Job) -> int:
        if job.state == Job.State.DONE:
            return 100
        return min(99, 100 * job.steps_done // job.steps) if job.steps else 0

    def get_seconds(self, job: Job) -> str:
        return services.frames_to_seconds(job)

    @extend_schema_field({"type": "string", "enum": ["queued", "in_progress", "completed", "failed"]})
    def get_status(self, job: Job) -> str:
        return VIDEO_STATUS[job.state]


class VideoListSerializer(serializers.Serializer):
    object = serializers.ChoiceField(choices=["list"])
    data = VideoSerializer(many=True)
    first_id = serializers.UUIDField(allow_null=True)
    last_id = serializers.UUIDField(allow_null=True)
    has_more = serializers.BooleanField()


class VideoDeletedSerializer(serializers.Serializer):
    id = serializers.UUIDField()
    object = serializers.ChoiceField(choices=["video.deleted"])
    deleted = serializers.BooleanField()


class ImageDataSerializer(serializers.Serializer):
    b64_json = serializers.CharField(required=False, help_text="the PNG, base64 (response_format b64_json)")
    url = serializers.URLField(required=False, help_text="the PNG's URL (response_format url)")


class ImagesResponseSerializer(serializers.Serializer):
    created = serializers.IntegerField()
    data = ImageDataSerializer(many=True)
    output_format = serializers.ChoiceField(choices=["png"])


class CapabilitiesSerializer(serializers.Serializer):
    streaming = serializers.BooleanField(help_text="streaming sessions (/api/sessions/)")
    image = serializers.BooleanField(help_text="POST /v1/images/generations")
    video = serializers.BooleanField(help_text="POST /v1/videos")


class ModelSerializer(serializers.Serializer):
    """OpenAI's ``Model`` of a served preset, with what it makes (not OpenAI's fields past
    ``owned_by``)."""

    id = serializers.CharField(source="name")
    object = serializers.SerializerMethodField()
    created = serializers.SerializerMethodField(help_text="when this server started serving it")
    owned_by = serializers.SerializerMethodField()
    description = serializers.CharField()
    fps = serializers.IntegerField()
    sizes = serializers.ListField(child=serializers.CharField(), source="resolutions")
    default_size = serializers.CharField(source="default_resolution")
    video_seconds = serializers.SerializerMethodField(help_text="shortest and longest video, in seconds")
    capabilities = serializers.SerializerMethodField()

    @extend_schema_field({"type": "string", "enum": ["model"]})
    def get_object(self, preset: ModelPreset) -> str:
        return "model"

    def get_created(self, preset: ModelPreset) -> int:
        return SERVING_SINCE

    def get_owned_by(self, preset: ModelPreset) -> str:
        return "streamserve"

    @extend_schema_field({"type": "array", "items": {"type": "number"}, "minItems": 2, "maxItems": 2})
    def get_video_seconds(self, preset: ModelPreset) -> list[float]:
        return [frames / preset.fps for frames in services.frames_bounds(preset)]

    @extend_schema_field(CapabilitiesSerializer)
    def get_capabilities(self, preset: ModelPreset) -> dict:
        # Every model class of the catalogue streams and has a one-shot mode for both kinds
        # (tests/sessions/test_openai_api.py checks it against the runtime's classes).
        return {"streaming": True, "image": True, "video": True}


class ModelListSerializer(serializers.Serializer):
    object = serializers.ChoiceField(choices=["list"])
    data = ModelSerializer(many=True)
