"""Operator endpoints for the GPU pool and the cost audit (staff only)."""

from __future__ import annotations

import django_filters
from django.db.models import Count, Q
from drf_spectacular.types import OpenApiTypes
from drf_spectacular.utils import extend_schema
from rest_framework import permissions, serializers, viewsets
from rest_framework.decorators import action
from rest_framework.response import Response
from rest_framework.views import APIView

from contracts.http.api import (
    AUDIT_PARAMETERS,
    Conflict,
    StrictFloatField,
    audit_format,
    audit_responses,
    conflict_response,
    csv_cell,
    csv_response,
)
from contracts.http.timerange import parse_time_range
from gpu import selectors, services
from gpu.models import GpuWorker, Region


class RegionSerializer(serializers.ModelSerializer):
    gpu_limits = serializers.DictField(
        child=serializers.IntegerField(min_value=0), help_text="GPU type -> most GPUs the region may hold"
    )
    rtt_ms = serializers.DictField(
        child=StrictFloatField(min_value=0), help_text="user origin -> round-trip time in ms"
    )
    workers = serializers.IntegerField(read_only=True, source="live_workers", help_text="live workers")

    class Meta:
        model = Region
        fields = ["id", "name", "price_multiplier", "gpu_limits", "rtt_ms", "provisioner", "workers"]
        read_only_fields = fields


class RegionViewSet(viewsets.ReadOnlyModelViewSet):
    """Regions: price multiplier, GPU limits and the RTT from each user origin (any signed-in user).

    The local region is listed once an operator gives it a row (it exists without one)."""

    permission_classes = [permissions.IsAuthenticated]
    serializer_class = RegionSerializer
    ordering_fields = ["name"]
    ordering = ["name"]

    def get_queryset(self):
        return selectors.regions_with_live_workers()


class GpuWorkerSerializer(serializers.ModelSerializer):
    region = serializers.SlugRelatedField(
        read_only=True, slug_field="name", allow_null=True, help_text="null: the local region"
    )
    sessions = serializers.IntegerField(read_only=True, source="resident_sessions")
    # Empty until the weights are complete: one of disk, host_cache, peer, init afterwards.
    weights_source = serializers.CharField(
        read_only=True,
        help_text="where the weights came from: disk, host_cache, peer, init; empty while loading",
    )

    class Meta:
        model = GpuWorker
        fields = [
            "id",
            "name",
            "host",
            "device",
            "device_index",
            "gpu_type",
            "memory_bytes",
            "capacity",
            "price_per_hour",
            "model_preset",
            "provider",
            "external_id",
            "status",
            "requested_at",
            "ready_at",
            "released_at",
            "last_heartbeat",
            "utilization_pct",
            "memory_used_bytes",
            "power_watts",
            "temperature_c",
            "telemetry",
            "telemetry_at",
            "sessions",
            "process_up_at",
            "weights_complete_at",
            "weights_source",
            "weights_source_detail",
            "expected_ready_at",
            "weights_plan",
            "region",
            "stage_role",
        ]
        read_only_fields = fields


class GpuWorkerFilter(django_filters.FilterSet):
    class Meta:
        model = GpuWorker
        fields = ["status", "gpu_type", "provider", "model_preset", "stage_role"]


class GpuWorkerViewSet(viewsets.ReadOnlyModelViewSet):
    """GPU workers with their lifecycle and latest telemetry."""

    permission_classes = [permissions.IsAdminUser]
    serializer_class = GpuWorkerSerializer
    filterset_class = GpuWorkerFilter
    ordering_fields = ["name", "requested_at", "status", "gpu_type"]
    ordering = ["name"]

    def get_queryset(self):
        return GpuWorker.objects.select_related("region").annotate(
            resident_sessions=Count("sessions", filter=Q(sessions__status__in=["executing", "migrating"]))
        )

    @extend_schema(
        request=None,
        responses={
            200: GpuWorkerSerializer,
            409: conflict_response("the worker is not ready (still provisioning, released or failed)"),
        },
    )
    @action(detail=True, methods=["post"])
    def drain(self, request, pk=None):
        """Stop placing sessions on this worker; the scheduler moves its residents and releases it.
        Idempotent on a draining worker."""
        worker = self.get_object()
        try:
            services.worker_drain(worker=worker)
        except services.TransitionError as exc:
            raise Conflict(str(exc)) from exc
        return Response(GpuWorkerSerializer(self.get_queryset().get(pk=worker.pk)).data)


class CostAuditView(APIView):
    """GPU-seconds and money over a time range, bucketed, by GPU type and by region (cost ledger)."""

    permission_classes = [permissions.IsAdminUser]

    @extend_schema(parameters=AUDIT_PARAMETERS, responses=audit_responses(OpenApiTypes.OBJECT))
    def get(self, request):
        time_range = parse_time_range(request.query_params)
        output = audit_format(request.query_params)
        services.ledger_accrue()
        if output == "csv":
            rows = [
                [csv_cell(r["bucket"]), r["gpu_type"], r["region"], r["gpu_seconds"], r["cost_usd"]]
                for r in selectors.cost_rows(time_range=time_range)
            ]
            return csv_response(
                "cost.csv", ["bucket_start", "gpu_type", "region", "gpu_seconds", "cost_usd"], rows
            )
        report = selectors.cost_buckets(time_range=time_range)
        return Response(report)


class ParameterPoolView(APIView):
    """Where each model's weights live (serving GPUs, host caches) and the host-copy bound."""

    permission_classes = [permissions.IsAdminUser]

    @extend_schema(responses=OpenApiTypes.OBJECT)
    def get(self, request):
        return Response(
            {"models": selectors.parameter_pool(), "host_copies_bound": services.host_copies_bound()}
        )
