"""The session socket's origin check: scheme, host and port, for cookie-authenticated browsers."""

from __future__ import annotations

import json

import pytest
from asgiref.sync import sync_to_async
from channels.testing import WebsocketCommunicator
from django.db import connections
from django.test import Client

from controlplane.asgi import application
from controlplane.wsauth import origin_allowed
from tests.factories import SessionFactory, UserFactory


def scope(origin: str | None, host: str = "127.0.0.1:8100", scheme: str = "ws") -> dict:
    headers = [(b"host", host.encode())]
    if origin is not None:
        headers.append((b"origin", origin.encode()))
    return {"type": "websocket", "scheme": scheme, "headers": headers}


@pytest.mark.parametrize(
    ("origin", "host", "scheme", "allowed"),
    [
        ("http://127.0.0.1:8100", "127.0.0.1:8100", "ws", True),
        ("http://localhost", "localhost", "ws", True),
        ("http://localhost:80", "localhost", "ws", True),  # the default port, written out
        ("https://localhost", "localhost", "wss", True),
        # Defect 9: another program on the same machine, another port.
        ("http://127.0.0.1:9999", "127.0.0.1:8100", "ws", False),
        ("https://127.0.0.1:8100", "127.0.0.1:8100", "ws", False),  # another scheme
        ("http://evil.example:8100", "127.0.0.1:8100", "ws", False),
        ("http://127.0.0.1:8100", "evil.example:8100", "ws", False),  # a Host not in ALLOWED_HOSTS
        ("http://127.0.0.1:99999", "127.0.0.1:8100", "ws", False),
        ("null", "127.0.0.1:8100", "ws", False),
        (None, "127.0.0.1:8100", "ws", False),
    ],
)
def test_origin_must_match_scheme_host_and_port(origin, host, scheme, allowed):
    assert origin_allowed(scope(origin, host, scheme)) is allowed


def test_trusted_origins_match_on_port_too(settings):
    settings.CSRF_TRUSTED_ORIGINS = ["https://app.example.com", "https://*.streams.example.com:8443"]
    assert origin_allowed(scope("https://app.example.com"))
    assert origin_allowed(scope("https://eu.streams.example.com:8443"))
    assert not origin_allowed(scope("https://app.example.com:444"))
    assert not origin_allowed(scope("http://app.example.com"))
    assert not origin_allowed(scope("https://eu.streams.example.com"))
    assert not origin_allowed(scope("https://streams.example.com.evil:8443"))


@pytest.mark.django_db(transaction=True)
@pytest.mark.asyncio
async def test_the_owners_cookie_from_another_port_is_refused_at_the_handshake():
    user = await sync_to_async(UserFactory)()
    session = await sync_to_async(SessionFactory)(owner=user)
    client = Client()
    await sync_to_async(client.force_login)(user)
    cookie = f"sessionid={client.cookies['sessionid'].value}".encode()

    async def attempt(origin: str) -> WebsocketCommunicator:
        communicator = WebsocketCommunicator(
            application,
            f"/ws/sessions/{session.pk}/",
            headers=[(b"host", b"127.0.0.1:8100"), (b"origin", origin.encode()), (b"cookie", cookie)],
        )
        return communicator

    try:
        foreign = await attempt("http://127.0.0.1:9999")
        connected, _ = await foreign.connect()
        assert not connected
        own = await attempt("http://127.0.0.1:8100")
        connected, _ = await own.connect()
        assert connected
        status = json.loads(await own.receive_from())
        assert status["type"] == "status" and status["session"] == str(session.pk)
        await own.disconnect()
    finally:
        await sync_to_async(connections.close_all)()


@pytest.mark.django_db(transaction=True)
@pytest.mark.asyncio
async def test_a_socket_without_origin_or_token_is_anonymous_and_its_cookie_is_never_read():
    # A program, not a browser (browsers always send Origin): it reaches the consumer as anonymous,
    # even with the owner's cookie, and the session socket refuses it as unauthenticated.
    user = await sync_to_async(UserFactory)()
    session = await sync_to_async(SessionFactory)(owner=user)
    client = Client()
    await sync_to_async(client.force_login)(user)
    cookie = f"sessionid={client.cookies['sessionid'].value}".encode()
    communicator = WebsocketCommunicator(
        application,
        f"/ws/sessions/{session.pk}/",
        headers=[(b"host", b"127.0.0.1:8100"), (b"cookie", cookie)],
    )
    try:
        connected, _ = await communicator.connect()
        assert connected
        refusal = json.loads(await communicator.receive_from())
        assert refusal["code"] == "not_authenticated"
        assert (await communicator.receive_output())["code"] == 4401
    finally:
        await sync_to_async(connections.close_all)()
