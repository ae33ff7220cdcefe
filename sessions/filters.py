from __future__ import annotations

import django_filters

from sessions.models import ChunkRecord, GenerationSession


class SessionFilter(django_filters.FilterSet):
    model = django_filters.CharFilter(field_name="model_name")
    created_after = django_filters.IsoDateTimeFilter(field_name="created_at", lookup_expr="gte")
    created_before = django_filters.IsoDateTimeFilter(field_name="created_at", lookup_expr="lt")
    owner = django_filters.CharFilter(field_name="owner__username")

    class Meta:
        model = GenerationSession
        fields = ["status", "activity", "state_location", "model"]


class ChunkRecordFilter(django_filters.FilterSet):
    since_index = django_filters.NumberFilter(field_name="chunk_index", lookup_expr="gte")
    worker = django_filters.CharFilter(field_name="worker__name")

    class Meta:
        model = ChunkRecord
        fields = ["batch_size"]
