"""The ``/v1/`` endpoints: thin views that parse OpenAI's request, call ``services`` or
``selectors``, and render OpenAI's object; every refusal is OpenAI's error shape (``errors``)."""

from __future__ import annotations

import base64
import time
from collections.abc import Mapping

from django.conf import settings
from django.core.exceptions import ValidationError
from django.http import FileResponse
from django.urls import reverse
from drf_spectacular.types import OpenApiTypes
from drf_spectacular.utils import OpenApiResponse, extend_schema
from rest_framework import exceptions, status
from rest_framework.negotiation import BaseContentNegotiation, DefaultContentNegotiation
from rest_framework.parsers import JSONParser, MultiPartParser
from rest_framework.renderers import JSONRenderer
from rest_framework.response import Response
from rest_framework.views import APIView

from contracts.catalog import PRESETS, ModelPreset
from sessions import jobs, tenants
from sessions.models import Job, Tenant
from sessions.openai import auth, errors, selectors, services
from sessions.openai.errors import OpenAIError
from sessions.openai.serializers import (
    ImageGeneration,
    ImagesResponseSerializer,
    ModelListSerializer,
    ModelSerializer,
    VideoContentQuery,
    VideoCreate,
    VideoDeletedSerializer,
    VideoListQuery,
    VideoListSerializer,
    VideoSerializer,
)

TAG = "openai"
ERROR = OpenApiResponse(
    response={"type": "object", "properties": {"error": {"type": "object"}}},
    description="OpenAI's error shape: {error: {message, type, param, code}}",
)


class AnyAccept(BaseContentNegotiation):
    """JSON whatever the ``Accept`` header says, as OpenAI's servers answer (the SDK asks for
    ``application/binary`` when it downloads content); a file is a ``FileResponse`` anyway."""

    def select_parser(self, request, parsers):
        return DefaultContentNegotiation().select_parser(request, parsers)

    def select_renderer(self, request, renderers, format_suffix=None):
        return renderers[0], renderers[0].media_type


class OpenAIView(APIView):
    """Token (``Bearer`` or ``Token``) or anonymous-mode authentication, JSON bodies and answers,
    OpenAI's errors; the project's throttles and permission (a user) apply as everywhere."""

    parser_classes = [JSONParser]
    renderer_classes = [JSONRenderer]
    content_negotiation_class = AnyAccept

    def get_authenticators(self):
        return auth.authenticators()

    def get_exception_handler(self):
        return errors.exception_handler


def _tenant(request) -> Tenant | None:
    """The tenant named by the ``TENANT_HEADER`` header (docs/tenants.md), else ``None`` (the user's
    default); one the user does not belong to is OpenAI's 400 on ``tenant``."""
    header = settings.STREAMSERVE["TENANT_HEADER"]
    name = request.headers.get(header, "") if header else ""
    if not name:
        return None
    try:
        return tenants.tenant_acting_for(user=request.user, name=name)
    except ValidationError as exc:
        message = "; ".join(exc.message_dict.get("tenant", [str(exc)]))
        raise OpenAIError(message, status_code=400, code="invalid_tenant", param="tenant") from exc


def _too_many(exc: jobs.JobLimit) -> OpenAIError:
    # As /api/jobs/: a 429 (the SDK waits and retries it, as it does a throttled request).
    return OpenAIError(str(exc), status_code=429, code="too_many_jobs_in_flight")


def _served() -> list[ModelPreset]:
    return [PRESETS[name] for name in settings.STREAMSERVE["SERVED_MODELS"] if name in PRESETS]


def _result(job: Job, content_type: str) -> FileResponse:
    """The stored result, streamed from the storage; served inline only as what the job makes."""
    inline = job.result_content_type == content_type
    return FileResponse(
        job.result.open("rb"),
        content_type=content_type if inline else "application/octet-stream",
        as_attachment=not inline,
        filename=job.result.name.rsplit("/", 1)[-1],
    )


def _not_found(what: str, ident) -> OpenAIError:
    return OpenAIError(f"No {what} found with id '{ident}'.", status_code=404, code="not_found", param="id")


# --- models ------------------------------------------------------------------------------------------


@extend_schema(tags=[TAG])
class ModelListView(OpenAIView):
    """``GET /v1/models``: the served presets, with what each makes."""

    @extend_schema(operation_id="openai_models_list", responses=ModelListSerializer)
    def get(self, request):
        return Response({"object": "list", "data": ModelSerializer(_served(), many=True).data})


@extend_schema(tags=[TAG])
class ModelDetailView(OpenAIView):
    @extend_schema(operation_id="openai_models_retrieve", responses=ModelSerializer)
    def get(self, request, model: str):
        preset = next((p for p in _served() if p.name == model), None)
        if preset is None:
            raise OpenAIError(
                f"The model '{model}' does not exist or is not served here.",
                status_code=404,
                code="model_not_found",
                param="model",
            )
        return Response(ModelSerializer(preset).data)


# --- images ------------------------------------------------------------------------------------------


@extend_schema(tags=[TAG])
class ImageGenerationView(OpenAIView):
    @extend_schema(
        operation_id="openai_images_generate",
        request=ImageGeneration,
        responses={
            200: ImagesResponseSerializer,
            500: OpenApiResponse(ERROR.response, description="an image failed (not retried)"),
            504: OpenApiResponse(
                ERROR.response,
                description="not ready within OPENAI_IMAGES_TIMEOUT_S (cancelled; not retried)",
            ),
        },
    )
    def post(self, request):
        """``client.images.generate``: ``n`` image jobs; answers once all are done (as OpenAI's
        does), within ``OPENAI_IMAGES_TIMEOUT_S``."""
        data = ImageGeneration(data=request.data)
        data.is_valid(raise_exception=True)
        fields = data.validated_data
        size = fields.get("size")
        try:
            submitted = services.images_submit(
                owner=request.user,
                model_name=fields["model"],
                prompt=fields["prompt"],
                size=None if size in (None, "auto") else size,
                n=fields["n"] or 1,
                seed=fields.get("seed"),
                tenant=_tenant(request),
            )
        except jobs.JobLimit as exc:
            raise _too_many(exc) from exc
        except tenants.QuotaExceeded as exc:
            raise OpenAIError(str(exc), status_code=429, code="tenant_quota_exceeded") from exc
        timeout_s = settings.STREAMSERVE["OPENAI_IMAGES_TIMEOUT_S"]
        try:
            done = services.images_wait(job_ids=[job.pk for job in submitted], timeout_s=timeout_s)
        except services.ImagesTimedOut as exc:
            raise OpenAIError(str(exc), status_code=504, code="timeout", retry=False) from exc
        except services.ImageFailed as exc:
            raise OpenAIError(
                f"image generation failed: {exc}", status_code=500, code="generation_failed", retry=False
            ) from exc
        if (fields.get("response_format") or "b64_json") == "url":
            images = [
                {"url": request.build_absolute_uri(reverse("openai-image-content", args=[job.pk]))}
                for job in done
            ]
        else:
            images = []
            for job in done:
                with job.result.open("rb") as png:
                    images.append({"b64_json": base64.b64encode(png.read()).decode("ascii")})
        return Response({"created": int(time.time()), "data": images, "output_format": "png"})


@extend_schema(tags=[TAG])
class ImageContentView(OpenAIView):
    @extend_schema(
        operation_id="openai_images_content",
        responses={
            (200, "image/png"): OpenApiTypes.BINARY,
            (200, "application/octet-stream"): OpenApiTypes.BINARY,
        },
    )
    def get(self, request, image_id):
        """The PNG of a generated image (``response_format=url``): not OpenAI's, which hands out
        public URLs; fetched with the same token."""
        job = selectors.jobs_of(request.user, Job.Kind.IMAGE).filter(pk=image_id).first()
        if job is None or job.state != Job.State.DONE:
            raise _not_found("image", image_id)
        return _result(job, "image/png")


# --- videos ------------------------------------------------------------------------------------------


@extend_schema(tags=[TAG])
class VideoListCreateView(OpenAIView):
    parser_classes = [JSONParser, MultiPartParser]

    @extend_schema(
        operation_id="openai_videos_create",
        request={"multipart/form-data": VideoCreate, "application/json": VideoCreate},
        responses=VideoSerializer,
    )
    def post(self, request):
        """``client.videos.create``: one video job of ``seconds`` × the model's fps frames."""
        if request.FILES or (isinstance(request.data, Mapping) and "input_reference" in request.data):
            raise OpenAIError(
                "input_reference is not supported: text to video only",
                status_code=400,
                code="unsupported_parameter",
                param="input_reference",
            )
        data = VideoCreate(data=request.data)
        data.is_valid(raise_exception=True)
        fields = data.validated_data
        try:
            job = services.video_submit(
                owner=request.user,
                model_name=fields["model"],
                prompt=fields["prompt"],
                size=fields.get("size"),
                seconds=fields.get("seconds"),
                tenant=_tenant(request),
            )
        except jobs.JobLimit as exc:
            raise _too_many(exc) from exc
        except tenants.QuotaExceeded as exc:
            raise OpenAIError(str(exc), status_code=429, code="tenant_quota_exceeded") from exc
        return Response(VideoSerializer(job).data)

    @extend_schema(
        operation_id="openai_videos_list",
        parameters=[VideoListQuery],
        responses=VideoListSerializer,
    )
    def get(self, request):
        """``client.videos.list``: the user's videos, newest first unless ``order=asc``."""
        query = VideoListQuery(data=request.query_params)
        query.is_valid(raise_exception=True)
        fields = query.validated_data
        page = selectors.video_page(
            owner=request.user, after=fields.get("after"), limit=fields["limit"], order=fields["order"]
        )
        videos = VideoSerializer(page.videos, many=True).data
        return Response(
            {
                "object": "list",
                "data": videos,
                "first_id": videos[0]["id"] if videos else None,
                "last_id": videos[-1]["id"] if videos else None,
                "has_more": page.has_more,
            }
        )


def _video(request, video_id) -> Job:
    job = selectors.jobs_of(request.user, Job.Kind.VIDEO).filter(pk=video_id).first()
    if job is None:
        raise _not_found("video", video_id)
    return job


@extend_schema(tags=[TAG])
class VideoDetailView(OpenAIView):
    @extend_schema(operation_id="openai_videos_retrieve", responses=VideoSerializer)
    def get(self, request, video_id):
        """``client.videos.retrieve``: status (queued, in_progress, completed, failed) and progress."""
        return Response(VideoSerializer(_video(request, video_id)).data)

    @extend_schema(operation_id="openai_videos_delete", responses=VideoDeletedSerializer)
    def delete(self, request, video_id):
        """``client.videos.delete``: cancels the job if it has not ended, removes its MP4; the video
        is gone from this API and ``/api/jobs/`` (the audit keeps how it ended)."""
        job = jobs.job_delete(job=_video(request, video_id))
        return Response({"id": str(job.pk), "object": "video.deleted", "deleted": True})


@extend_schema(tags=[TAG])
class VideoContentView(OpenAIView):
    @extend_schema(
        operation_id="openai_videos_content",
        parameters=[VideoContentQuery],
        responses={
            (200, "video/mp4"): OpenApiTypes.BINARY,
            (200, "application/octet-stream"): OpenApiTypes.BINARY,
            409: OpenApiResponse(ERROR.response, description="the video is not completed (not retried)"),
        },
    )
    def get(self, request, video_id):
        """``client.videos.download_content``: the MP4, streamed from the storage, once completed."""
        query = VideoContentQuery(data=request.query_params)
        query.is_valid(raise_exception=True)
        job = _video(request, video_id)
        if job.state != Job.State.DONE:
            video = VideoSerializer(job).data
            raise OpenAIError(
                f"Video {job.pk} is {video['status']}: its content is available once it is completed.",
                status_code=status.HTTP_409_CONFLICT,
                code="video_not_ready" if job.in_flight else "video_failed",
                retry=False,
            )
        return _result(job, "video/mp4")


@extend_schema(exclude=True)
class NoRouteView(OpenAIView):
    """Any other ``/v1/`` path: OpenAI's 404 (Django's would be HTML with DEBUG on)."""

    def http_method_not_allowed(self, request, *args, **kwargs):
        raise exceptions.NotFound(f"Unknown route: {request.method} {request.path}")

    options = http_method_not_allowed
