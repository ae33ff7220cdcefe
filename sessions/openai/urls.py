"""OpenAI's paths, mounted at ``/v1/`` (``controlplane/urls.py``), as the SDK's ``base_url``
(``http://host:port/v1``) reaches them: no trailing slashes."""

from __future__ import annotations

from django.urls import path, re_path

from sessions.openai import api

urlpatterns = [
    path("models", api.ModelListView.as_view(), name="openai-models"),
    path("models/<str:model>", api.ModelDetailView.as_view(), name="openai-model"),
    path("images/generations", api.ImageGenerationView.as_view(), name="openai-images-generate"),
    path("images/<uuid:image_id>/content", api.ImageContentView.as_view(), name="openai-image-content"),
    path("videos", api.VideoListCreateView.as_view(), name="openai-videos"),
    path("videos/<uuid:video_id>", api.VideoDetailView.as_view(), name="openai-video"),
    path("videos/<uuid:video_id>/content", api.VideoContentView.as_view(), name="openai-video-content"),
    # Any path at all: a newline in it too (the fuzzer sends them), which `.` would not match.
    re_path(r"^[\s\S]*$", api.NoRouteView.as_view(), name="openai-no-route"),
]
