from __future__ import annotations

from django.urls import path

from sessions.consumers import JobConsumer, SessionConsumer
from sessions.realtime.consumer import RealtimeVideoConsumer

websocket_urlpatterns = [
    path("ws/sessions/<str:session_id>/", SessionConsumer.as_asgi()),
    path("ws/jobs/", JobConsumer.as_asgi()),
    # vLLM-Omni's streaming video output socket, at the path its clients use (docs/openai.md).
    path("v1/realtime/video", RealtimeVideoConsumer.as_asgi()),
]
