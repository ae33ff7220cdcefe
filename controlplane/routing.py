from __future__ import annotations

from sessions.routing import websocket_urlpatterns as session_patterns

websocket_urlpatterns = [*session_patterns]

from django.urls import path  # noqa: E402  (the console route, owned by the front end)

from sessions.console_consumers import ConsoleConsumer  # noqa: E402

websocket_urlpatterns.append(path("ws/console/", ConsoleConsumer.as_asgi()))
