from __future__ import annotations

from scheduling.routing import websocket_urlpatterns as console_patterns
from sessions.routing import websocket_urlpatterns as session_patterns

websocket_urlpatterns = [*session_patterns, *console_patterns]
