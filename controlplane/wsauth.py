"""WebSocket authentication: API tokens for integrators, session cookies (origin-checked) for browsers.

A cookie is an ambient credential, so cookie-authenticated sockets must come from an allowed
origin (cross-site WebSocket hijacking); a token is presented explicitly, so token-authenticated
sockets (``Authorization: Token <key>`` header or ``?token=<key>``) need no Origin header.
"""

from __future__ import annotations

from urllib.parse import parse_qs

from channels.auth import AuthMiddlewareStack
from channels.db import database_sync_to_async
from channels.security.websocket import AllowedHostsOriginValidator
from django.contrib.auth.models import AnonymousUser


@database_sync_to_async
def _user_for_token(key: str):
    from rest_framework.authtoken.models import Token

    token = Token.objects.select_related("user").filter(key=key).first()
    if token is None or not token.user.is_active:
        return AnonymousUser()
    return token.user


def _token_from(scope) -> str | None:
    for name, value in scope.get("headers", []):
        if name == b"authorization":
            scheme, _, key = value.decode("latin-1").partition(" ")
            if scheme.lower() == "token" and key:
                return key.strip()
    query = parse_qs(scope.get("query_string", b"").decode("latin-1"))
    return (query.get("token") or [None])[0]


class TokenOrSessionAuth:
    def __init__(self, inner) -> None:
        self.inner = inner
        self.browser = AllowedHostsOriginValidator(AuthMiddlewareStack(inner))

    async def __call__(self, scope, receive, send):
        key = _token_from(scope)
        if key is not None:
            return await self.inner({**scope, "user": await _user_for_token(key)}, receive, send)
        return await self.browser(scope, receive, send)
