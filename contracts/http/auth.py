"""``Authorization: Bearer <key>`` with the API tokens (``rest_framework.authtoken``).

DRF's ``TokenAuthentication`` reads the keyword ``Token``; OpenAI's SDKs and most HTTP clients send
``Bearer``. Both keywords name the same tokens, on the REST API, the OpenAI-compatible API (``/v1/``)
and the WebSockets (``controlplane.wsauth``).
"""

from __future__ import annotations

from drf_spectacular.extensions import OpenApiAuthenticationExtension
from rest_framework.authentication import TokenAuthentication


class BearerTokenAuthentication(TokenAuthentication):
    keyword = "Bearer"


class BearerTokenScheme(OpenApiAuthenticationExtension):
    """The schema's security scheme of ``BearerTokenAuthentication`` (drf-spectacular's own token
    scheme would give it the name of ``Token``'s)."""

    target_class = BearerTokenAuthentication
    name = "bearerAuth"
    priority = 1

    def get_security_definition(self, auto_schema):
        return {"type": "http", "scheme": "bearer", "description": "an API token: `Bearer <key>`"}
