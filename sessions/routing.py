from __future__ import annotations

from django.urls import path

from sessions.consumers import JobConsumer, SessionConsumer

websocket_urlpatterns = [
    path("ws/sessions/<str:session_id>/", SessionConsumer.as_asgi()),
    path("ws/jobs/", JobConsumer.as_asgi()),
]
