"""Generation sessions, their prompt history, lifecycle events and per-chunk records."""

from __future__ import annotations

import uuid

from django.conf import settings
from django.contrib.postgres.fields import ArrayField
from django.contrib.postgres.indexes import BrinIndex
from django.db import models
from django.db.models import Q

from scheduling.core.types import EventKind


class Tenant(models.Model):
    """A team sharing the pool: its members, its fair share (``weight``) and its quotas (issue 29).

    Every session and job carries the tenant its user acted for (``sessions.tenants``); a null
    tenant on an older row means the default tenant (``DEFAULT_NAME``), as a null region means the
    local one. Quotas left empty are unlimited. The GPU-second quotas are counted in GPU-seconds
    charged to the tenant (``sessions.usage``) since the start of the UTC day or month; a ``hard``
    quota refuses new work once spent (HTTP 429), a ``soft`` one lets its work run on spare capacity
    only (the scheduler places it last and never scales out for it). Count quotas are always hard.
    """

    DEFAULT_NAME = "default"

    class PriorityClass(models.TextChoices):
        INTERACTIVE = "interactive", "interactive streams"
        ONESHOT = "oneshot", "one-shot jobs"
        BATCH = "batch", "batch"

    class Enforcement(models.TextChoices):
        HARD = "hard"
        SOFT = "soft"

    name = models.SlugField(max_length=64, unique=True)
    weight = models.FloatField(
        default=1.0, help_text="fair share: a tenant's share of the pool is its weight over the sum"
    )
    priority_class = models.CharField(
        max_length=16, choices=PriorityClass.choices, default=PriorityClass.INTERACTIVE
    )
    gpu_seconds_per_day = models.FloatField(null=True, blank=True, help_text="empty: unlimited")
    gpu_seconds_per_month = models.FloatField(null=True, blank=True, help_text="empty: unlimited")
    max_live_sessions = models.PositiveIntegerField(null=True, blank=True, help_text="empty: unlimited")
    max_queued_jobs = models.PositiveIntegerField(null=True, blank=True, help_text="empty: unlimited")
    gpu_quota_enforcement = models.CharField(
        max_length=8, choices=Enforcement.choices, default=Enforcement.HARD
    )
    members = models.ManyToManyField(
        settings.AUTH_USER_MODEL, through="TenantMembership", related_name="tenants", blank=True
    )
    created_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        ordering = ["name"]
        constraints = [
            models.CheckConstraint(name="tenant_weight_positive", condition=Q(weight__gt=0)),
            models.CheckConstraint(
                name="tenant_gpu_quotas_nonnegative",
                condition=(Q(gpu_seconds_per_day__isnull=True) | Q(gpu_seconds_per_day__gte=0))
                & (Q(gpu_seconds_per_month__isnull=True) | Q(gpu_seconds_per_month__gte=0)),
            ),
        ]

    def __str__(self) -> str:
        return self.name


class TenantMembership(models.Model):
    """A user belongs to a tenant; ``is_default`` marks the one they act for unless they name another."""

    tenant = models.ForeignKey(Tenant, on_delete=models.CASCADE, related_name="memberships")
    user = models.ForeignKey(
        settings.AUTH_USER_MODEL, on_delete=models.CASCADE, related_name="tenant_memberships"
    )
    is_default = models.BooleanField(default=False)
    created_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        ordering = ["tenant__name", "user_id"]
        constraints = [
            models.UniqueConstraint(fields=["tenant", "user"], name="membership_once_per_tenant"),
            # One default per user: the tenant they act for when they name none.
            models.UniqueConstraint(
                fields=["user"], condition=Q(is_default=True), name="membership_one_default_per_user"
            ),
        ]

    def __str__(self) -> str:
        return f"{self.user_id} in {self.tenant_id}{' (default)' if self.is_default else ''}"


class GenerationSession(models.Model):
    """A user's long-lived streaming generation session.

    Lifecycle: queued → executing ⇄ suspended → terminated (+ migrating transiently).
    ``activity`` is the user-activity indicator α of TurboServe §5.1: an active session must execute.
    """

    class Status(models.TextChoices):
        QUEUED = "queued"
        EXECUTING = "executing"
        SUSPENDED = "suspended"
        MIGRATING = "migrating"
        TERMINATED = "terminated"

    class StateLocation(models.TextChoices):
        WORKER = "worker", "GPU worker"
        HOST = "host", "host memory"
        CHECKPOINT = "checkpoint", "checkpoint on disk"
        NONE = "none", "none"

    class Activity(models.TextChoices):
        ACTIVE = "active"
        IDLE = "idle"

    id = models.UUIDField(primary_key=True, default=uuid.uuid4, editable=False)
    owner = models.ForeignKey(
        settings.AUTH_USER_MODEL, on_delete=models.CASCADE, related_name="generation_sessions"
    )
    tenant = models.ForeignKey(
        Tenant, null=True, blank=True, on_delete=models.PROTECT, related_name="sessions",
        help_text="the tenant its user acted for (null: the default tenant)",
    )  # fmt: skip
    model_name = models.CharField(max_length=64)
    width = models.PositiveIntegerField()
    height = models.PositiveIntegerField()
    fps = models.PositiveSmallIntegerField()
    frames_per_chunk = models.PositiveSmallIntegerField()
    seed = models.BigIntegerField()
    load = models.FloatField(default=1.0, help_text="relative per-chunk cost used by the scheduler")
    status = models.CharField(max_length=16, choices=Status.choices, default=Status.QUEUED)
    activity = models.CharField(max_length=8, choices=Activity.choices, default=Activity.ACTIVE)
    state_location = models.CharField(
        max_length=12, choices=StateLocation.choices, default=StateLocation.NONE
    )
    worker = models.ForeignKey(
        "gpu.GpuWorker", null=True, blank=True, on_delete=models.PROTECT, related_name="sessions"
    )
    # The user's origin (a key of the regions' RTT rows; empty: unknown) and the region routed to
    # (null: the local region; scheduling.live.regions sets it on arrival).
    origin = models.CharField(max_length=64, blank=True, default="")
    region = models.ForeignKey(
        "gpu.Region", null=True, blank=True, on_delete=models.PROTECT, related_name="sessions"
    )
    # The worker whose host memory holds the suspended state (it may differ from ``worker``).
    host_worker = models.ForeignKey(
        "gpu.GpuWorker", null=True, blank=True, on_delete=models.PROTECT, related_name="parked_sessions"
    )
    # Ownership epoch: bumped on every placement change, so stale worker reports are ignored.
    epoch = models.PositiveIntegerField(default=0)
    # The last chunk index a worker published (−1: none). After a restart from a checkpoint the
    # worker regenerates silently up to here, so no index is ever delivered twice.
    delivered_index = models.IntegerField(default=-1)
    chunks_generated = models.PositiveIntegerField(default=0)
    queue_position = models.PositiveIntegerField(null=True, blank=True)
    created_at = models.DateTimeField(auto_now_add=True)
    last_active_at = models.DateTimeField(null=True, blank=True)
    terminated_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        ordering = ["-created_at"]
        indexes = [
            models.Index(fields=["owner", "-created_at"]),
            models.Index(fields=["status"]),
        ]
        constraints = [
            models.CheckConstraint(
                name="session_terminated_has_no_worker",
                condition=~Q(status="terminated")
                | (Q(worker__isnull=True) & Q(host_worker__isnull=True) & Q(state_location="none")),
            ),
            models.CheckConstraint(
                name="session_terminated_has_time",
                condition=~Q(status="terminated") | Q(terminated_at__isnull=False),
            ),
            models.CheckConstraint(
                name="session_executing_has_worker",
                condition=~Q(status__in=["executing", "migrating"]) | Q(worker__isnull=False),
            ),
            models.CheckConstraint(
                name="session_state_on_worker_has_worker",
                condition=~Q(state_location="worker") | Q(worker__isnull=False),
            ),
            models.CheckConstraint(
                name="session_state_on_host_has_host",
                condition=~Q(state_location="host") | Q(host_worker__isnull=False),
            ),
            models.CheckConstraint(
                name="session_queue_position_only_when_queued",
                condition=Q(status="queued") | Q(queue_position__isnull=True),
            ),
            models.CheckConstraint(name="session_load_positive", condition=Q(load__gt=0)),
            models.CheckConstraint(
                name="session_geometry_positive", condition=Q(width__gt=0, height__gt=0, fps__gt=0)
            ),
        ]

    def __str__(self) -> str:
        return f"session {self.id} ({self.status})"

    @property
    def resolution(self) -> str:
        return f"{self.width}x{self.height}"

    @property
    def is_terminated(self) -> bool:
        return self.status == self.Status.TERMINATED

    def prompt_at(self, chunk_index: int) -> Prompt | None:
        """The prompt that applies to ``chunk_index``: the latest one starting at or before it."""
        return self.prompts.filter(from_chunk__lte=chunk_index).order_by("-from_chunk", "-id").first()


class Prompt(models.Model):
    """One entry of a session's prompt history: ``text`` applies from ``from_chunk`` on."""

    session = models.ForeignKey(GenerationSession, on_delete=models.CASCADE, related_name="prompts")
    text = models.TextField()
    from_chunk = models.PositiveIntegerField()
    created_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        ordering = ["from_chunk", "id"]
        indexes = [models.Index(fields=["session", "from_chunk"])]
        constraints = [
            models.CheckConstraint(name="prompt_not_empty", condition=~Q(text="")),
        ]

    def __str__(self) -> str:
        return f"{self.session_id}@{self.from_chunk}: {self.text[:40]}"


class SessionEvent(models.Model):
    """A lifecycle event: the workload detector's input and the source of trace export."""

    class Kind(models.TextChoices):
        # What the user did: the platform's event vocabulary (each one wakes the scheduler).
        ARRIVE = EventKind.ARRIVE.value
        ACTIVE = EventKind.ACTIVE.value
        IDLE = EventKind.IDLE.value
        DEPART = EventKind.DEPART.value
        PROMPT = EventKind.PROMPT.value
        # What the platform did to the session: one kind per lifecycle transition (sessions.lifecycle).
        PLACE = "place", "placed on a worker"
        RESTART = "restart", "restarted from checkpoint"
        SUSPEND = "suspend", "suspended to host memory"
        QUEUE = "queue", "queued for GPU memory"
        MIGRATE = "migrate", "migration started"
        MIGRATED = "migrated", "migration completed"
        MIGRATE_FAILED = "migrate_failed", "migration failed"
        HANDOFF = "handoff", "parked state handed to another host"
        REQUEUE = "requeue", "placement refused by the worker"
        RECOVER = "recover", "worker lost"

    session = models.ForeignKey(GenerationSession, on_delete=models.CASCADE, related_name="events")
    kind = models.CharField(max_length=16, choices=Kind.choices)
    at = models.DateTimeField(db_index=True)
    detail = models.JSONField(default=dict, blank=True)

    class Meta:
        ordering = ["at", "id"]
        indexes = [models.Index(fields=["session", "at"])]

    def __str__(self) -> str:
        return f"{self.session_id} {self.kind} @ {self.at:%H:%M:%S}"


class ChunkRecord(models.Model):
    """One generated chunk: the audit plane's raw latency record.

    Append-only and time-ordered, hundreds of rows per second on a busy cluster. Indexes:
    the unique (session, chunk_index) serves per-session listings and forbids duplicates;
    a BRIN index on ``created_at`` serves time-range scans at a tiny fraction of a B-tree's size
    (rows arrive in time order, so block ranges are tight). Long-range audit reads use
    ``ChunkLatencyRollup``; raw rows older than ``CHUNK_RETENTION_DAYS`` are pruned once rolled up.
    """

    session = models.ForeignKey(GenerationSession, on_delete=models.CASCADE, related_name="chunks")
    chunk_index = models.PositiveIntegerField()
    worker = models.ForeignKey("gpu.GpuWorker", null=True, on_delete=models.SET_NULL, related_name="chunks")
    batch_size = models.PositiveSmallIntegerField()
    generation_ms = models.FloatField()
    delivery_ms = models.FloatField(null=True, blank=True)
    created_at = models.DateTimeField()

    class Meta:
        ordering = ["session_id", "chunk_index"]
        constraints = [
            models.UniqueConstraint(fields=["session", "chunk_index"], name="chunk_index_unique_per_session"),
            models.CheckConstraint(name="chunk_batch_positive", condition=Q(batch_size__gte=1)),
            models.CheckConstraint(name="chunk_latency_nonnegative", condition=Q(generation_ms__gte=0)),
        ]
        indexes = [
            BrinIndex(fields=["created_at"], name="chunk_created_brin", pages_per_range=32),
            models.Index(fields=["worker", "created_at"], name="chunk_worker_time"),
        ]

    def __str__(self) -> str:
        return f"{self.session_id}#{self.chunk_index}"


# Upper bounds (ms) of the latency histogram buckets kept in rollups; the last bucket is open.
LATENCY_BUCKETS_MS: tuple[float, ...] = tuple(
    [5 * 1.15**i for i in range(60)]  # 5 ms … ≈ 21 s, 15 % wide: percentiles within ±7.5 %
)


class ChunkLatencyRollup(models.Model):
    """Per-minute, per-worker aggregate of chunk records, kept after raw rows are pruned.

    ``histogram[i]`` counts chunks with generation latency in (bucket[i-1], bucket[i]] of
    ``LATENCY_BUCKETS_MS`` (plus one overflow bucket), so percentiles over months are computed
    from a few thousand rows instead of billions.
    """

    minute = models.DateTimeField()
    worker = models.ForeignKey("gpu.GpuWorker", null=True, on_delete=models.SET_NULL, related_name="+")
    worker_name = models.CharField(max_length=100)
    gpu_type = models.CharField(max_length=64)
    count = models.PositiveIntegerField()
    sum_generation_ms = models.FloatField()
    max_generation_ms = models.FloatField()
    sum_delivery_ms = models.FloatField(default=0)
    delivered = models.PositiveIntegerField(default=0)
    histogram = ArrayField(models.PositiveIntegerField(), size=len(LATENCY_BUCKETS_MS) + 1)

    class Meta:
        ordering = ["minute", "worker_name"]
        constraints = [
            models.UniqueConstraint(
                fields=["minute", "worker_name"], name="rollup_one_row_per_minute_worker"
            ),
        ]
        indexes = [models.Index(fields=["minute"])]

    def __str__(self) -> str:
        return f"{self.worker_name} {self.minute:%Y-%m-%d %H:%M} n={self.count}"


def job_result_path(job: Job, filename: str) -> str:
    """Results are named by their job (a UUID), so a name never collides nor reveals the prompt."""
    extension = filename.rsplit(".", 1)[-1] if "." in filename else "bin"
    return f"jobs/{job.submitted_at:%Y/%m/%d}/{job.pk}.{extension}"


class Job(models.Model):
    """A one-shot image or video generation request (GenServe), served beside the streams.

    Lifecycle: queued → running ⇄ paused → done | failed; cancelled from any state before an end.
    ``state`` is the control plane's decision (the dispatcher sets running/paused when it sends
    ``job_run``/``job_resume``/``job_pause``); worker reports only advance ``steps_done`` and end the
    job. ``epoch`` rises on every (re)assignment, so a report from a worker that lost the job is
    ignored (the contract with the runtime: ``sessions.jobs``).
    """

    class Kind(models.TextChoices):
        IMAGE = "image"
        VIDEO = "video"

    class State(models.TextChoices):
        QUEUED = "queued"
        RUNNING = "running"
        PAUSED = "paused"
        DONE = "done"
        FAILED = "failed"
        CANCELLED = "cancelled"

    IN_FLIGHT = (State.QUEUED, State.RUNNING, State.PAUSED)
    ENDED = (State.DONE, State.FAILED, State.CANCELLED)

    id = models.UUIDField(primary_key=True, default=uuid.uuid4, editable=False)
    owner = models.ForeignKey(settings.AUTH_USER_MODEL, on_delete=models.CASCADE, related_name="jobs")
    tenant = models.ForeignKey(
        Tenant, null=True, blank=True, on_delete=models.PROTECT, related_name="jobs",
        help_text="the tenant its user acted for (null: the default tenant)",
    )  # fmt: skip
    kind = models.CharField(max_length=8, choices=Kind.choices)
    prompt = models.TextField()
    model_name = models.CharField(max_length=64)
    width = models.PositiveIntegerField()
    height = models.PositiveIntegerField()
    frames = models.PositiveIntegerField(default=1)
    steps = models.PositiveIntegerField()
    seed = models.BigIntegerField()
    # Higher runs first; within a priority, earliest deadline first.
    priority = models.SmallIntegerField(default=0)
    # The SLO the user asked for (None when they gave an absolute deadline instead).
    slo_s = models.FloatField(null=True, blank=True)
    deadline = models.DateTimeField()
    state = models.CharField(max_length=10, choices=State.choices, default=State.QUEUED)
    epoch = models.PositiveIntegerField(default=0)
    # Where it runs or is paused; after it ends, where it last ran (the console's per-worker view).
    worker = models.ForeignKey(
        "gpu.GpuWorker", null=True, blank=True, on_delete=models.SET_NULL, related_name="jobs"
    )
    steps_done = models.PositiveIntegerField(default=0)
    submitted_at = models.DateTimeField()
    started_at = models.DateTimeField(null=True, blank=True)
    finished_at = models.DateTimeField(null=True, blank=True)
    # Seconds of generation the worker measured (without queueing and pauses).
    run_s = models.FloatField(null=True, blank=True)
    error = models.TextField(blank=True, default="")
    result = models.FileField(upload_to=job_result_path, blank=True, max_length=200)
    result_content_type = models.CharField(max_length=64, blank=True, default="")
    # When its owner deleted it (``sessions.jobs.job_delete``): hidden from every listing, its result
    # removed from the storage; the row stays, so the audit still counts how the job ended.
    deleted_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        ordering = ["-submitted_at"]
        indexes = [
            models.Index(fields=["owner", "-submitted_at"]),
            # The dispatcher's queue read: queued jobs of a model by priority then deadline.
            models.Index(
                fields=["model_name", "-priority", "deadline"],
                name="job_queue_order",
                condition=Q(state="queued"),
            ),
            models.Index(fields=["finished_at"], name="job_finished_at"),
        ]
        constraints = [
            models.CheckConstraint(
                name="job_geometry_positive",
                condition=Q(width__gt=0, height__gt=0, frames__gt=0, steps__gt=0),
            ),
            models.CheckConstraint(name="job_image_is_one_frame", condition=~Q(kind="image") | Q(frames=1)),
            models.CheckConstraint(
                name="job_steps_done_bounded", condition=Q(steps_done__lte=models.F("steps"))
            ),
            models.CheckConstraint(
                name="job_running_has_worker",
                condition=~Q(state__in=["running", "paused"]) | Q(worker__isnull=False),
            ),
            models.CheckConstraint(
                name="job_queued_has_no_worker", condition=~Q(state="queued") | Q(worker__isnull=True)
            ),
            models.CheckConstraint(
                name="job_ended_has_time",
                condition=~Q(state__in=["done", "failed", "cancelled"]) | Q(finished_at__isnull=False),
            ),
            models.CheckConstraint(
                name="job_done_has_result",
                condition=~Q(state="done") | ~Q(result="") | Q(deleted_at__isnull=False),
            ),
        ]

    def __str__(self) -> str:
        return f"{self.kind} job {self.id} ({self.state})"

    @property
    def resolution(self) -> str:
        return f"{self.width}x{self.height}"

    @property
    def in_flight(self) -> bool:
        return self.state in self.IN_FLIGHT

    @property
    def latency_s(self) -> float | None:
        """Submission to result (done jobs only)."""
        if self.state != self.State.DONE or self.finished_at is None:
            return None
        return (self.finished_at - self.submitted_at).total_seconds()

    @property
    def met_slo(self) -> bool | None:
        if self.state != self.State.DONE or self.finished_at is None:
            return None
        return self.finished_at <= self.deadline
