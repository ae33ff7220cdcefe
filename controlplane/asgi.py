"""ASGI entry point: HTTP through Django, WebSockets through Channels (auth + origin checks here)."""

from __future__ import annotations

import os

import django
from django.core.asgi import get_asgi_application

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "controlplane.settings")
django.setup(set_prefix=False)

from controlplane.tracing import tracing_configure  # noqa: E402  (reads the settings)

# Before the handler is built: the Django instrumentation adds its middleware to the settings.
tracing_configure("web")
django_asgi_app = get_asgi_application()

from django.conf import settings  # noqa: E402  (configured by the line above)
from django.core.exceptions import ImproperlyConfigured  # noqa: E402

if not settings.DEBUG and not os.environ.get("SECRET_KEY"):
    # The web server signs sessions and CSRF tokens: never with a missing or development key.
    raise ImproperlyConfigured(settings.SECRET_KEY_MISSING)

from channels.routing import ProtocolTypeRouter, URLRouter  # noqa: E402  (needs the app registry ready)

from controlplane.routing import websocket_urlpatterns  # noqa: E402
from controlplane.wsauth import TokenOrSessionAuth  # noqa: E402

application = ProtocolTypeRouter(
    {
        "http": django_asgi_app,
        "websocket": TokenOrSessionAuth(URLRouter(websocket_urlpatterns)),
    }
)
