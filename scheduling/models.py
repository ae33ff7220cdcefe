"""Scheduling history: every decision with its inputs, every migration and scaling action.

Also the operator-editable scheduler configuration (a single row).
"""

from __future__ import annotations

from django.core.validators import MaxValueValidator, MinValueValidator
from django.db import models
from django.db.models import Q

from scheduling.core.types import EventKind

# Bounds of the scheduler configuration (SchedulerConfig).
MAX_GPUS = 1024
MIN_UTILIZATION = 0.01
MAX_SLO_MS = 600_000.0  # ten minutes per chunk
MAX_QUEUE = 100_000
MAX_COOLDOWN_S = 86_400.0  # a day


class SchedulerConfig(models.Model):
    """Operator-tunable knobs of the live scheduler (one row, id=1).

    Every knob is bounded to what a deployment can mean (the validators give the API its 400s and
    its schema; the constraints hold for every writer): an SLO of 7·10¹⁶ ms or a pool of 2³¹ GPUs is
    a typo, and the policy would act on it.
    """

    policy = models.CharField(max_length=200, default="turboserve")
    min_gpus = models.PositiveIntegerField(default=1, validators=[MaxValueValidator(MAX_GPUS)])
    max_gpus = models.PositiveIntegerField(
        default=4, validators=[MinValueValidator(1), MaxValueValidator(MAX_GPUS)]
    )
    # None: the workload detector's volatility table chooses ρ̂ (TurboServe Appendix A).
    target_utilization = models.FloatField(
        null=True,
        blank=True,
        validators=[MinValueValidator(MIN_UTILIZATION), MaxValueValidator(1.0)],
    )
    slo_ms = models.FloatField(
        default=1000.0, validators=[MinValueValidator(1.0), MaxValueValidator(MAX_SLO_MS)]
    )
    # 0: no queue, a session that cannot be placed at once is refused.
    queue_max = models.PositiveIntegerField(default=100, validators=[MaxValueValidator(MAX_QUEUE)])
    # No scale-in until this long after the last scale-out (anti-flapping; beyond the paper).
    scale_in_cooldown_s = models.FloatField(
        default=60.0, validators=[MinValueValidator(0.0), MaxValueValidator(MAX_COOLDOWN_S)]
    )
    updated_at = models.DateTimeField(auto_now=True)

    class Meta:
        constraints = [
            models.CheckConstraint(
                name="config_bounds_ordered", condition=Q(min_gpus__lte=models.F("max_gpus"))
            ),
            models.CheckConstraint(
                name="config_gpus_range",
                condition=Q(max_gpus__gte=1) & Q(max_gpus__lte=MAX_GPUS),
            ),
            models.CheckConstraint(
                name="config_utilization_range",
                condition=Q(target_utilization__isnull=True)
                | (Q(target_utilization__gte=MIN_UTILIZATION) & Q(target_utilization__lte=1)),
            ),
            models.CheckConstraint(
                name="config_slo_range", condition=Q(slo_ms__gte=1) & Q(slo_ms__lte=MAX_SLO_MS)
            ),
            models.CheckConstraint(name="config_queue_range", condition=Q(queue_max__lte=MAX_QUEUE)),
            models.CheckConstraint(
                name="config_cooldown_range",
                condition=Q(scale_in_cooldown_s__gte=0) & Q(scale_in_cooldown_s__lte=MAX_COOLDOWN_S),
            ),
        ]

    def __str__(self) -> str:
        return f"{self.policy} [{self.min_gpus}, {self.max_gpus}]"

    @classmethod
    def load(cls) -> SchedulerConfig:
        config, _ = cls.objects.get_or_create(pk=1)
        return config


class SchedulerDecision(models.Model):
    """One run of the closed-loop scheduler (TurboServe Algorithm 1) with its inputs and outputs."""

    # The platform's event vocabulary (scheduling.core.types.EventKind), one member per trigger.
    Trigger = models.TextChoices(
        "Trigger",
        [
            (
                kind.name,
                (
                    kind.value,
                    "worker lifecycle" if kind is EventKind.WORKER else kind.name.replace("_", " ").title(),
                ),
            )
            for kind in EventKind
        ],
    )

    trigger = models.CharField(max_length=16, choices=Trigger.choices)
    session = models.ForeignKey(
        "streams.GenerationSession", null=True, blank=True, on_delete=models.SET_NULL, related_name="+"
    )
    decided_at = models.DateTimeField(db_index=True)
    policy = models.CharField(max_length=200)
    # Inputs summary.
    active_sessions = models.PositiveIntegerField()
    budget = models.PositiveIntegerField(help_text="M: provisioned workers when the decision started")
    rho_max = models.FloatField(null=True, blank=True)
    volatility = models.FloatField(null=True, blank=True)
    volatility_level = models.PositiveSmallIntegerField(null=True, blank=True)
    lambda_weight = models.FloatField(null=True, blank=True)
    rho_hat = models.FloatField(null=True, blank=True)
    # Outputs summary.
    target_budget = models.PositiveIntegerField()
    placements_changed = models.PositiveIntegerField(default=0)
    duration_ms = models.FloatField()
    inputs = models.JSONField(default=dict, blank=True)
    outputs = models.JSONField(default=dict, blank=True)

    class Meta:
        ordering = ["-decided_at", "-id"]
        get_latest_by = "decided_at"

    def __str__(self) -> str:
        return f"decision {self.pk} ({self.trigger}) M={self.budget}→{self.target_budget}"


class Migration(models.Model):
    """One session-state migration between workers (TurboServe §6.1)."""

    class Outcome(models.TextChoices):
        PENDING = "pending"
        SUCCEEDED = "succeeded"
        FAILED = "failed"
        ABORTED = "aborted"

    session = models.ForeignKey(
        "streams.GenerationSession", on_delete=models.CASCADE, related_name="migrations"
    )
    source = models.ForeignKey("gpu.GpuWorker", on_delete=models.PROTECT, related_name="migrations_out")
    target = models.ForeignKey("gpu.GpuWorker", on_delete=models.PROTECT, related_name="migrations_in")
    decision = models.ForeignKey(
        SchedulerDecision, null=True, blank=True, on_delete=models.SET_NULL, related_name="migrations"
    )
    epoch = models.PositiveIntegerField(default=0)
    state_bytes = models.BigIntegerField(default=0)
    reason = models.CharField(max_length=64)
    outcome = models.CharField(max_length=16, choices=Outcome.choices, default=Outcome.PENDING)
    error = models.TextField(blank=True, default="")
    started_at = models.DateTimeField(db_index=True)
    finished_at = models.DateTimeField(null=True, blank=True)
    duration_ms = models.FloatField(null=True, blank=True)
    # A move across regions (docs/regions.md, "Running sessions move when it pays"): both regions as
    # they were at the start (null: the local region), and the rule's estimate that chose it.
    cross_region = models.BooleanField(default=False, db_index=True)
    source_region = models.ForeignKey(
        "gpu.Region", null=True, blank=True, on_delete=models.SET_NULL, related_name="+"
    )
    target_region = models.ForeignKey(
        "gpu.Region", null=True, blank=True, on_delete=models.SET_NULL, related_name="+"
    )
    estimated_saving_ms = models.FloatField(null=True, blank=True)
    switch_cost_ms = models.FloatField(null=True, blank=True)

    class Meta:
        ordering = ["-started_at", "-id"]
        constraints = [
            models.CheckConstraint(
                name="migration_distinct_workers", condition=~Q(source=models.F("target"))
            ),
            models.CheckConstraint(
                name="migration_finished_has_time",
                condition=Q(outcome="pending") | Q(finished_at__isnull=False),
            ),
        ]

    def __str__(self) -> str:
        return f"{self.session_id}: {self.source_id}→{self.target_id} ({self.outcome})"


class ScalingAction(models.Model):
    """A change of the GPU budget from M to M′ and what the provisioner did about it."""

    class Direction(models.TextChoices):
        OUT = "out", "scale-out"
        IN = "in", "scale-in"

    class Outcome(models.TextChoices):
        REQUESTED = "requested"
        SUCCEEDED = "succeeded"
        FAILED = "failed"

    decision = models.ForeignKey(
        SchedulerDecision, null=True, blank=True, on_delete=models.SET_NULL, related_name="scaling_actions"
    )
    created_at = models.DateTimeField(db_index=True)
    direction = models.CharField(max_length=4, choices=Direction.choices)
    from_budget = models.PositiveIntegerField()
    to_budget = models.PositiveIntegerField()
    gpu_type = models.CharField(max_length=64, blank=True, default="")
    reason = models.CharField(max_length=255)
    outcome = models.CharField(max_length=16, choices=Outcome.choices, default=Outcome.REQUESTED)
    provisioner_result = models.JSONField(default=dict, blank=True)
    workers = models.ManyToManyField("gpu.GpuWorker", blank=True, related_name="scaling_actions")
    # Scale-out (BlitzScale §5.1; docs/scaleout.md): the scale plan (multicast chains from the
    # parameter pool's holders, or disk), when the plan expects the workers ready, when the last one
    # was, and each worker's phases as reported: {name: {"process_up": iso, "weights_complete": iso,
    # "source": "peer", "ready": iso}}.
    plan = models.JSONField(default=dict, blank=True)
    expected_ready_at = models.DateTimeField(null=True, blank=True)
    ready_at = models.DateTimeField(null=True, blank=True)
    phases = models.JSONField(default=dict, blank=True)

    class Meta:
        ordering = ["-created_at", "-id"]
        constraints = [
            models.CheckConstraint(
                name="scaling_direction_matches_budgets",
                condition=(Q(direction="out") & Q(to_budget__gt=models.F("from_budget")))
                | (Q(direction="in") & Q(to_budget__lt=models.F("from_budget"))),
            ),
        ]

    def __str__(self) -> str:
        return f"{self.direction} {self.from_budget}→{self.to_budget}"


class SchedulerState(models.Model):
    """The live policy's internal state (detector window, cooldown timers) between Celery runs."""

    policy = models.CharField(max_length=200)
    state = models.JSONField(default=dict)
    updated_at = models.DateTimeField(auto_now=True)

    def __str__(self) -> str:
        return f"state of {self.policy}"


class WorkerCommand(models.Model):
    """A command sent to a worker's durable channel, and what the worker answered.

    Workers apply commands at chunk boundaries and answer each exactly once (``acked``, ``refused``
    with a reason, or ``failed``); commands still ``sent`` past their deadline are ``timed_out``.
    """

    class Kind(models.TextChoices):
        START = "start"
        RESUME = "resume"
        SUSPEND = "suspend"
        MIGRATE_OUT = "migrate_out"
        MIGRATE_IN = "migrate_in"
        ACTIVATE = "activate"
        PROMPT = "prompt"
        STOP = "stop"
        DRAIN = "drain"
        UNDRAIN = "undrain"
        SHUTDOWN = "shutdown"
        JOB_RUN = "job_run"
        JOB_PAUSE = "job_pause"
        JOB_RESUME = "job_resume"
        JOB_CANCEL = "job_cancel"
        SET_ROLE = "set_role"
        SET_ENCODER = "set_encoder"

    class Status(models.TextChoices):
        SENT = "sent"
        ACKED = "acked"
        REFUSED = "refused"
        FAILED = "failed"
        TIMED_OUT = "timed_out"

    id = models.UUIDField(primary_key=True)
    worker = models.ForeignKey("gpu.GpuWorker", on_delete=models.CASCADE, related_name="commands")
    session = models.ForeignKey(
        "streams.GenerationSession", null=True, blank=True, on_delete=models.SET_NULL, related_name="+"
    )
    # The one-shot job a job command (or a job's migration command) is about.
    job = models.ForeignKey("streams.Job", null=True, blank=True, on_delete=models.SET_NULL, related_name="+")
    decision = models.ForeignKey(
        SchedulerDecision, null=True, blank=True, on_delete=models.SET_NULL, related_name="commands"
    )
    kind = models.CharField(max_length=16, choices=Kind.choices)
    epoch = models.PositiveIntegerField(default=0)
    payload = models.JSONField(default=dict)
    status = models.CharField(max_length=16, choices=Status.choices, default=Status.SENT)
    reason = models.TextField(blank=True, default="")
    result = models.JSONField(default=dict, blank=True)
    created_at = models.DateTimeField(db_index=True)
    answered_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        ordering = ["-created_at"]
        indexes = [models.Index(fields=["status", "created_at"])]
        constraints = [
            models.CheckConstraint(
                name="command_answered_has_time",
                condition=Q(status__in=["sent", "timed_out"]) | Q(answered_at__isnull=False),
            ),
        ]

    def __str__(self) -> str:
        return f"{self.kind} → {self.worker_id} ({self.status})"


class StagePlacement(models.Model):
    """One stage placement of a model's pool (TridentServe Alg. 2) and why it was made: the first one
    (``bootstrap``) or a re-placement the trigger fired (§5.3), with the trigger's figures.

    Its worker role changes (``StageRoleChange``) are applied one worker at a time, never more than
    ``STAGE_MAX_CHANGING`` at once, so the pool never pauses as a whole: ``planned`` → ``applying``
    → ``applied`` (every change acknowledged, or cancelled as moot) or ``partial`` (some refused or
    failed). No new plan is made while one is applied.
    """

    class Reason(models.TextChoices):
        BOOTSTRAP = "bootstrap"
        SKEW = "skew", "stage throughput skew"
        UNSERVED = "unserved", "request type without replicas"
        ENCODER_POOL = "encoder_pool", "encoder pool too small"
        AUX_SHRINK = "aux_shrink", "idle E or C worker the plan does not need"

    class Status(models.TextChoices):
        PLANNED = "planned"
        APPLYING = "applying"
        APPLIED = "applied"
        PARTIAL = "partial"

    ENDED = (Status.APPLIED, Status.PARTIAL)

    decision = models.ForeignKey(
        SchedulerDecision, null=True, blank=True, on_delete=models.SET_NULL, related_name="stage_placements"
    )
    created_at = models.DateTimeField(db_index=True)
    preset = models.CharField(max_length=64)
    reason = models.CharField(max_length=16, choices=Reason.choices)
    status = models.CharField(max_length=16, choices=Status.choices, default=Status.PLANNED)
    # {worker name: role} before and as planned.
    roles_before = models.JSONField(default=dict, blank=True)
    roles_after = models.JSONField(default=dict, blank=True)
    # The trigger's figures: per-stage throughputs over the window, backlog, unserved requests, the
    # mix the plan was made from (job shapes, stream encode seconds), threshold and window.
    trigger = models.JSONField(default=dict, blank=True)
    finished_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        ordering = ["-created_at", "-id"]
        constraints = [
            models.CheckConstraint(
                name="stageplacement_ended_has_time",
                condition=Q(status__in=["planned", "applying"]) | Q(finished_at__isnull=False),
            ),
        ]

    def __str__(self) -> str:
        return f"stage placement {self.pk} of {self.preset} ({self.reason}, {self.status})"


class StageRoleChange(models.Model):
    """One worker's role change within a ``StagePlacement``: ``planned`` → ``sent`` (a ``set_role``
    command in the outbox) → ``applied`` | ``refused`` | ``failed`` (the worker's answer, or no answer
    before the command timeout), or ``cancelled`` before it was sent (its worker is no longer ready, or
    already has the role)."""

    class Status(models.TextChoices):
        PLANNED = "planned"
        SENT = "sent"
        APPLIED = "applied"
        REFUSED = "refused"
        FAILED = "failed"
        CANCELLED = "cancelled"

    IN_FLIGHT = (Status.SENT,)
    ENDED = (Status.APPLIED, Status.REFUSED, Status.FAILED, Status.CANCELLED)

    placement = models.ForeignKey(StagePlacement, on_delete=models.CASCADE, related_name="changes")
    worker = models.ForeignKey("gpu.GpuWorker", on_delete=models.CASCADE, related_name="stage_changes")
    from_role = models.CharField(max_length=3)
    to_role = models.CharField(max_length=3)
    order = models.PositiveSmallIntegerField(help_text="position in the placement's one-at-a-time order")
    status = models.CharField(max_length=16, choices=Status.choices, default=Status.PLANNED)
    command = models.ForeignKey(
        WorkerCommand, null=True, blank=True, on_delete=models.SET_NULL, related_name="+"
    )
    reason = models.TextField(blank=True, default="")
    load_ms = models.FloatField(null=True, blank=True, help_text="stage load time the worker reported")
    created_at = models.DateTimeField()
    sent_at = models.DateTimeField(null=True, blank=True)
    answered_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        ordering = ["placement_id", "order"]
        indexes = [models.Index(fields=["status", "worker"])]
        constraints = [
            models.CheckConstraint(
                name="stagechange_changes_role", condition=~Q(from_role=models.F("to_role"))
            ),
            models.CheckConstraint(
                name="stagechange_sent_has_time",
                condition=Q(status__in=["planned", "cancelled"]) | Q(sent_at__isnull=False),
            ),
            models.UniqueConstraint(fields=["placement", "worker"], name="stagechange_one_per_worker"),
        ]

    def __str__(self) -> str:
        return f"{self.worker_id}: {self.from_role}→{self.to_role} ({self.status})"
