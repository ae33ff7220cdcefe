"""OpenAI's error shape for every answer of ``/v1/`` that is not a success.

``{"error": {"message", "type", "param", "code"}}`` with the HTTP status of the failure: the
``openai`` SDK raises its exception class by the status (``BadRequestError`` for a 400,
``AuthenticationError`` for a 401, ``RateLimitError`` for a 429 …) and exposes ``param`` and
``code``. DRF's own refusals (authentication, permissions, throttling, unknown routes, methods and
media types, validation) are reshaped here, by the views' own exception handler, so the rest of the
project keeps its ``{"detail": …}`` shape.
"""

from __future__ import annotations

import logging
from typing import Any

from django.core.exceptions import PermissionDenied as DjangoPermissionDenied
from django.core.exceptions import ValidationError as DjangoValidationError
from django.http import Http404
from rest_framework import exceptions, status
from rest_framework.response import Response
from rest_framework.settings import api_settings
from rest_framework.views import set_rollback

from contracts.http.api import exception_handler as api_exception_handler

logger = logging.getLogger(__name__)

# OpenAI's ``type`` by status; a status not named here is an ``invalid_request_error``.
ERROR_TYPES = {
    401: "authentication_error",
    403: "permission_error",
    429: "rate_limit_error",
}
# DRF's codes in OpenAI's words; any other code is passed on as it is.
CODES = {
    "not_authenticated": "missing_api_key",
    "authentication_failed": "invalid_api_key",
    "throttled": "rate_limit_exceeded",
    "required": "missing_required_parameter",
    "null": "missing_required_parameter",
}
# A field's problem in a validation error, unless ``CODES`` names it.
INVALID_VALUE = "invalid_value"


def error_type(status_code: int) -> str:
    return "server_error" if status_code >= 500 else ERROR_TYPES.get(status_code, "invalid_request_error")


def error_body(*, status_code: int, message: str, param: str | None = None, code: str | None = None) -> dict:
    return {"error": {"message": message, "type": error_type(status_code), "param": param, "code": code}}


class OpenAIError(exceptions.APIException):
    """A refusal of the adapter's own, with OpenAI's ``code`` and ``param``; ``retry``: whether the
    SDK may send the request again by itself (``x-should-retry``; it retries 408, 409, 429 and 5xx
    unless told not to)."""

    def __init__(
        self,
        message: str,
        *,
        status_code: int,
        code: str,
        param: str | None = None,
        retry: bool | None = None,
    ) -> None:
        super().__init__(message, code)
        self.status_code, self.param, self.retry = status_code, param, retry


def _first_field_error(detail: Any, codes: Any) -> tuple[str | None, str, str]:
    """(param, message, code) of a validation error: its first field, with every field's message."""
    if isinstance(detail, dict):
        messages = [f"{name}: {_flatten(value)}" for name, value in detail.items()]
        param = next(iter(detail), None)
        code = _first_code(codes.get(param) if isinstance(codes, dict) else codes)
        if param == api_settings.NON_FIELD_ERRORS_KEY:
            param = None
        return param, "; ".join(messages), code
    return None, _flatten(detail), _first_code(codes)


def _flatten(value: Any) -> str:
    if isinstance(value, dict):
        return "; ".join(f"{k}: {_flatten(v)}" for k, v in value.items())
    if isinstance(value, list):
        return " ".join(_flatten(v) for v in value)
    return str(value)


def _first_code(codes: Any) -> str:
    while isinstance(codes, list | dict):
        if not codes:
            return INVALID_VALUE
        codes = codes[0] if isinstance(codes, list) else next(iter(codes.values()))
    return CODES.get(codes, INVALID_VALUE) if codes else INVALID_VALUE


def exception_handler(exc: Exception, context: dict[str, Any]) -> Response:
    """The views' handler (``get_exception_handler``): the project's (which also maps Django's
    ValidationError to a 400), reshaped; anything else is a logged 500, never a traceback."""
    if isinstance(exc, DjangoValidationError):
        detail = exc.message_dict if hasattr(exc, "error_dict") else {"non_field_errors": exc.messages}
        exc = exceptions.ValidationError(detail=detail)
    elif isinstance(exc, Http404):
        exc = exceptions.NotFound(str(exc) or None)
    elif isinstance(exc, DjangoPermissionDenied):
        exc = exceptions.PermissionDenied()
    response = api_exception_handler(exc, context)
    if response is None:
        logger.exception("openai.unhandled %s", context.get("request") and context["request"].path)
        set_rollback()
        body = error_body(status_code=500, message="The server had an error processing the request.")
        return Response(body, status=status.HTTP_500_INTERNAL_SERVER_ERROR)
    assert isinstance(exc, exceptions.APIException)
    if isinstance(exc, exceptions.ValidationError):
        param, message, code = _first_field_error(exc.detail, exc.get_codes())
    else:
        detail_codes = exc.get_codes()
        raw = detail_codes if isinstance(detail_codes, str) else exc.default_code
        param, message, code = getattr(exc, "param", None), _flatten(exc.detail), CODES.get(raw, raw)
    response.data = error_body(status_code=response.status_code, message=message, param=param, code=code)
    retry = getattr(exc, "retry", None)
    if retry is not None:
        response["x-should-retry"] = "true" if retry else "false"
    return response
