from __future__ import annotations

import django_filters
from django import forms

from contracts.http.timerange import UtcIsoDateTimeFilter
from sessions.models import ChunkRecord, GenerationSession, Job


class SessionFilter(django_filters.FilterSet):
    model = django_filters.CharFilter(field_name="model_name")
    created_after = UtcIsoDateTimeFilter(field_name="created_at", lookup_expr="gte")
    created_before = UtcIsoDateTimeFilter(field_name="created_at", lookup_expr="lt")
    owner = django_filters.CharFilter(field_name="owner__username")

    class Meta:
        model = GenerationSession
        fields = ["status", "activity", "state_location", "model"]


class IntegerFilter(django_filters.NumberFilter):
    """A whole number: ``NumberFilter``'s form field is a DecimalField, which accepts ``0.6``."""

    field_class = forms.IntegerField


class ChunkRecordFilter(django_filters.FilterSet):
    since_index = IntegerFilter(field_name="chunk_index", lookup_expr="gte", min_value=0, max_value=2**31 - 1)
    worker = django_filters.CharFilter(field_name="worker__name")
    batch_size = IntegerFilter(min_value=1, max_value=32767)

    class Meta:
        model = ChunkRecord
        fields = ["since_index", "worker", "batch_size"]


class JobFilter(django_filters.FilterSet):
    model = django_filters.CharFilter(field_name="model_name")
    submitted_after = UtcIsoDateTimeFilter(field_name="submitted_at", lookup_expr="gte")
    submitted_before = UtcIsoDateTimeFilter(field_name="submitted_at", lookup_expr="lt")

    class Meta:
        model = Job
        fields = ["state", "kind", "model"]
