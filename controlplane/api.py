"""API-wide wiring: the error shape every endpoint returns, and the audit endpoints' shared shape.

The audit endpoints of several apps (``/api/audit/latency/`` in sessions, ``/api/audit/cost/`` in
gpu) take the same query parameters (parsed by ``controlplane.timerange``) and answer CSV the same way.
"""

from __future__ import annotations

import csv
import io
from typing import Any

from django.core.exceptions import ValidationError as DjangoValidationError
from django.http import HttpResponse
from drf_spectacular.types import OpenApiTypes
from drf_spectacular.utils import OpenApiParameter
from rest_framework import exceptions
from rest_framework.views import exception_handler as drf_exception_handler


def exception_handler(exc: Exception, context: dict[str, Any]):
    """DRF's handler, plus Django model ValidationErrors mapped to 400 with their fields."""
    if isinstance(exc, DjangoValidationError):
        detail = exc.message_dict if hasattr(exc, "error_dict") else {"non_field_errors": exc.messages}
        exc = exceptions.ValidationError(detail=detail)
    return drf_exception_handler(exc, context)


# The schema of the audit endpoints' common query parameters (``parse_time_range`` plus the format).
AUDIT_PARAMETERS = [
    OpenApiParameter("start", OpenApiTypes.DATETIME, description="ISO-8601; default: end − 1 h"),
    OpenApiParameter("end", OpenApiTypes.DATETIME, description="ISO-8601; default: now"),
    OpenApiParameter("bucket", OpenApiTypes.STR, enum=["minute", "hour", "day"]),
    OpenApiParameter("format", OpenApiTypes.STR, enum=["json", "csv"]),
]


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
