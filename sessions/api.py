"""REST endpoints for sessions: thin views over ``sessions.services`` and ``sessions.selectors``."""

from __future__ import annotations

from django.conf import settings
from django.contrib.auth import get_user_model
from django.core.exceptions import ValidationError as DjangoValidationError
from django.http import FileResponse
from django.utils import timezone
from drf_spectacular.types import OpenApiTypes
from drf_spectacular.utils import OpenApiParameter, extend_schema
from rest_framework import mixins, permissions, status, viewsets
from rest_framework.decorators import action
from rest_framework.exceptions import APIException, NotFound, ValidationError
from rest_framework.response import Response
from rest_framework.views import APIView

from contracts.catalog import PRESETS
from contracts.http.api import (
    AUDIT_PARAMETERS,
    NO_NUL,
    Conflict,
    audit_format,
    audit_responses,
    conflict_response,
    csv_cell,
    csv_response,
    filterset_check,
)
from contracts.http.timerange import parse_time_range
from gpu import services as gpu_services
from sessions import jobs, selectors, services, tenants, usage
from sessions.filters import ChunkRecordFilter, JobFilter, SessionFilter
from sessions.models import GenerationSession, Job, Tenant
from sessions.serializers import (
    ChunkRecordSerializer,
    JobCreateSerializer,
    JobSerializer,
    MembershipSerializer,
    ModelPresetSerializer,
    PromptCreateSerializer,
    PromptSerializer,
    SessionCreateSerializer,
    SessionEventSerializer,
    SessionSerializer,
    TenantSerializer,
)

# What a job's result may be served as inline (PNG for an image, MP4 for a video).
RESULT_CONTENT_TYPES = ("image/png", "video/mp4")
# The latency audit's SLO threshold, as bounded as the scheduler's (scheduling.models.SchedulerConfig).
MAX_SLO_MS = 600_000.0


# The 409 of an action on a session that has ended (``services.SessionTerminated``).
SESSION_TERMINATED = conflict_response("the session is terminated")


class TooManyLiveSessions(APIException):
    status_code = status.HTTP_429_TOO_MANY_REQUESTS
    default_code = "too_many_live_sessions"


class TooManyJobsInFlight(APIException):
    status_code = status.HTTP_429_TOO_MANY_REQUESTS
    default_code = "too_many_jobs_in_flight"


class TenantQuotaExceeded(APIException):
    """A tenant's hard quota is spent (``tenants.QuotaExceeded``): 429 naming the quota, its value,
    what is used and when it resets (also as ``Retry-After`` for a GPU-second quota)."""

    status_code = status.HTTP_429_TOO_MANY_REQUESTS
    default_code = "tenant_quota_exceeded"

    def __init__(self, exc: tenants.QuotaExceeded):
        super().__init__(str(exc))
        # The body as it is: APIException would turn the figures of a dict detail into strings.
        self.detail = {"detail": str(exc), "code": self.default_code, **exc.as_dict()}
        if exc.resets_at is not None:
            # DRF's exception handler turns ``wait`` into the Retry-After header.
            self.wait = max(1, int((exc.resets_at - timezone.now()).total_seconds()))


def _tenant(request, data) -> Tenant:
    """The tenant the request acts for: the body's ``tenant``, else the ``TENANT_HEADER`` header, else
    the user's default; naming one they do not belong to is a 400 on ``tenant``."""
    name = data.validated_data.get("tenant")
    header = settings.STREAMSERVE["TENANT_HEADER"]
    if not name and header:
        name = request.headers.get(header, "")
    try:
        return tenants.tenant_acting_for(user=request.user, name=name or None)
    except DjangoValidationError as exc:
        raise ValidationError(exc.message_dict) from exc


def _origin(request, data) -> str:
    """The body's ``origin``, else the header named by ``ORIGIN_HEADER`` (empty: body only)."""
    if "origin" in data.validated_data:
        return data.validated_data["origin"]
    header = settings.STREAMSERVE["ORIGIN_HEADER"]
    return request.headers.get(header, "") if header else ""


class SessionViewSet(mixins.ListModelMixin, mixins.RetrieveModelMixin, viewsets.GenericViewSet):
    """Generation sessions. Users see only their own (another user's session is a 404); staff see all."""

    serializer_class = SessionSerializer
    filterset_class = SessionFilter
    ordering_fields = ["created_at", "last_active_at", "chunks_generated", "status"]
    ordering = ["-created_at"]

    def filter_queryset(self, queryset):
        # The list filters choose sessions; on one session's routes (its chunks, its events) they
        # would only turn a visible session into a 404.
        return super().filter_queryset(queryset) if self.action == "list" else queryset

    def get_queryset(self):
        if getattr(self, "swagger_fake_view", False):  # schema generation: no user, only the model
            return GenerationSession.objects.none()
        return selectors.sessions_visible_to(self.request.user)

    @extend_schema(request=SessionCreateSerializer, responses={201: SessionSerializer})
    def create(self, request):
        data = SessionCreateSerializer(data=request.data)
        data.is_valid(raise_exception=True)
        spec = services.session_spec_build(
            prompt=data.validated_data["prompt"],
            model_name=data.validated_data["model"],
            resolution=data.validated_data.get("resolution"),
            seed=data.validated_data.get("seed"),
        )
        tenant = _tenant(request, data)
        try:
            session = services.session_create(
                owner=request.user, spec=spec, origin=_origin(request, data), tenant=tenant
            )
        except services.LiveSessionLimit as exc:
            raise TooManyLiveSessions(str(exc)) from exc
        except tenants.QuotaExceeded as exc:
            raise TenantQuotaExceeded(exc) from exc
        return Response(SessionSerializer(session).data, status=status.HTTP_201_CREATED)

    @extend_schema(methods=["GET"], filters=False, responses=PromptSerializer(many=True))
    @extend_schema(
        methods=["POST"],
        request=PromptCreateSerializer,
        responses={201: PromptSerializer, 409: SESSION_TERMINATED},
    )
    # The prompt history is short and read whole: not paginated.
    @action(detail=True, methods=["get", "post"], pagination_class=None)
    def prompts(self, request, pk=None):
        """The prompt history; POST adds a prompt that applies from the next chunk."""
        session = self.get_object()
        if request.method == "GET":
            return Response(PromptSerializer(session.prompts.all(), many=True).data)
        data = PromptCreateSerializer(data=request.data)
        data.is_valid(raise_exception=True)
        try:
            prompt = services.session_prompt_add(session=session, text=data.validated_data["text"])
        except services.SessionTerminated as exc:
            raise Conflict(str(exc)) from exc
        return Response(PromptSerializer(prompt).data, status=status.HTTP_201_CREATED)

    @extend_schema(request=None, responses={200: SessionSerializer, 409: SESSION_TERMINATED})
    @action(detail=True, methods=["post"])
    def pause(self, request, pk=None):
        """The user goes idle: the session may be suspended to host memory."""
        try:
            session = services.session_pause(session=self.get_object())
        except services.SessionTerminated as exc:
            raise Conflict(str(exc)) from exc
        return Response(SessionSerializer(session).data)

    @extend_schema(request=None, responses={200: SessionSerializer, 409: SESSION_TERMINATED})
    @action(detail=True, methods=["post"])
    def resume(self, request, pk=None):
        """The user is back: the session must execute."""
        try:
            session = services.session_resume(session=self.get_object())
        except services.SessionTerminated as exc:
            raise Conflict(str(exc)) from exc
        return Response(SessionSerializer(session).data)

    @extend_schema(request=None, responses=SessionSerializer)
    @action(detail=True, methods=["post"])
    def terminate(self, request, pk=None):
        """End the session (idempotent)."""
        return Response(SessionSerializer(services.session_terminate(session=self.get_object())).data)

    @extend_schema(
        parameters=[
            OpenApiParameter("since_index", {"type": "integer", "minimum": 0, "maximum": 2**31 - 1}),
            OpenApiParameter(
                "worker", {"type": "string", "minLength": 1, "pattern": NO_NUL}, description="worker name"
            ),
            OpenApiParameter("batch_size", {"type": "integer", "minimum": 1, "maximum": 32767}),
        ],
        filters=False,
        responses=ChunkRecordSerializer(many=True),
    )
    @action(detail=True, methods=["get"])
    def chunks(self, request, pk=None):
        """The session's chunk records (generation and delivery latency, worker, batch size)."""
        session = self.get_object()
        records = ChunkRecordFilter(request.query_params, queryset=session.chunks.select_related("worker"))
        filterset_check(records, request.query_params)
        page = self.paginate_queryset(records.qs.order_by("chunk_index"))
        return self.get_paginated_response(ChunkRecordSerializer(page, many=True).data)

    @extend_schema(filters=False, responses=SessionEventSerializer(many=True))
    @action(detail=True, methods=["get"])
    def events(self, request, pk=None):
        """The session's lifecycle events."""
        page = self.paginate_queryset(self.get_object().events.order_by("at", "id"))
        return self.get_paginated_response(SessionEventSerializer(page, many=True).data)


class ModelCatalogView(APIView):
    """The model presets a session can ask for, with their resolutions."""

    @extend_schema(responses=ModelPresetSerializer(many=True))
    def get(self, request):
        return Response(ModelPresetSerializer(PRESETS.values(), many=True).data)


class LatencyAuditView(APIView):
    """Per-chunk generation latency over a time range, bucketed: count, p50, p95, p99, max, SLO pass rate."""

    permission_classes = [permissions.IsAdminUser]

    @extend_schema(
        parameters=[
            *AUDIT_PARAMETERS,
            OpenApiParameter(
                "slo_ms",
                {"type": "number", "minimum": 0, "exclusiveMinimum": True, "maximum": MAX_SLO_MS},
                description="SLO threshold in ms; default: the SLO_MS setting",
            ),
            OpenApiParameter("source", OpenApiTypes.STR, enum=["auto", "raw", "rollup"]),
        ],
        responses=audit_responses(OpenApiTypes.OBJECT),
    )
    def get(self, request):
        time_range = parse_time_range(request.query_params)
        output = audit_format(request.query_params)
        slo = request.query_params.get("slo_ms")
        source = request.query_params.get("source", "auto")
        errors = {}
        if slo is not None:
            try:
                slo = float(slo)
            except ValueError:
                slo = float("nan")
            # NaN fails both comparisons.
            if not 0 < slo <= MAX_SLO_MS:
                errors["slo_ms"] = f"must be a number in (0, {MAX_SLO_MS:g}]"
        if source not in {"auto", "raw", "rollup"}:
            errors["source"] = "must be auto, raw or rollup"
        if errors:
            raise ValidationError(errors)
        report = selectors.latency_buckets(time_range=time_range, slo_ms=slo, source=source)
        if output == "csv":
            # One row per bucket and region, like the cost CSV (rows sum to the totals); percentiles
            # across regions do not combine, so the pool's own per bucket are in the JSON only.
            header = ["bucket_start", "region", "count", "p50_ms", "p95_ms", "p99_ms", "max_ms", "slo_passed"]
            rows = [
                [csv_cell(b["start"]), name, *(csv_cell(r[k]) for k in header[2:])]
                for b in report["buckets"]
                for name, r in sorted(b["by_region"].items())
            ]
            return csv_response("latency.csv", header, rows)
        return Response(report)


class JobViewSet(mixins.ListModelMixin, mixins.RetrieveModelMixin, viewsets.GenericViewSet):
    """One-shot image and video jobs. Users see only their own (another user's job is a 404); staff
    see all."""

    serializer_class = JobSerializer
    filterset_class = JobFilter
    ordering_fields = ["submitted_at", "deadline", "finished_at", "state", "priority"]
    ordering = ["-submitted_at"]

    def filter_queryset(self, queryset):
        # As for sessions: the list filters choose jobs; on one job's routes they would only turn a
        # visible job into a 404.
        return super().filter_queryset(queryset) if self.action == "list" else queryset

    def get_queryset(self):
        if getattr(self, "swagger_fake_view", False):  # schema generation: no user, only the model
            return Job.objects.none()
        return selectors.jobs_visible_to(self.request.user)

    def get_serializer_context(self):
        # Queue positions in one read for the page, not one count per job.
        context = super().get_serializer_context()
        if not getattr(self, "swagger_fake_view", False):
            context["positions"] = selectors.job_queue_positions(list(settings.STREAMSERVE["SERVED_MODELS"]))
        return context

    @extend_schema(request=JobCreateSerializer, responses={201: JobSerializer})
    def create(self, request):
        data = JobCreateSerializer(data=request.data)
        data.is_valid(raise_exception=True)
        fields = data.validated_data
        try:
            spec = jobs.job_spec_build(
                kind=fields["kind"],
                prompt=fields["prompt"],
                model_name=fields["model"],
                resolution=fields.get("resolution"),
                frames=fields.get("frames"),
                steps=fields.get("steps"),
                seed=fields.get("seed"),
                slo_s=fields.get("slo_s"),
                deadline=fields.get("deadline"),
                priority=fields["priority"],
                now=timezone.now(),
            )
        except DjangoValidationError as exc:
            raise ValidationError(exc.message_dict) from exc
        tenant = _tenant(request, data)
        try:
            job = jobs.job_submit(owner=request.user, spec=spec, tenant=tenant)
        except jobs.JobLimit as exc:
            raise TooManyJobsInFlight(str(exc)) from exc
        except tenants.QuotaExceeded as exc:
            raise TenantQuotaExceeded(exc) from exc
        return Response(self.get_serializer(job).data, status=status.HTTP_201_CREATED)

    @extend_schema(request=None, responses=JobSerializer)
    @action(detail=True, methods=["post"])
    def cancel(self, request, pk=None):
        """Cancel the job (idempotent; an ended job stays as it ended)."""
        job = jobs.job_cancel(job=self.get_object())
        return Response(self.get_serializer(job).data)

    @extend_schema(
        filters=False,
        responses={
            (200, "image/png"): OpenApiTypes.BINARY,
            (200, "video/mp4"): OpenApiTypes.BINARY,
            (200, "application/octet-stream"): OpenApiTypes.BINARY,
        },
    )
    @action(detail=True, methods=["get"])
    def result(self, request, pk=None):
        """The result file (PNG for an image, MP4 for a video), through the default storage; 404
        until the job is done."""
        job = self.get_object()
        if job.state != Job.State.DONE or not job.result:
            raise NotFound(f"job {job.pk} has no result ({job.state})")
        # Shown inline only as what a job produces: anything else (a worker's mistake) is a download,
        # never a page of this origin.
        inline = job.result_content_type in RESULT_CONTENT_TYPES
        return FileResponse(
            job.result.open("rb"),
            content_type=job.result_content_type if inline else "application/octet-stream",
            as_attachment=not inline,
            filename=job.result.name.rsplit("/", 1)[-1],
        )


class JobAuditView(APIView):
    """Jobs that ended per time bucket: latency percentiles, wait, SLO attainment (JSON or CSV)."""

    permission_classes = [permissions.IsAdminUser]

    @extend_schema(
        parameters=[*AUDIT_PARAMETERS, OpenApiParameter("kind", OpenApiTypes.STR, enum=Job.Kind.values)],
        responses=audit_responses(OpenApiTypes.OBJECT),
    )
    def get(self, request):
        time_range = parse_time_range(request.query_params)
        output = audit_format(request.query_params)
        kind = request.query_params.get("kind")
        if kind is not None and kind not in Job.Kind.values:
            raise ValidationError({"kind": f"must be one of {', '.join(Job.Kind.values)}"})
        report = selectors.job_audit_buckets(time_range=time_range, kind=kind)
        if output == "csv":
            header = [
                "bucket_start",
                "count",
                "done",
                "slo_met",
                "slo_attainment",
                "latency_p50_s",
                "latency_p95_s",
                "latency_p99_s",
                "latency_max_s",
                "wait_p50_s",
            ]
            rows = [[csv_cell(b["start"]), *(csv_cell(b[k]) for k in header[1:])] for b in report["buckets"]]
            return csv_response("jobs.csv", header, rows)
        return Response(report)


class IsStaffForWrites(permissions.BasePermission):
    """Any signed-in user reads (their own tenants); only staff create, change or manage members."""

    def has_permission(self, request, view):
        if not (request.user and request.user.is_authenticated):
            return False
        return request.method in permissions.SAFE_METHODS or request.user.is_staff


USAGE_REPORT = {
    "type": "object",
    "description": "per bucket: by_tenant {stream_gpu_seconds, job_gpu_seconds, gpu_seconds, cost_usd}; "
    "on the pool's audit also ledger and pool_overhead (ledger − charged)",
}


class TenantViewSet(
    mixins.ListModelMixin,
    mixins.RetrieveModelMixin,
    mixins.CreateModelMixin,
    mixins.UpdateModelMixin,
    viewsets.GenericViewSet,
):
    """Tenants (teams sharing the pool): weight, priority class, quotas, members. Staff see and change
    every tenant; a member sees the tenants they belong to (another tenant is a 404) and their usage.
    """

    serializer_class = TenantSerializer
    permission_classes = [IsStaffForWrites]
    ordering_fields = ["name", "weight", "created_at"]
    ordering = ["name"]

    def get_queryset(self):
        if getattr(self, "swagger_fake_view", False):
            return Tenant.objects.none()
        return tenants.tenants_visible_to(self.request.user)

    @extend_schema(
        methods=["POST"], request=MembershipSerializer, responses={200: TenantSerializer}, filters=False
    )
    @extend_schema(
        methods=["DELETE"],
        parameters=[OpenApiParameter("username", OpenApiTypes.STR, required=True)],
        request=None,
        responses={200: TenantSerializer},
        filters=False,
    )
    @action(detail=True, methods=["post", "delete"])
    def members(self, request, pk=None):
        """POST adds a member (``is_default``: their default tenant); DELETE ``?username=`` removes one."""
        tenant = self.get_object()
        if request.method == "POST":
            data = MembershipSerializer(data=request.data)
            data.is_valid(raise_exception=True)
            user = _user_named(data.validated_data["username"], "username")
            tenants.membership_add(tenant=tenant, user=user, is_default=data.validated_data["is_default"])
        else:
            user = _user_named(request.query_params.get("username", ""), "username")
            if not tenants.membership_remove(tenant=tenant, user=user):
                raise ValidationError({"username": f"{user.username!r} is not a member of {tenant.name!r}"})
        return Response(TenantSerializer(tenant).data)

    @extend_schema(parameters=AUDIT_PARAMETERS, responses=audit_responses(USAGE_REPORT), filters=False)
    @action(detail=True, methods=["get"])
    def usage(self, request, pk=None):
        """The tenant's GPU-seconds and money per bucket (streams' chunks, batch-aware, and jobs), its
        quotas and where it stands against them; ``?format=csv`` for chargeback."""
        tenant = self.get_object()
        time_range = parse_time_range(request.query_params)
        output = audit_format(request.query_params)
        report = usage.usage_buckets(time_range=time_range, tenant=tenant)
        if output == "csv":
            rows = [[csv_cell(c) for c in row] for row in usage.usage_csv_rows(report)]
            return csv_response(f"usage-{tenant.name}.csv", usage.USAGE_CSV_HEADER, rows)
        return Response({"tenant": tenant.name, **report, "quotas": tenants.quota_report(tenant=tenant)})


def _user_named(username: str, field: str):
    user = get_user_model().objects.filter(username=username).first() if username else None
    if user is None:
        raise ValidationError({field: f"no user named {username!r}"})
    return user


class TenantUsageAuditView(APIView):
    """GPU-seconds and money per bucket for every tenant, the ledger's figures and the pool's
    overhead (boot, load, idle: ledger − charged); ``?format=csv`` gives one row per bucket and
    tenant plus the overhead's."""

    permission_classes = [permissions.IsAdminUser]

    @extend_schema(parameters=AUDIT_PARAMETERS, responses=audit_responses(USAGE_REPORT))
    def get(self, request):
        time_range = parse_time_range(request.query_params)
        output = audit_format(request.query_params)
        gpu_services.ledger_accrue()
        report = usage.usage_buckets(time_range=time_range)
        if output == "csv":
            rows = [[csv_cell(c) for c in row] for row in usage.usage_csv_rows(report)]
            return csv_response("tenants-usage.csv", usage.USAGE_CSV_HEADER, rows)
        return Response(report)
