from __future__ import annotations

from django.conf import settings
from django.db import models
from drf_spectacular.utils import extend_schema_field
from rest_framework import serializers

from contracts.catalog import PRESETS
from contracts.catalog.presets import DEFAULT_PRESET
from contracts.http.api import StrictCharField, StrictFloatField, StrictSlugField
from sessions.jobs import MAX_PRIORITY, MAX_SLO_S
from sessions.models import ChunkRecord, GenerationSession, Job, Prompt, SessionEvent, Tenant
from sessions.selectors import job_result_url

# What this deployment serves, for the schema: the request a client can build from it is accepted.
SERVED = [name for name in sorted(PRESETS) if name in settings.STREAMSERVE["SERVED_MODELS"]]
SERVED_RESOLUTIONS = sorted({r for name in SERVED for r in PRESETS[name].resolutions})
# A session that names no model gets the default preset, or the first served one when it is not served.
DEFAULT_MODEL = DEFAULT_PRESET if DEFAULT_PRESET in SERVED or not SERVED else SERVED[0]


@extend_schema_field(
    {
        "type": "string",
        "pattern": r"^[^\u0000]*\S[^\u0000]*$",
        "maxLength": settings.STREAMSERVE["MAX_PROMPT_CHARS"],
        "description": "not blank; no NUL character",
    }
)
class PromptField(StrictCharField):
    """Validated by ``validate_prompt``; the schema says what it accepts."""


class PromptSerializer(serializers.ModelSerializer):
    class Meta:
        model = Prompt
        fields = ["id", "text", "from_chunk", "created_at"]
        read_only_fields = ["id", "from_chunk", "created_at"]


class PromptCreateSerializer(serializers.Serializer):
    text = PromptField(trim_whitespace=False)


class SessionSerializer(serializers.ModelSerializer):
    owner = serializers.CharField(source="owner.username", read_only=True)
    # Null on rows older than tenants: the default tenant (sessions.models.Tenant).
    tenant = serializers.CharField(source="tenant.name", read_only=True, default="default")
    model = serializers.CharField(source="model_name", read_only=True)
    resolution = serializers.CharField(read_only=True)
    # None while the session runs nowhere (queued, terminated) or holds no state in host memory.
    worker = serializers.CharField(source="worker.name", read_only=True, default=None, allow_null=True)
    host_worker = serializers.CharField(
        source="host_worker.name", read_only=True, default=None, allow_null=True
    )
    prompt = serializers.SerializerMethodField()
    region = serializers.CharField(
        source="region.name",
        read_only=True,
        default=None,
        allow_null=True,
        help_text="null: the local region (not routed)",
    )

    class Meta:
        model = GenerationSession
        fields = [
            "id",
            "owner",
            "tenant",
            "model",
            "resolution",
            "width",
            "height",
            "fps",
            "frames_per_chunk",
            "seed",
            "load",
            "status",
            "activity",
            "state_location",
            "worker",
            "host_worker",
            "origin",
            "region",
            "epoch",
            "chunks_generated",
            "queue_position",
            "prompt",
            "created_at",
            "last_active_at",
            "terminated_at",
        ]
        read_only_fields = fields

    def get_prompt(self, obj: GenerationSession) -> str | None:
        prompt = obj.prompt_at(obj.chunks_generated)
        return prompt.text if prompt else None


@extend_schema_field({"type": "string", "enum": SERVED, "default": DEFAULT_MODEL})
class ServedModelField(serializers.ChoiceField):
    """Any preset is parsed (a known but unserved one gets its own message); the schema lists the served."""


@extend_schema_field({"type": "string", "enum": SERVED_RESOLUTIONS})
class ResolutionField(StrictCharField):
    """``WIDTHxHEIGHT``, checked against the model's resolutions by ``session_spec_build``."""


class SessionCreateSerializer(serializers.Serializer):
    """Field types only; domain validation (catalogue, lengths) lives in ``session_spec_build``."""

    prompt = PromptField(trim_whitespace=False)
    model = ServedModelField(choices=sorted(PRESETS), default=DEFAULT_MODEL)
    resolution = ResolutionField(required=False, allow_blank=False)
    seed = serializers.IntegerField(required=False, min_value=0, max_value=2**63 - 1)
    origin = serializers.CharField(
        required=False,
        max_length=64,
        help_text="the user's origin (a key of a region's rtt_ms); else the ORIGIN_HEADER request header",
    )
    tenant = serializers.SlugField(
        required=False, max_length=64,
        help_text="the tenant to act for (one you belong to); else the TENANT_HEADER request header, else your default tenant",
    )  # fmt: skip


class ChunkRecordSerializer(serializers.ModelSerializer):
    # None once the worker row is gone (the record outlives it).
    worker = serializers.CharField(source="worker.name", read_only=True, default=None, allow_null=True)

    class Meta:
        model = ChunkRecord
        fields = ["chunk_index", "worker", "batch_size", "generation_ms", "delivery_ms", "created_at"]


class ModelPresetSerializer(serializers.Serializer):
    """A model preset of the catalogue (``contracts.catalog.PRESETS``)."""

    name = serializers.CharField()
    description = serializers.CharField()
    fps = serializers.IntegerField()
    frames_per_chunk = serializers.IntegerField()
    resolutions = serializers.ListField(child=serializers.CharField())
    default_resolution = serializers.CharField()
    served = serializers.SerializerMethodField(
        help_text="this deployment runs workers for it (SERVED_MODELS)"
    )
    default = serializers.SerializerMethodField(help_text="what a session that names no model gets")

    def get_served(self, preset) -> bool:
        return preset.name in SERVED

    def get_default(self, preset) -> bool:
        return preset.name == DEFAULT_MODEL


class SessionEventSerializer(serializers.ModelSerializer):
    class Meta:
        model = SessionEvent
        fields = ["id", "kind", "at", "detail"]


class JobSerializer(serializers.ModelSerializer):
    owner = serializers.CharField(source="owner.username", read_only=True)
    # Null on rows older than tenants: the default tenant (sessions.models.Tenant).
    tenant = serializers.CharField(source="tenant.name", read_only=True, default="default")
    model = serializers.CharField(source="model_name", read_only=True)
    resolution = serializers.CharField(read_only=True)
    # Where it runs or is paused; after it ended, where it last ran (None: it never ran).
    worker = serializers.CharField(source="worker.name", read_only=True, default=None, allow_null=True)
    position = serializers.SerializerMethodField(help_text="1-based place in its model's queue while queued")
    result_url = serializers.SerializerMethodField(help_text="the result's download URL once done")

    class Meta:
        model = Job
        fields = [
            "id",
            "owner",
            "tenant",
            "kind",
            "prompt",
            "model",
            "resolution",
            "width",
            "height",
            "frames",
            "steps",
            "seed",
            "priority",
            "slo_s",
            "deadline",
            "state",
            "position",
            "epoch",
            "worker",
            "steps_done",
            "submitted_at",
            "started_at",
            "finished_at",
            "run_s",
            "error",
            "result_content_type",
            "result_url",
        ]
        read_only_fields = fields

    def get_position(self, obj: Job) -> int | None:
        return self.context.get("positions", {}).get(obj.pk)

    def get_result_url(self, obj: Job) -> str | None:
        return job_result_url(obj)


class JobCreateSerializer(serializers.Serializer):
    """Field types only; the rules across fields and against the catalogue live in
    ``sessions.jobs.job_spec_build`` (a video needs frames, the resolution must be the model's,
    slo_s or deadline but not both, the deadline in the future)."""

    kind = serializers.ChoiceField(choices=Job.Kind.choices)
    prompt = PromptField(trim_whitespace=False)
    model = ServedModelField(choices=sorted(PRESETS), default=DEFAULT_MODEL)
    resolution = ResolutionField(required=False, allow_blank=False)
    frames = serializers.IntegerField(
        required=False, min_value=1, max_value=settings.STREAMSERVE["JOB_MAX_FRAMES"],
        help_text="video frames (2 or more); an image is one frame: leave it out",
    )  # fmt: skip
    steps = serializers.IntegerField(
        required=False, min_value=1, max_value=settings.STREAMSERVE["JOB_MAX_STEPS"],
        help_text="denoising steps; default: the model's",
    )  # fmt: skip
    seed = serializers.IntegerField(required=False, min_value=0, max_value=2**63 - 1)
    slo_s = StrictFloatField(
        required=False, min_value=0.001, max_value=MAX_SLO_S,
        help_text="seconds from submission to result; default: JOB_DEFAULT_SLO_S (not with deadline)",
    )  # fmt: skip
    deadline = serializers.DateTimeField(required=False, help_text="absolute deadline (not with slo_s)")
    tenant = serializers.SlugField(
        required=False, max_length=64,
        help_text="the tenant to act for (one you belong to); else the TENANT_HEADER request header, else your default tenant",
    )  # fmt: skip
    priority = serializers.IntegerField(default=0, min_value=0, max_value=MAX_PRIORITY)


class TenantSerializer(serializers.ModelSerializer):
    """A tenant with its weight, priority class and quotas (null: unlimited); members by username."""

    # The name is a JSON string: DRF's CharField turns a number into its text (found by the schema
    # fuzzer: PUT {"name": -123790849466915200} renamed the tenant).
    serializer_field_mapping = {
        **serializers.ModelSerializer.serializer_field_mapping,
        models.CharField: StrictCharField,
        models.SlugField: StrictSlugField,
    }

    weight = StrictFloatField(
        required=False, min_value=1e-6, max_value=1e6, help_text="fair share: weight over the sum of weights"
    )
    gpu_seconds_per_day = StrictFloatField(required=False, allow_null=True, min_value=0, max_value=1e12)
    gpu_seconds_per_month = StrictFloatField(required=False, allow_null=True, min_value=0, max_value=1e12)
    max_live_sessions = serializers.IntegerField(
        required=False, allow_null=True, min_value=0, max_value=2**31 - 1
    )
    max_queued_jobs = serializers.IntegerField(
        required=False, allow_null=True, min_value=0, max_value=2**31 - 1
    )
    members = serializers.SerializerMethodField(help_text="usernames; the default tenant of those marked")

    class Meta:
        model = Tenant
        fields = [
            "id",
            "name",
            "weight",
            "priority_class",
            "gpu_seconds_per_day",
            "gpu_seconds_per_month",
            "max_live_sessions",
            "max_queued_jobs",
            "gpu_quota_enforcement",
            "members",
            "created_at",
        ]
        read_only_fields = ["id", "created_at"]

    @extend_schema_field(
        {
            "type": "array",
            "items": {
                "type": "object",
                "properties": {"username": {"type": "string"}, "is_default": {"type": "boolean"}},
            },
        }
    )
    def get_members(self, tenant: Tenant) -> list[dict]:
        return [
            {"username": m.user.username, "is_default": m.is_default}
            for m in tenant.memberships.select_related("user").order_by("user__username")
        ]


class MembershipSerializer(serializers.Serializer):
    username = StrictCharField(max_length=150)
    is_default = serializers.BooleanField(
        default=False, help_text="make it the tenant they act for by default"
    )
