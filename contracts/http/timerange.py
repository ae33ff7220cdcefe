"""Instants and time ranges from query parameters (the list filters and the audit endpoints).

Every instant an API accepts is normalised to UTC before it reaches the database: ISO-8601 allows
UTC offsets up to ±23:59, PostgreSQL stores displacements only up to ±15:59 and answers the rest
with ``DataError: time zone displacement out of range`` (a 500). An instant whose UTC form falls
outside the representable years (``0001-01-01T00:00+05:00``) is clamped to the nearest representable
one: no stored row lies beyond either end, so a ``>=``/``<`` comparison gives the same rows.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import UTC, datetime, timedelta

import django_filters
from django.utils import timezone
from django.utils.dateparse import parse_datetime
from django_filters.fields import IsoDateTimeField
from rest_framework.exceptions import ValidationError

BUCKETS = {"minute": timedelta(minutes=1), "hour": timedelta(hours=1), "day": timedelta(days=1)}
MAX_BUCKETS = 10_000
EARLIEST = datetime.min.replace(tzinfo=UTC)
LATEST = datetime.max.replace(tzinfo=UTC)


def as_utc(value: datetime) -> datetime:
    """The same instant in UTC (naive: read as UTC), clamped to the representable range."""
    if timezone.is_naive(value):
        return value.replace(tzinfo=UTC)
    try:
        return value.astimezone(UTC)
    except OverflowError:
        # Only year 1 with a positive offset or year 9999 with a negative one overflows.
        return EARLIEST if value.year == datetime.min.year else LATEST


class UtcIsoDateTimeField(IsoDateTimeField):
    def to_python(self, value):
        parsed = super().to_python(value)
        return as_utc(parsed) if parsed is not None else None


class UtcIsoDateTimeFilter(django_filters.IsoDateTimeFilter):
    """``IsoDateTimeFilter`` whose value reaches the query in UTC (see the module docstring)."""

    field_class = UtcIsoDateTimeField


@dataclass(frozen=True)
class TimeRange:
    start: datetime
    end: datetime
    bucket: str

    @property
    def step(self) -> timedelta:
        return BUCKETS[self.bucket]


def _parse_instant(raw: str, field: str) -> datetime:
    # A literal "+" in a query string arrives as a space when the client did not escape it.
    try:
        value = parse_datetime(raw.replace(" ", "+"))
    except ValueError:  # well-formed but impossible: month 13, offset ±24:00
        value = None
    if value is None:
        raise ValidationError({field: f"must be an ISO-8601 date-time, got {raw!r}"})
    return as_utc(value)


def parse_time_range(params, *, default_span: timedelta = timedelta(hours=1), default_bucket: str = "minute"):
    """start/end (ISO-8601, default: the last hour) and bucket (minute|hour|day); 400 on bad input."""
    end = _parse_instant(params["end"], "end") if "end" in params else timezone.now()
    start = _parse_instant(params["start"], "start") if "start" in params else end - default_span
    bucket = params.get("bucket", default_bucket)
    if bucket not in BUCKETS:
        raise ValidationError({"bucket": f"must be one of {', '.join(BUCKETS)}, got {bucket!r}"})
    if start >= end:
        raise ValidationError({"end": "must be after start"})
    if (end - start) / BUCKETS[bucket] > MAX_BUCKETS:
        raise ValidationError(
            {"bucket": f"the range holds more than {MAX_BUCKETS} {bucket} buckets; use a larger bucket"}
        )
    return TimeRange(start=start, end=end, bucket=bucket)
