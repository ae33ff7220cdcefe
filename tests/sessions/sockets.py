"""The session and job WebSockets in tests: the consumers routed as the ASGI application routes
them, over the real Redis channel layer, with the user put in the scope directly (``wsauth`` has
its own tests in ``tests/controlplane/test_wsauth.py``).

Modules using them mark their tests ``pytest.mark.usefixtures("close_thread_connections")``
(``tests/sessions/conftest.py``).
"""

from __future__ import annotations

from channels.routing import URLRouter
from channels.testing import WebsocketCommunicator

from sessions.routing import websocket_urlpatterns

application = URLRouter(websocket_urlpatterns)


def communicator_as(user, path: str) -> WebsocketCommunicator:
    """A communicator on ``path`` for ``user`` (an ``AnonymousUser`` too), not yet connected."""
    communicator = WebsocketCommunicator(application, path)
    communicator.scope["user"] = user
    return communicator


async def connect_as(user, path: str) -> WebsocketCommunicator:
    """A communicator on ``path`` for ``user``, connected (the consumer accepted it)."""
    communicator = communicator_as(user, path)
    connected, _ = await communicator.connect()
    assert connected
    return communicator
