"""WebSocket authentication: API tokens for integrators, session cookies (origin-checked) for browsers.

A cookie is an ambient credential, so cookie-authenticated sockets must come from an allowed
origin (cross-site WebSocket hijacking); a token is presented explicitly, so token-authenticated
sockets (``Authorization: Token <key>`` or ``Bearer <key>`` header, or ``?token=<key>``) need no
Origin header.

The origin check compares scheme, host and port, as Django's CSRF check does for forms: the origin
must be the socket's own (``http(s)://`` + its ``Host`` header, which must be in ``ALLOWED_HOSTS``) or
one of ``CSRF_TRUSTED_ORIGINS`` (``https://*.example.com`` for subdomains). Channels' own
``OriginValidator`` compares host names only, so ``http://127.0.0.1:9999`` — any other program on the
same machine — passed for a platform on ``:8100``.
"""

from __future__ import annotations

from typing import NamedTuple
from urllib.parse import parse_qs, urlsplit

from channels.auth import AuthMiddlewareStack
from channels.db import database_sync_to_async
from channels.security.websocket import WebsocketDenier
from django.conf import settings
from django.contrib.auth.models import AnonymousUser
from django.http.request import split_domain_port, validate_host
from django.utils.http import is_same_domain

DEFAULT_PORTS = {"http": 80, "https": 443}


@database_sync_to_async
def _user_for_token(key: str):
    # rest_framework.authtoken's models need the app registry, which this module is imported before.
    from rest_framework.authtoken.models import Token

    token = Token.objects.select_related("user").filter(key=key).first()
    if token is None or not token.user.is_active:
        return AnonymousUser()
    return token.user


def _header(scope, name: bytes) -> str | None:
    for key, value in scope.get("headers", []):
        if key == name:
            return value.decode("latin-1")
    return None


def _token_from(scope) -> str | None:
    authorization = _header(scope, b"authorization")
    if authorization is not None:
        scheme, _, key = authorization.partition(" ")
        if scheme.lower() in ("token", "bearer") and key:
            return key.strip()
    query = parse_qs(scope.get("query_string", b"").decode("latin-1"))
    return (query.get("token") or [None])[0]


class Origin(NamedTuple):
    scheme: str
    host: str
    port: int


def parse_origin(value: str) -> Origin | None:
    """``scheme://host[:port]`` with the scheme's default port filled in; None when malformed."""
    try:
        parts = urlsplit(value.strip())
        port = parts.port
    except ValueError:  # a port out of range or not a number
        return None
    scheme = parts.scheme.lower()
    if scheme not in DEFAULT_PORTS or not parts.hostname:
        return None
    return Origin(scheme, parts.hostname.lower(), port if port is not None else DEFAULT_PORTS[scheme])


def origin_allowed(scope) -> bool:
    """Whether a cookie-authenticated socket's ``Origin`` is its own or a trusted one."""
    origin = parse_origin(_header(scope, b"origin") or "")
    host = _header(scope, b"host")
    if origin is None or host is None:
        return False
    domain, _ = split_domain_port(host)
    if not domain or not validate_host(domain, settings.ALLOWED_HOSTS):
        return False
    own_scheme = "https" if scope.get("scheme") == "wss" else "http"
    if origin == parse_origin(f"{own_scheme}://{host}"):
        return True
    for trusted in settings.CSRF_TRUSTED_ORIGINS:
        wildcard = "://*." in trusted
        allowed = parse_origin(trusted.replace("://*.", "://", 1) if wildcard else trusted)
        if allowed is None or (origin.scheme, origin.port) != (allowed.scheme, allowed.port):
            continue
        if origin.host == allowed.host or (wildcard and is_same_domain(origin.host, f".{allowed.host}")):
            return True
    return False


class TokenOrSessionAuth:
    def __init__(self, inner) -> None:
        self.inner = inner
        self.browser = AuthMiddlewareStack(inner)

    async def __call__(self, scope, receive, send):
        key = _token_from(scope)
        if key is not None:
            return await self.inner({**scope, "user": await _user_for_token(key)}, receive, send)
        if _header(scope, b"origin") is None:
            # Not a browser (browsers always send Origin on a WebSocket): a program without a token,
            # e.g. vLLM-Omni's example client. No cookie is read; it is anonymous, which a consumer
            # refuses unless it serves the local user (OPENAI_API_ANONYMOUS, docs/openai.md).
            return await self.inner({**scope, "user": AnonymousUser()}, receive, send)
        if not origin_allowed(scope):
            # Refused at the handshake (HTTP 403), before any cookie is read.
            return await WebsocketDenier()(scope, receive, send)
        return await self.browser(scope, receive, send)
