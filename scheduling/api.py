"""Operator endpoints for scheduling history and configuration (staff only)."""

from __future__ import annotations

from datetime import timedelta

import django_filters
from django.db import models
from django.shortcuts import get_object_or_404
from drf_spectacular.types import OpenApiTypes
from drf_spectacular.utils import OpenApiParameter, extend_schema
from rest_framework import generics, permissions, serializers, status, viewsets
from rest_framework.exceptions import ValidationError
from rest_framework.response import Response
from rest_framework.views import APIView

from contracts.http.api import (
    AUDIT_PARAMETERS,
    NO_NUL,
    Conflict,
    StrictCharField,
    StrictFloatField,
    audit_format,
    audit_responses,
    conflict_response,
    csv_cell,
    csv_response,
)
from contracts.http.timerange import UtcIsoDateTimeFilter, parse_time_range
from gpu.models import GpuWorker
from scheduling import selectors
from scheduling.core.policy import PolicyError, resolve_policy_class
from scheduling.live.operator import MigrationRefused, migration_request
from scheduling.models import Migration, ScalingAction, SchedulerConfig, SchedulerDecision, StagePlacement
from sessions.models import GenerationSession


class SchedulerDecisionSerializer(serializers.ModelSerializer):
    class Meta:
        model = SchedulerDecision
        fields = [
            "id",
            "trigger",
            "session",
            "decided_at",
            "policy",
            "active_sessions",
            "budget",
            "rho_max",
            "volatility",
            "volatility_level",
            "lambda_weight",
            "rho_hat",
            "target_budget",
            "placements_changed",
            "duration_ms",
            "inputs",
            "outputs",
        ]


class MigrationSerializer(serializers.ModelSerializer):
    source = serializers.CharField(source="source.name", read_only=True)
    target = serializers.CharField(source="target.name", read_only=True)
    # A cross-region move's regions (null: not a cross-region move, or the local region).
    source_region = serializers.CharField(source="source_region.name", read_only=True, allow_null=True)
    target_region = serializers.CharField(source="target_region.name", read_only=True, allow_null=True)

    class Meta:
        model = Migration
        fields = [
            "id",
            "session",
            "source",
            "target",
            "decision",
            "epoch",
            "state_bytes",
            "reason",
            "outcome",
            "error",
            "started_at",
            "finished_at",
            "duration_ms",
            "cross_region",
            "source_region",
            "target_region",
            "estimated_saving_ms",
            "switch_cost_ms",
        ]


class ScalingActionSerializer(serializers.ModelSerializer):
    workers = serializers.SlugRelatedField(slug_field="name", many=True, read_only=True)

    class Meta:
        model = ScalingAction
        fields = [
            "id",
            "decision",
            "created_at",
            "direction",
            "from_budget",
            "to_budget",
            "gpu_type",
            "reason",
            "outcome",
            "provisioner_result",
            "workers",
            "plan",
            "expected_ready_at",
            "ready_at",
            "phases",
        ]


class SchedulerConfigSerializer(serializers.ModelSerializer):
    serializer_field_mapping = {
        **serializers.ModelSerializer.serializer_field_mapping,
        models.CharField: StrictCharField,
        models.FloatField: StrictFloatField,
    }

    class Meta:
        model = SchedulerConfig
        fields = [
            "policy",
            "min_gpus",
            "max_gpus",
            "target_utilization",
            "slo_ms",
            "queue_max",
            "scale_in_cooldown_s",
            "updated_at",
        ]
        read_only_fields = ["updated_at"]

    # Single-field bounds come from the model's validators (and so appear in the schema).
    def validate_policy(self, value):
        try:
            resolve_policy_class(value)
        except (PolicyError, ImportError, AttributeError, ValueError) as exc:
            raise serializers.ValidationError(str(exc)) from exc
        return value

    def validate(self, attrs):
        lo = attrs.get("min_gpus", getattr(self.instance, "min_gpus", 0))
        hi = attrs.get("max_gpus", getattr(self.instance, "max_gpus", 0))
        if lo > hi:
            raise serializers.ValidationError({"max_gpus": f"must be at least min_gpus ({lo})"})
        return attrs


class TimeWindowFilter(django_filters.FilterSet):
    after = UtcIsoDateTimeFilter(method="filter_after")
    before = UtcIsoDateTimeFilter(method="filter_before")
    time_field = "created_at"

    def filter_after(self, qs, name, value):
        return qs.filter(**{f"{self.time_field}__gte": value})

    def filter_before(self, qs, name, value):
        return qs.filter(**{f"{self.time_field}__lt": value})


class DecisionFilter(TimeWindowFilter):
    time_field = "decided_at"

    class Meta:
        model = SchedulerDecision
        fields = ["trigger", "policy"]


class MigrationFilter(TimeWindowFilter):
    time_field = "started_at"
    # By id, not by choice among existing rows: an unknown session lists nothing (not a 400).
    session = django_filters.UUIDFilter(field_name="session_id")

    class Meta:
        model = Migration
        fields = ["outcome", "reason", "session"]


class ScalingActionFilter(TimeWindowFilter):
    class Meta:
        model = ScalingAction
        fields = ["direction", "outcome", "gpu_type"]


class SchedulerDecisionViewSet(viewsets.ReadOnlyModelViewSet):
    """Every scheduler run with the signals behind it (ρ_max, volatility level, λ, ρ̂) and its outputs."""

    permission_classes = [permissions.IsAdminUser]
    queryset = SchedulerDecision.objects.all()
    serializer_class = SchedulerDecisionSerializer
    filterset_class = DecisionFilter
    ordering_fields = ["decided_at", "duration_ms", "placements_changed"]


class MigrationViewSet(viewsets.ReadOnlyModelViewSet):
    """Session-state migrations between workers with their outcome and duration."""

    permission_classes = [permissions.IsAdminUser]
    queryset = Migration.objects.select_related("source", "target", "source_region", "target_region")
    serializer_class = MigrationSerializer
    filterset_class = MigrationFilter
    ordering_fields = ["started_at", "duration_ms", "state_bytes"]


class ScalingActionViewSet(viewsets.ReadOnlyModelViewSet):
    """GPU budget changes and what the provisioner did."""

    permission_classes = [permissions.IsAdminUser]
    queryset = ScalingAction.objects.prefetch_related("workers")
    serializer_class = ScalingActionSerializer
    filterset_class = ScalingActionFilter
    ordering_fields = ["created_at"]


class SchedulerConfigView(generics.RetrieveUpdateAPIView):
    """The live scheduler's policy, GPU bounds, target utilisation (empty: adaptive) and SLO."""

    permission_classes = [permissions.IsAdminUser]
    serializer_class = SchedulerConfigSerializer

    def get_object(self):
        return SchedulerConfig.load()


class MigrateSerializer(serializers.Serializer):
    target = StrictCharField(help_text="name of a ready worker", max_length=100)

    def validate_target(self, value):
        # A name no worker has is bad input (400 on the field); an existing worker that cannot take
        # the session now is a state conflict (409, from ``migration_request``).
        if not GpuWorker.objects.filter(name=value).exists():
            raise serializers.ValidationError(f"no worker is named {value!r}")
        return value


class SessionMigrateView(generics.GenericAPIView):
    """Staff: move an executing session to another worker now (at its next chunk boundary)."""

    permission_classes = [permissions.IsAdminUser]
    serializer_class = MigrateSerializer
    queryset = GenerationSession.objects.all()

    @extend_schema(
        request=MigrateSerializer,
        responses={
            202: OpenApiTypes.OBJECT,
            409: conflict_response(
                "the session is not executing, or the target is not a ready worker of the session's "
                "model other than its own"
            ),
        },
        tags=["sessions"],
    )
    def post(self, request, pk):
        session = get_object_or_404(GenerationSession, pk=pk)
        data = MigrateSerializer(data=request.data)
        data.is_valid(raise_exception=True)
        try:
            migration = migration_request(
                session_id=str(session.pk), target_name=data.validated_data["target"]
            )
        except MigrationRefused as exc:
            raise Conflict(str(exc)) from exc
        return Response(
            {"migration": migration.pk, "epoch": migration.epoch}, status=status.HTTP_202_ACCEPTED
        )


# One CSV row per worker role change, with its placement's columns repeated.
PLACEMENT_CSV_HEADER = [
    "placement_id",
    "created_at",
    "finished_at",
    "preset",
    "reason",
    "placement_status",
    "worker",
    "from_role",
    "to_role",
    "order",
    "change_status",
    "change_reason",
    "load_ms",
    "sent_at",
    "answered_at",
    "throughput_e_per_s",
    "throughput_d_per_s",
    "throughput_c_per_s",
    "backlog",
]


def _placement_csv_rows(report: dict) -> list[list[str]]:
    rows = []
    for p in report["placements"]:
        figures = p["trigger"] if isinstance(p["trigger"], dict) else {}
        rates = figures.get("throughputs_per_s") or {}
        head = [p["id"], p["created_at"], p["finished_at"], p["preset"], p["reason"], p["status"]]
        tail = [rates.get("E"), rates.get("D"), rates.get("C"), figures.get("backlog")]
        for c in p["changes"]:
            body = [c["worker"], c["from_role"], c["to_role"], c["order"], c["status"], c["reason"]]
            body += [c["load_ms"], c["sent_at"], c["answered_at"]]
            rows.append([csv_cell(v) for v in (*head, *body, *tail)])
    return rows


class StagePlacementAuditView(APIView):
    """Stage placements and re-placements (TridentServe, docs/stages.md) in a time range: each worker's
    role change with its outcome, and the trigger's figures (JSON, or one CSV row per change)."""

    permission_classes = [permissions.IsAdminUser]

    @extend_schema(
        parameters=[
            OpenApiParameter("start", OpenApiTypes.DATETIME, description="ISO-8601; default: end − 1 day"),
            OpenApiParameter("end", OpenApiTypes.DATETIME, description="ISO-8601; default: now"),
            OpenApiParameter("format", OpenApiTypes.STR, enum=["json", "csv"]),
            OpenApiParameter(
                "preset",
                {"type": "string", "minLength": 1, "maxLength": 64, "pattern": NO_NUL},
                description="model preset",
            ),
            OpenApiParameter("status", OpenApiTypes.STR, enum=StagePlacement.Status.values),
        ],
        responses=audit_responses(OpenApiTypes.OBJECT),
    )
    def get(self, request):
        params = request.query_params
        time_range = parse_time_range(params, default_span=timedelta(days=1), default_bucket="day")
        output = audit_format(params)
        preset = params.get("preset")
        if preset is not None and (not 1 <= len(preset) <= 64 or "\x00" in preset):
            raise ValidationError({"preset": "must be a model preset name (1 to 64 characters)"})
        placement_status = params.get("status")
        if placement_status is not None and placement_status not in StagePlacement.Status.values:
            raise ValidationError({"status": f"must be one of {', '.join(StagePlacement.Status.values)}"})
        report = selectors.stage_placement_audit(
            time_range=time_range, preset=preset, status=placement_status
        )
        if output == "csv":
            return csv_response("placements.csv", PLACEMENT_CSV_HEADER, _placement_csv_rows(report))
        return Response(report)


class RegionMovesAuditView(APIView):
    """Cross-region moves of running sessions over a time range, bucketed, by region: moves out (how
    many succeeded, the rule's estimated saving and switching cost) and moves in."""

    permission_classes = [permissions.IsAdminUser]

    @extend_schema(parameters=AUDIT_PARAMETERS, responses=audit_responses(OpenApiTypes.OBJECT))
    def get(self, request):
        time_range = parse_time_range(request.query_params)
        output = audit_format(request.query_params)
        if output == "csv":
            header = ["bucket_start", "region", *selectors.REGION_MOVE_CSV_FIELDS]
            rows = [
                [csv_cell(r["bucket"]), r["region"], *(csv_cell(r[k]) for k in header[2:])]
                for r in selectors.region_move_rows(time_range=time_range)
            ]
            return csv_response("region-moves.csv", header, rows)
        return Response(selectors.region_moves_audit(time_range=time_range))
