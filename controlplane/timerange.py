"""Parsing of the audit endpoints' time-range query parameters (shared by the apps' audit views)."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime, timedelta

from django.utils import timezone
from django.utils.dateparse import parse_datetime
from rest_framework.exceptions import ValidationError

BUCKETS = {"minute": timedelta(minutes=1), "hour": timedelta(hours=1), "day": timedelta(days=1)}
MAX_BUCKETS = 10_000


@dataclass(frozen=True)
class TimeRange:
    start: datetime
    end: datetime
    bucket: str

    @property
    def step(self) -> timedelta:
        return BUCKETS[self.bucket]


def _parse_instant(raw: str, field: str) -> datetime:
    value = parse_datetime(raw.replace(" ", "+")) if raw else None
    if value is None:
        raise ValidationError({field: f"must be an ISO-8601 date-time, got {raw!r}"})
    if timezone.is_naive(value):
        value = timezone.make_aware(value, timezone.UTC)
    return value


def parse_time_range(params, *, default_span: timedelta = timedelta(hours=1), default_bucket: str = "minute"):
    """start/end (ISO-8601, default: the last hour) and bucket (minute|hour|day); 400 on bad input."""
    now = timezone.now()
    end = _parse_instant(params["end"], "end") if params.get("end") else now
    start = _parse_instant(params["start"], "start") if params.get("start") else end - default_span
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
