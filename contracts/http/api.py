"""API-wide wiring: the error shape every endpoint returns and documents, the 409 of a state conflict,
bounded pagination, and the audit endpoints' shared shape.

The audit endpoints of several apps (``/api/audit/latency/`` in sessions, ``/api/audit/cost/`` in
gpu) take the same query parameters (parsed by ``contracts.http.timerange``) and answer CSV the same way.
"""

from __future__ import annotations

import csv
import io
from typing import Any

from django.core.exceptions import ValidationError as DjangoValidationError
from django.http import HttpRequest, HttpResponse, JsonResponse
from django.views import defaults
from django_filters.rest_framework import DjangoFilterBackend
from drf_spectacular.contrib.django_filters import DjangoFilterExtension
from drf_spectacular.types import OpenApiTypes
from drf_spectacular.utils import OpenApiParameter, OpenApiResponse
from rest_framework import exceptions, serializers, status
from rest_framework.pagination import LimitOffsetPagination
from rest_framework.views import exception_handler as drf_exception_handler

API_PREFIX = "/api/"
# PostgreSQL text cannot hold NUL; Django's and DRF's CharFields refuse it (400), the schema says so.
NO_NUL = "^[^\\u0000]*$"

# PostgreSQL's OFFSET is a bigint; no listing here comes near 2³¹ rows.
MAX_OFFSET = 2**31 - 1


def exception_handler(exc: Exception, context: dict[str, Any]):
    """DRF's handler, plus Django model ValidationErrors mapped to 400 with their fields."""
    if isinstance(exc, DjangoValidationError):
        detail = exc.message_dict if hasattr(exc, "error_dict") else {"non_field_errors": exc.messages}
        exc = exceptions.ValidationError(detail=detail)
    return drf_exception_handler(exc, context)


class Conflict(exceptions.APIException):
    """409: the object's current state refuses the action (a terminated session is not paused, a
    released worker is not drained).

    Not a 400: the request is well formed and names no invalid field; the same request succeeds only
    once the state is different. The body is the API's error shape, ``{"detail": reason}``.
    """

    status_code = status.HTTP_409_CONFLICT
    default_detail = "The object's current state does not allow this action."
    default_code = "conflict"


def conflict_response(when: str) -> OpenApiResponse:
    """The schema of an operation's 409 (``Conflict``), saying ``when`` it is answered; the body is
    the shared ``Error`` schema (``document_error_responses`` adds it)."""
    return OpenApiResponse(description=f"State conflict: {when}")


class StrictCharField(serializers.CharField):
    """A string field that takes only JSON strings: DRF's own turns ``466.0`` into ``"466.0"``."""

    def to_internal_value(self, data):
        if not isinstance(data, str):
            self.fail("invalid")
        return super().to_internal_value(data)


class StrictSlugField(serializers.SlugField):
    """A slug that takes only JSON strings (``StrictCharField``'s rule for slugs: DRF's turns
    ``123`` into ``"123"``)."""

    def to_internal_value(self, data):
        if not isinstance(data, str):
            self.fail("invalid_string")
        return super().to_internal_value(data)

    default_error_messages = {
        **serializers.SlugField.default_error_messages,
        "invalid_string": "Not a valid string.",
    }


class StrictFloatField(serializers.FloatField):
    """A number field that refuses JSON booleans: DRF's own turns ``true`` into ``1.0`` (Python's
    ``float(True)``), so a client sending a flag where a number belongs would be silently obeyed."""

    def to_internal_value(self, data):
        if isinstance(data, bool):
            self.fail("invalid")
        return super().to_internal_value(data)


def page_not_found(request: HttpRequest, exception: Exception) -> HttpResponse:
    """handler404: an API client gets the API's JSON error shape for a URL no route matches."""
    if request.path.startswith(API_PREFIX):
        return JsonResponse({"detail": "Not found."}, status=404)
    return defaults.page_not_found(request, exception)


def server_error(request: HttpRequest) -> HttpResponse:
    """handler500: JSON for API clients; never the exception or the settings (DEBUG is off)."""
    if request.path.startswith(API_PREFIX):
        return JsonResponse({"detail": "Server error."}, status=500)
    return defaults.server_error(request)


def filterset_check(filterset, params) -> None:
    """400 naming each filter given with an empty value or an invalid one.

    django-filter reads ``?status=`` as "no filter": a client that meant to filter gets every row,
    and the schema (an enum, a date-time) cannot say that an empty value is accepted.
    """
    errors = {
        name: ["must not be empty (leave the parameter out to not filter)"]
        for name in filterset.filters
        if name in params and params[name] == ""
    }
    if not errors and not filterset.is_valid():
        errors = filterset.errors
    if errors:
        raise exceptions.ValidationError(errors)


class StrictFilterBackend(DjangoFilterBackend):
    """django-filter with ``filterset_check``: empty or invalid filters are a 400."""

    def get_filterset(self, request, queryset, view):
        filterset = super().get_filterset(request, queryset, view)
        if filterset is not None:
            filterset_check(filterset, request.query_params)
        return filterset


class StrictFilterExtension(DjangoFilterExtension):
    """The schema of ``StrictFilterBackend``: its free-text filters say they cannot be empty."""

    target_class = StrictFilterBackend
    priority = 1

    def get_schema_operation_parameters(self, auto_schema, *args, **kwargs):
        parameters = super().get_schema_operation_parameters(auto_schema, *args, **kwargs)
        for parameter in parameters:
            schema = parameter["schema"]
            if schema.get("type") == "string" and "enum" not in schema and "format" not in schema:
                schema.update(minLength=1, pattern=NO_NUL)
        return parameters


class BoundedLimitOffsetPagination(LimitOffsetPagination):
    """``?limit=&offset=`` that answer 400 naming the parameter when malformed or out of bounds.

    DRF's own pagination silently falls back to its default for ``limit=abc`` or ``limit=-5``: the
    client gets a page it did not ask for, and the schema cannot say which inputs are accepted.
    """

    max_limit = 1000

    def get_limit(self, request) -> int:
        return self._bounded(request, self.limit_query_param, 1, self.max_limit, self.default_limit)

    def get_offset(self, request) -> int:
        return self._bounded(request, self.offset_query_param, 0, MAX_OFFSET, 0)

    @staticmethod
    def _bounded(request, name: str, low: int, high: int, default: int) -> int:
        raw = request.query_params.get(name)
        if raw is None:
            return default
        try:
            value = int(raw)
        except ValueError:
            value = None
        if value is None or not low <= value <= high:
            raise exceptions.ValidationError({name: f"must be an integer between {low} and {high}"})
        return value

    def get_schema_operation_parameters(self, view) -> list[dict]:
        bounds = {
            self.limit_query_param: {"minimum": 1, "maximum": self.max_limit},
            self.offset_query_param: {"minimum": 0, "maximum": MAX_OFFSET},
        }
        parameters = super().get_schema_operation_parameters(view)
        for parameter in parameters:
            parameter["schema"].update(bounds[parameter["name"]])
        return parameters


ERROR_SCHEMA = {
    "type": "object",
    "description": "``detail`` for a refusal; for a validation error, the messages of each invalid field.",
    "additionalProperties": True,
}


def document_error_responses(result: dict, generator, request, public) -> dict:
    """drf-spectacular post-processing hook: every operation documents the errors it can answer.

    401/403 (every endpoint needs a user, most of them staff), 429 (throttling), 400 where the
    operation takes a query string or a body, 404 where its path names an object; an error an
    operation declares itself (a 409: ``conflict_response``) gets the same ``Error`` body.
    """
    result.setdefault("components", {}).setdefault("schemas", {})["Error"] = ERROR_SCHEMA
    error = {"application/json": {"schema": {"$ref": "#/components/schemas/Error"}}}
    for operations in result["paths"].values():
        for operation in operations.values():
            for code, response in operation["responses"].items():
                if code.startswith("4") and "content" not in response:
                    response["content"] = error
            located = {parameter["in"] for parameter in operation.get("parameters", [])}
            codes = {
                "401": "Not authenticated",
                "403": "Not allowed for this user",
                "429": "Too many requests (throttled)",
            }
            if "query" in located or "requestBody" in operation:
                codes["400"] = "Invalid input; the body names each invalid field"
            if "requestBody" in operation:
                codes["415"] = "Unsupported request body media type"
            if "path" in located:
                codes["404"] = "No such object, or not visible to this user"
            for code, description in codes.items():
                operation["responses"].setdefault(code, {"content": error, "description": description})
    return result


# The schema of the audit endpoints' common query parameters (``parse_time_range`` plus the format).
AUDIT_PARAMETERS = [
    OpenApiParameter("start", OpenApiTypes.DATETIME, description="ISO-8601; default: end − 1 h"),
    OpenApiParameter("end", OpenApiTypes.DATETIME, description="ISO-8601; default: now"),
    OpenApiParameter("bucket", OpenApiTypes.STR, enum=["minute", "hour", "day"]),
    OpenApiParameter("format", OpenApiTypes.STR, enum=["json", "csv"]),
]
AUDIT_FORMATS = ("json", "csv")


def audit_format(params) -> str:
    """``?format=`` of an audit endpoint: json (default) or csv; 400 otherwise."""
    value = params.get("format", "json")
    if value not in AUDIT_FORMATS:
        raise exceptions.ValidationError({"format": f"must be one of {', '.join(AUDIT_FORMATS)}"})
    return value


def audit_responses(report_schema) -> dict:
    """An audit endpoint answers JSON, or a CSV attachment with ``?format=csv``."""
    return {(200, "application/json"): report_schema, (200, "text/csv"): OpenApiTypes.STR}


def csv_response(filename: str, header: list[str], rows: list[list]) -> HttpResponse:
    """An audit report as a CSV attachment (``?format=csv``)."""
    buffer = io.StringIO()
    writer = csv.writer(buffer)
    writer.writerow(header)
    writer.writerows(rows)
    response = HttpResponse(buffer.getvalue(), content_type="text/csv; charset=utf-8")
    response["Content-Disposition"] = f'attachment; filename="{filename}"'
    return response


def csv_cell(value: Any) -> str:
    """One CSV cell: empty for a missing figure, ISO-8601 for an instant."""
    if value is None:
        return ""
    if hasattr(value, "isoformat"):
        return value.isoformat()
    return str(value)
