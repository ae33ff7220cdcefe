"""Who a ``/v1/`` request acts as: the owner of its API token, or — with ``OPENAI_API_ANONYMOUS=true``
on a single-user machine — the local user.

The token is the project's API token (``rest_framework.authtoken``) as ``Authorization: Bearer
<key>`` (what the ``openai`` SDK sends for its ``api_key``) or ``Token <key>``. There is no cookie
session here: the API is for programs, and a cookie would need CSRF checks.

Anonymous mode exists for ``make run`` on one's own machine with a client that insists on an API
key (the SDK refuses to start without one): any request, with no key or with a key that is no
token, acts as the ``demo`` user (created, without a usable password, if missing); a valid token
still acts as its own user. Anyone who can reach the port is then that user, so it is off by
default.
"""

from __future__ import annotations

from django.conf import settings
from django.contrib.auth import get_user_model
from django.contrib.auth.hashers import make_password
from drf_spectacular.extensions import OpenApiAuthenticationExtension
from rest_framework.authentication import BaseAuthentication, TokenAuthentication
from rest_framework.exceptions import AuthenticationFailed

from contracts.http.auth import BearerTokenAuthentication

# The user `create_demo_user` (run by `make run`) creates: the one who uses the generation page.
LOCAL_USERNAME = "demo"


def local_user():
    user, _ = get_user_model().objects.get_or_create(
        username=LOCAL_USERNAME, defaults={"password": make_password(None)}
    )
    return user


class LocalUserAuthentication(BaseAuthentication):
    """``OPENAI_API_ANONYMOUS``: a token's owner if the request carries a valid one, else the local
    user; never a refusal."""

    def authenticate(self, request):
        for scheme in (BearerTokenAuthentication(), TokenAuthentication()):
            try:
                found = scheme.authenticate(request)
            except AuthenticationFailed:
                found = None
            if found is not None:
                return found
        return local_user(), None


class LocalUserScheme(OpenApiAuthenticationExtension):
    """In the schema, anonymous mode is the bearer token made optional."""

    target_class = LocalUserAuthentication
    name = "bearerAuth"
    optional = True

    def get_security_definition(self, auto_schema):
        return {"type": "http", "scheme": "bearer", "description": "an API token: `Bearer <key>`"}


def authenticators() -> list[BaseAuthentication]:
    """The ``/v1/`` views' authentication, read per request (tests switch the setting)."""
    if settings.STREAMSERVE["OPENAI_API_ANONYMOUS"]:
        return [LocalUserAuthentication()]
    # Bearer first: a 401 asks for ``WWW-Authenticate: Bearer``, the scheme OpenAI's clients use.
    return [BearerTokenAuthentication(), TokenAuthentication()]
