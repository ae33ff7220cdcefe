"""Prometheus metrics at ``/metrics``, read from PostgreSQL on each scrape.

A cluster view, so it lives with the scheduler: one collector joins the GPU pool, the sessions and
the scheduling history in one scrape.

Every figure is derived from the audit plane's rows, not from in-process instruments: the web,
Celery and worker processes all write to PostgreSQL, so one custom collector in any web process
gives the whole cluster's view, identical whichever replica Prometheus scrapes. The scrape is kept
cheap, each query bounded by an index or a time window:

- latency histograms (chunk generation/delivery, scheduler decision time) cover the last
  ``METRICS_WINDOW_S`` seconds (default 300) of raw ``ChunkRecord`` / ``SchedulerDecision`` rows,
  read through the BRIN index on ``created_at`` / the B-tree on ``decided_at`` in one aggregate
  query each (one filtered COUNT per bucket). They are *gauge histograms*: the distribution over the
  window, so ``histogram_quantile(0.99, streamserve_chunk_generation_seconds_bucket)`` needs no
  ``rate()``. Raw rows rather than ``ChunkLatencyRollup``: rollups exist only for closed minutes,
  a minute or more late, and their 15 %-wide buckets do not line up with these SLO-oriented ones;
- session and worker gauges group by indexed status columns (terminated sessions are not counted);
- counters by outcome (migrations, scaling actions, decisions) are kept incrementally per process:
  the first scrape aggregates the table once, later scrapes read only rows past a primary-key
  watermark (minus a tail of ``_TAIL_IDS`` ids, re-read so that a transaction committing late is
  not missed) and re-check the ids that were still pending. A counter counts a row once it has a
  final outcome; rows still pending are a gauge.

Unauthenticated by default; set ``METRICS_TOKEN`` and scrapers must send
``Authorization: Bearer <token>``.
"""

from __future__ import annotations

import hmac
import logging
import threading
import time
from collections import Counter
from collections.abc import Iterable, Iterator
from datetime import timedelta
from typing import Any

from django.conf import settings
from django.db import DatabaseError
from django.db.models import Count, Max, Q, Sum
from django.http import HttpRequest, HttpResponse
from django.utils import timezone
from django.views.decorators.http import require_GET
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeHistogramMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from gpu.models import GpuWorker, WeightHolding
from scheduling.models import Migration, ScalingAction, SchedulerDecision
from sessions.models import ChunkRecord, GenerationSession, Job, Tenant
from sessions.usage import tenants_gpu_seconds

logger = logging.getLogger(__name__)

# Per-chunk latency buckets (seconds): dense around the ~1 s per-chunk SLO (TurboServe §7).
CHUNK_BUCKETS_S = (0.05, 0.1, 0.25, 0.5, 0.75, 1.0, 1.25, 1.5, 2.0, 3.0, 5.0, 10.0)
# Scheduler decision time: TurboServe reports < 15 ms at 64 GPUs, < 0.1 s at 256.
DECISION_BUCKETS_S = (0.001, 0.0025, 0.005, 0.01, 0.015, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0)
# Scale-out phases: BlitzScale-class (sub-second to seconds) through cold boots (tens of seconds).
SCALEOUT_BUCKETS_S = (0.5, 1.0, 2.0, 5.0, 10.0, 20.0, 30.0, 45.0, 60.0, 120.0, 300.0)
_TAIL_IDS = 1000


Histogram = tuple[list[tuple[str, float]], float]  # cumulative (le, count) buckets, sum in seconds


def _window_histograms(
    queryset, *, fields: tuple[str, ...], buckets_s: tuple[float, ...], group: str | None = None
) -> dict[str, dict[Any, Histogram]]:
    """Per field (a column in ms) and per ``group`` value: cumulative buckets and sum, in one query
    (one scan of the window however many fields and buckets)."""
    aggregates: dict[str, Any] = {}
    for f, field in enumerate(fields):
        for i, bound in enumerate(buckets_s):
            aggregates[f"f{f}_le_{i}"] = Count("pk", filter=Q(**{f"{field}__lte": bound * 1000.0}))
        aggregates[f"f{f}_n"] = Count(field)
        aggregates[f"f{f}_ms"] = Sum(field)
    rows: Iterable[dict[str, Any]]
    if group:
        rows = queryset.order_by().values(group).annotate(**aggregates)
    else:
        rows = [queryset.aggregate(**aggregates)]
    result: dict[str, dict[Any, Histogram]] = {field: {} for field in fields}
    for row in rows:
        key = row.get(group) if group else ""
        for f, field in enumerate(fields):
            if not row[f"f{f}_n"]:
                continue
            buckets = [(_le(bound), float(row[f"f{f}_le_{i}"])) for i, bound in enumerate(buckets_s)]
            buckets.append(("+Inf", float(row[f"f{f}_n"])))
            result[field][key] = (buckets, (row[f"f{f}_ms"] or 0.0) / 1000.0)
    return result


def _merge(histograms: Iterable[Histogram]) -> Histogram:
    merged: list[tuple[str, float]] = []
    total = 0.0
    for buckets, sum_s in histograms:
        merged = [(le, count + (merged[i][1] if merged else 0.0)) for i, (le, count) in enumerate(buckets)]
        total += sum_s
    return merged, total


def _le(bound: float) -> str:
    return repr(float(bound))


class OutcomeCounter:
    """Monotonic per-label counts of a table's rows with a final outcome, maintained incrementally.

    ``labels`` are column names (the outcome column among them); rows whose outcome is
    ``pending_value`` are not counted until a later scrape sees them settled.
    """

    def __init__(
        self, model, *, labels: tuple[str, ...], outcome: str | None = None, pending_value: str = ""
    ):
        self.model = model
        self.labels = labels
        self.outcome = outcome
        self.pending_value = pending_value
        self.totals: Counter[tuple[str, ...]] = Counter()
        self.pending: set[int] = set()  # pending ids at or below the floor
        self.counted_above_floor: set[int] = set()
        self.floor: int | None = None
        self.lock = threading.Lock()

    def _settled(self, value: str | None) -> bool:
        return self.outcome is None or value != self.pending_value

    def _columns(self) -> tuple[str, ...]:
        return (
            ("pk", *self.labels)
            if self.outcome is None or self.outcome in self.labels
            else ("pk", *self.labels, self.outcome)
        )

    def _outcome_of(self, row: tuple) -> str | None:
        if self.outcome is None:
            return None
        return row[self._columns().index(self.outcome)]

    def refresh(self) -> dict[tuple[str, ...], int]:
        with self.lock:
            manager = self.model.objects.order_by()
            if self.floor is None:
                top = manager.aggregate(top=Max("pk"))["top"] or 0
                self.floor = max(top - _TAIL_IDS, 0)
                base = manager.filter(pk__lte=self.floor)
                if self.outcome is not None:
                    self.pending = set(
                        base.filter(**{self.outcome: self.pending_value}).values_list("pk", flat=True)
                    )
                    base = base.exclude(**{self.outcome: self.pending_value})
                for row in base.values(*self.labels).annotate(n=Count("pk")):
                    self.totals[tuple(str(row[k]) for k in self.labels)] += row["n"]
            columns = self._columns()
            tail = list(manager.filter(pk__gt=self.floor).values_list(*columns))
            for row in tail:
                pk = row[0]
                if pk in self.counted_above_floor or not self._settled(self._outcome_of(row)):
                    continue
                self.counted_above_floor.add(pk)
                self.totals[tuple(str(v) for v in row[1 : 1 + len(self.labels)])] += 1
            top = max((row[0] for row in tail), default=self.floor)
            new_floor = max(top - _TAIL_IDS, self.floor)
            # Rows leaving the tail: pending ones are re-checked by id from now on.
            for row in tail:
                if self.floor < row[0] <= new_floor and row[0] not in self.counted_above_floor:
                    self.pending.add(row[0])
            self.counted_above_floor = {pk for pk in self.counted_above_floor if pk > new_floor}
            self.floor = new_floor
            if self.pending:
                seen = set()
                for row in manager.filter(pk__in=self.pending).values_list(*columns):
                    seen.add(row[0])
                    if self._settled(self._outcome_of(row)):
                        self.totals[tuple(str(v) for v in row[1 : 1 + len(self.labels)])] += 1
                        seen.discard(row[0])
                        self.pending.discard(row[0])
                self.pending &= seen  # deleted rows (cascade) are forgotten
            return dict(self.totals)


class StreamServeCollector(Collector):
    """Reads the cluster's state from PostgreSQL on each scrape (see the module docstring)."""

    def __init__(self, *, window_s: float | None = None) -> None:
        self.window_s = float(window_s if window_s is not None else settings.STREAMSERVE["METRICS_WINDOW_S"])
        self.migrations = OutcomeCounter(
            Migration, labels=("outcome",), outcome="outcome", pending_value=Migration.Outcome.PENDING
        )
        self.scaling = OutcomeCounter(
            ScalingAction,
            labels=("direction", "outcome"),
            outcome="outcome",
            pending_value=ScalingAction.Outcome.REQUESTED,
        )
        self.decisions = OutcomeCounter(SchedulerDecision, labels=("trigger",))

    def describe(self) -> Iterator:
        return iter(())  # collected on scrape only: never touch the database at registration

    def _tenants(self, open_statuses: list[str], since, now) -> Iterator:
        """Per tenant (null: the default tenant): open sessions by status, queued jobs, GPU-seconds
        charged over the window (``sessions.usage``: chunks batch-aware, ended jobs) and its weight."""
        names = dict(Tenant.objects.values_list("pk", "name"))

        def name_of(pk) -> str:
            return names.get(pk, Tenant.DEFAULT_NAME)

        sessions = GaugeMetricFamily(
            "streamserve_tenant_sessions", "Open sessions by tenant and status", labels=["tenant", "status"]
        )
        counts: Counter = Counter()
        rows = (
            GenerationSession.objects.filter(status__in=open_statuses)
            .order_by()
            .values_list("tenant_id", "status")
            .annotate(n=Count("pk"))
        )
        for tenant_id, status, n in rows:
            counts[(name_of(tenant_id), status)] += n
        for (tenant, status), n in sorted(counts.items()):
            sessions.add_metric([tenant, status], n)
        yield sessions
        jobs = GaugeMetricFamily(
            "streamserve_tenant_jobs_queued", "Queued one-shot jobs by tenant", labels=["tenant"]
        )
        queued: Counter = Counter()
        for tenant_id, n in (
            Job.objects.filter(state=Job.State.QUEUED)
            .order_by()
            .values_list("tenant_id")
            .annotate(n=Count("pk"))
        ):
            queued[name_of(tenant_id)] += n
        for tenant, n in sorted(queued.items()):
            jobs.add_metric([tenant], n)
        yield jobs
        used = GaugeMetricFamily(
            "streamserve_tenant_gpu_seconds",
            f"GPU-seconds charged to each tenant over the last {self.window_s:.0f} s (chunks batch-aware, ended jobs)",
            labels=["tenant"],
        )
        for tenant, seconds in sorted(tenants_gpu_seconds(since=since, until=now).items()):
            used.add_metric([tenant], seconds)
        yield used
        weights = GaugeMetricFamily(
            "streamserve_tenant_weight", "Each tenant's fair-share weight", labels=["tenant"]
        )
        for tenant, weight in Tenant.objects.order_by("name").values_list("name", "weight"):
            weights.add_metric([tenant], weight)
        yield weights

    def collect(self) -> Iterator:
        began = time.perf_counter()
        now = timezone.now()
        since = now - timedelta(seconds=self.window_s)

        # --- per-chunk latency over the window (BRIN on created_at bounds the scan)
        # Grouped by worker_id (no join in the scan), then merged per GPU type here.
        per_worker = _window_histograms(
            ChunkRecord.objects.filter(created_at__gte=since),
            fields=("generation_ms", "delivery_ms"),
            buckets_s=CHUNK_BUCKETS_S,
            group="worker_id",
        )
        worker_ids = {pk for by_worker in per_worker.values() for pk in by_worker if pk is not None}
        type_of = dict(GpuWorker.objects.filter(pk__in=worker_ids).values_list("pk", "gpu_type"))
        for name, column, doc in (
            ("streamserve_chunk_generation_seconds", "generation_ms", "Per-chunk generation latency"),
            (
                "streamserve_chunk_delivery_seconds",
                "delivery_ms",
                "Per-chunk worker-to-client delivery latency",
            ),
        ):
            family = GaugeHistogramMetricFamily(
                name, f"{doc} over the last {self.window_s:.0f} s, by GPU type", labels=["gpu_type"]
            )
            by_type: dict[str, list[Histogram]] = {}
            for worker_id, histogram in per_worker[column].items():
                by_type.setdefault(type_of.get(worker_id, "unknown"), []).append(histogram)
            for gpu_type, histograms in sorted(by_type.items()):
                buckets, total = _merge(histograms)
                family.add_metric([gpu_type], buckets, gsum_value=total)
            yield family

        # --- sessions (terminated ones are history, not load)
        open_statuses = [
            s for s in GenerationSession.Status.values if s != GenerationSession.Status.TERMINATED
        ]
        by_status = dict(
            GenerationSession.objects.filter(status__in=open_statuses)
            .order_by()
            .values_list("status")
            .annotate(n=Count("pk"))
        )
        sessions = GaugeMetricFamily("streamserve_sessions", "Open sessions by status", labels=["status"])
        for status in open_statuses:
            sessions.add_metric([status], by_status.get(status, 0))
        yield sessions
        by_activity = dict(
            GenerationSession.objects.filter(status__in=open_statuses)
            .order_by()
            .values_list("activity")
            .annotate(n=Count("pk"))
        )
        activity = GaugeMetricFamily(
            "streamserve_sessions_by_activity",
            "Open sessions by user activity (active: α=1)",
            labels=["activity"],
        )
        for value in GenerationSession.Activity.values:
            activity.add_metric([value], by_activity.get(value, 0))
        yield activity

        # --- tenants (issue 29): open sessions, queued jobs and GPU-seconds charged over the window
        yield from self._tenants(open_statuses, since, now)

        # --- one-shot jobs in flight (ended ones are the audit's: /api/audit/jobs/)
        jobs_in_flight = dict(
            ((state, kind), n)
            for state, kind, n in Job.objects.filter(state__in=Job.IN_FLIGHT)
            .order_by()
            .values_list("state", "kind")
            .annotate(n=Count("pk"))
        )
        jobs = GaugeMetricFamily(
            "streamserve_jobs", "One-shot jobs in flight by state and kind", labels=["state", "kind"]
        )
        for state in Job.IN_FLIGHT:
            for kind in Job.Kind.values:
                jobs.add_metric([state, kind], jobs_in_flight.get((state, kind), 0))
        yield jobs

        # --- GPU workers, capacity and cost rate (index on (status, gpu_type))
        workers = GaugeMetricFamily(
            "streamserve_gpu_workers", "GPU workers by status and type", labels=["status", "gpu_type"]
        )
        cost = GaugeMetricFamily(
            "streamserve_cost_rate_dollars_per_hour",
            "Price per hour of live (billed) workers",
            labels=["gpu_type"],
        )
        capacity = GaugeMetricFamily(
            "streamserve_gpu_capacity_sessions",
            "Sum of K (sessions at the SLO) of ready workers",
            labels=["gpu_type"],
        )
        rows = (
            GpuWorker.objects.order_by()
            .values("status", "gpu_type")
            .annotate(n=Count("pk"), price=Sum("price_per_hour"), k=Sum("capacity"))
        )
        seen_statuses = set()
        cost_by_type: Counter[str] = Counter()
        capacity_by_type: Counter[str] = Counter()
        for row in rows:
            workers.add_metric([row["status"], row["gpu_type"]], row["n"])
            seen_statuses.add(row["status"])
            if row["status"] in GpuWorker.LIVE_STATUSES:
                cost_by_type[row["gpu_type"]] += float(row["price"] or 0)
            if row["status"] == GpuWorker.Status.READY:
                capacity_by_type[row["gpu_type"]] += int(row["k"] or 0)
        for status in GpuWorker.Status.values:
            if status not in seen_statuses:
                workers.add_metric([status, ""], 0)
        for gpu_type, rate in sorted(cost_by_type.items()):
            cost.add_metric([gpu_type], rate)
        for gpu_type, k in sorted(capacity_by_type.items()):
            capacity.add_metric([gpu_type], k)
        yield workers
        yield cost
        yield capacity

        heartbeat = GaugeMetricFamily(
            "streamserve_gpu_worker_heartbeat_age_seconds",
            "Seconds since each ready/draining worker's last heartbeat",
            labels=["worker", "gpu_type"],
        )
        residents = GaugeMetricFamily(
            "streamserve_gpu_worker_sessions",
            "Open sessions placed on each live worker",
            labels=["worker", "gpu_type"],
        )
        # Latest telemetry sample of each live worker (NVML on GPUs, host figures on CPU workers).
        telemetry = {
            field: GaugeMetricFamily(name, doc, labels=["worker", "gpu_type"])
            for field, name, doc in (
                ("utilization_pct", "streamserve_gpu_worker_utilization_ratio", "Device utilisation, 0–1"),
                ("memory_used_bytes", "streamserve_gpu_worker_memory_used_bytes", "Device memory in use"),
                ("power_watts", "streamserve_gpu_worker_power_watts", "Device power draw"),
                ("temperature_c", "streamserve_gpu_worker_temperature_celsius", "Device temperature"),
            )
        }
        live = list(
            GpuWorker.objects.filter(status__in=GpuWorker.LIVE_STATUSES).values_list(
                "pk", "name", "gpu_type", "status", "last_heartbeat", *telemetry
            )
        )
        placed = dict(
            GenerationSession.objects.filter(status__in=open_statuses, worker__isnull=False)
            .order_by()
            .values_list("worker_id")
            .annotate(n=Count("pk"))
        )
        for pk, name, gpu_type, status, last_heartbeat, *sample in live:
            residents.add_metric([name, gpu_type], placed.get(pk, 0))
            if status != GpuWorker.Status.PROVISIONING and last_heartbeat is not None:
                heartbeat.add_metric([name, gpu_type], max((now - last_heartbeat).total_seconds(), 0.0))
            for (field, family), reading in zip(telemetry.items(), sample, strict=True):
                if reading is not None:
                    family.add_metric(
                        [name, gpu_type], reading / 100.0 if field == "utilization_pct" else reading
                    )
        yield heartbeat
        yield residents
        yield from telemetry.values()

        # --- scheduling history: counters by final outcome, pending as gauges
        migrations = CounterMetricFamily(
            "streamserve_migrations", "Session migrations with a final outcome", labels=["outcome"]
        )
        for (outcome,), n in sorted(self.migrations.refresh().items()):
            migrations.add_metric([outcome], n)
        yield migrations
        yield GaugeMetricFamily(
            "streamserve_migrations_pending",
            "Migrations in flight",
            value=Migration.objects.filter(
                outcome=Migration.Outcome.PENDING, started_at__gte=now - timedelta(days=1)
            ).count(),
        )
        scaling = CounterMetricFamily(
            "streamserve_scaling_actions",
            "Scaling actions with a final outcome",
            labels=["direction", "outcome"],
        )
        for (direction, outcome), n in sorted(self.scaling.refresh().items()):
            scaling.add_metric([direction, outcome], n)
        yield scaling
        yield GaugeMetricFamily(
            "streamserve_scaling_actions_pending",
            "Scaling actions requested and not yet settled",
            value=ScalingAction.objects.filter(
                outcome=ScalingAction.Outcome.REQUESTED, created_at__gte=now - timedelta(days=1)
            ).count(),
        )
        decisions = CounterMetricFamily(
            "streamserve_scheduler_decisions", "Scheduler runs", labels=["trigger"]
        )
        for (trigger,), n in sorted(self.decisions.refresh().items()):
            decisions.add_metric([trigger], n)
        yield decisions
        duration = GaugeHistogramMetricFamily(
            "streamserve_scheduler_decision_seconds",
            f"Scheduler decision time over the last {self.window_s:.0f} s",
            labels=[],
        )
        window = _window_histograms(
            SchedulerDecision.objects.filter(decided_at__gte=since),
            fields=("duration_ms",),
            buckets_s=DECISION_BUCKETS_S,
        )["duration_ms"]
        if "" in window:
            buckets, total = window[""]
            duration.add_metric([], buckets, gsum_value=total)
        yield duration

        yield from self._scaleout(now, since)

        yield GaugeMetricFamily(
            "streamserve_metrics_window_seconds",
            "Window of the latency gauge histograms",
            value=self.window_s,
        )
        yield GaugeMetricFamily(
            "streamserve_metrics_collect_seconds", "Time this scrape spent reading the database",
            value=time.perf_counter() - began,
        )  # fmt: skip

    def _scaleout(self, now, since) -> Iterator:
        """Scale-out phases (docs/scaleout.md) of the workers that became ready in the window, the
        parameter pool's copies, and the loading workers' expected ready times."""
        phases = GaugeHistogramMetricFamily(
            "streamserve_scaleout_phase_seconds",
            f"Seconds from the provisioning request to each phase, workers ready in the last {self.window_s:.0f} s",
            labels=["phase", "source"],
        )
        rows = GpuWorker.objects.filter(ready_at__gte=since).values_list(
            "requested_at", "process_up_at", "weights_complete_at", "ready_at", "weights_source"
        )
        samples: dict[tuple[str, str], list[float]] = {}
        for requested, up, weights, ready, source in rows:
            for phase, at in (("process_up", up), ("weights_complete", weights), ("ready", ready)):
                if at is not None:
                    samples.setdefault((phase, source or "unknown"), []).append(
                        (at - requested).total_seconds()
                    )
        for (phase, source), values in sorted(samples.items()):
            buckets = [(_le(b), float(sum(v <= b for v in values))) for b in SCALEOUT_BUCKETS_S]
            buckets.append(("+Inf", float(len(values))))
            phases.add_metric([phase, source], buckets, gsum_value=sum(values))
        yield phases
        copies = GaugeMetricFamily(
            "streamserve_weight_copies", "Copies of each model's weights in the parameter pool",
            labels=["model", "kind", "state"],
        )  # fmt: skip
        for row in (
            WeightHolding.objects.order_by().values("model_preset", "kind", "state").annotate(n=Count("pk"))
        ):
            copies.add_metric([row["model_preset"], row["kind"], row["state"]], row["n"])
        yield copies
        loading = GaugeMetricFamily(
            "streamserve_worker_expected_ready_seconds",
            "Seconds until a provisioning worker is expected ready (the scale plan's estimate; < 0: late)",
            labels=["worker", "gpu_type"],
        )
        for name, gpu_type, expected in GpuWorker.objects.filter(
            status=GpuWorker.Status.PROVISIONING, expected_ready_at__isnull=False
        ).values_list("name", "gpu_type", "expected_ready_at"):
            loading.add_metric([name, gpu_type], (expected - now).total_seconds())
        yield loading


_registry: CollectorRegistry | None = None
_registry_lock = threading.Lock()


def registry() -> CollectorRegistry:
    """The process's registry holding one StreamServeCollector (built on first scrape)."""
    global _registry
    with _registry_lock:
        if _registry is None:
            built = CollectorRegistry(auto_describe=False)
            built.register(StreamServeCollector())
            _registry = built
        return _registry


def _authorized(request: HttpRequest) -> bool:
    token = settings.STREAMSERVE["METRICS_TOKEN"]
    if not token:
        return True
    scheme, _, presented = request.headers.get("Authorization", "").partition(" ")
    return scheme.lower() == "bearer" and hmac.compare_digest(presented.strip().encode(), token.encode())


@require_GET
def metrics_view(request: HttpRequest) -> HttpResponse:
    if not _authorized(request):
        response = HttpResponse(
            "metrics require Authorization: Bearer <METRICS_TOKEN>\n", status=401, content_type="text/plain"
        )
        response["WWW-Authenticate"] = 'Bearer realm="metrics"'
        return response
    try:
        body = generate_latest(registry())
    except DatabaseError as exc:
        logger.error("metrics.scrape_failed error=%r", str(exc))
        return HttpResponse(f"database unavailable: {exc}\n", status=503, content_type="text/plain")
    return HttpResponse(body, content_type=CONTENT_TYPE_LATEST)
