"""GPU-seconds charged to tenants, measured from the audit's own records (issue 29).

A chunk is charged the share of its worker's step it used: the step's time (``generation_ms`` of
its ``ChunkRecord``, the coalesced batch's time) over the batch's size — a chunk in a batch of four
costs a quarter of the step. A one-shot job is charged the generation time its worker measured
(``Job.run_s``: its steps, without queueing and pauses) in the bucket it ended in. Money is the
charged seconds at the worker's price, as the ledger bills it. What the ledger billed on a worker
and no tenant used — boot, model load, idle slots, steps of work that failed before reporting — is
the pool's overhead, shown apart: per bucket, the tenants' sums plus the overhead are the ledger's.

Two limits of the records: charges come from ingested chunk records, so the newest seconds appear
as the ingester drains them (and the ledger's open minute is billed once it closes: a bucket read
before that may show a negative overhead); raw chunk records are kept ``CHUNK_RETENTION_DAYS``, so
usage is read inside that window.
"""

from __future__ import annotations

from collections import defaultdict
from datetime import datetime
from decimal import Decimal

from django.db.models import FloatField, Q, Sum, Value
from django.db.models.functions import Cast, Coalesce, Trunc

from contracts.http.timerange import TimeRange
from gpu.models import CostLedgerEntry, GpuWorker
from sessions.models import ChunkRecord, Job, Tenant

CENT_MICROS = Decimal("0.000001")


def _tenant_name(field: str) -> Coalesce:
    """A row's tenant name; null (rows older than tenants) is the default tenant."""
    return Coalesce(field, Value(Tenant.DEFAULT_NAME))


def _chunk_share() -> Sum:
    # The batch-aware share of the step, in seconds (generation_ms is the coalesced step's time).
    return Sum(Cast("generation_ms", FloatField()) / Cast("batch_size", FloatField()) / 1000.0)


def _of_tenant(tenant: Tenant, field: str) -> Q:
    q = Q(**{field: tenant})
    return q | Q(**{f"{field}__isnull": True}) if tenant.name == Tenant.DEFAULT_NAME else q


def tenant_gpu_seconds(*, tenant: Tenant, since: datetime, until: datetime) -> float:
    """GPU-seconds charged to ``tenant`` in [since, until): its chunks' shares and its ended jobs."""
    chunks = ChunkRecord.objects.filter(
        _of_tenant(tenant, "session__tenant"), created_at__gte=since, created_at__lt=until
    ).aggregate(s=_chunk_share())["s"]
    jobs = Job.objects.filter(
        _of_tenant(tenant, "tenant"), finished_at__gte=since, finished_at__lt=until, run_s__isnull=False
    ).aggregate(s=Sum("run_s"))["s"]
    return (chunks or 0.0) + (jobs or 0.0)


def tenants_gpu_seconds(*, since: datetime, until: datetime) -> dict[str, float]:
    """GPU-seconds charged to each tenant (by name) in [since, until): the fair share's usage."""
    usage: dict[str, float] = defaultdict(float)
    chunks = (
        ChunkRecord.objects.filter(created_at__gte=since, created_at__lt=until)
        .annotate(tenant_name=_tenant_name("session__tenant__name"))
        .values("tenant_name")
        .annotate(s=_chunk_share())
    )
    jobs = (
        Job.objects.filter(finished_at__gte=since, finished_at__lt=until, run_s__isnull=False)
        .annotate(tenant_name=_tenant_name("tenant__name"))
        .values("tenant_name")
        .annotate(s=Sum("run_s"))
    )
    for row in [*chunks, *jobs]:
        usage[row["tenant_name"]] += row["s"] or 0.0
    return dict(usage)


def charge_rows(*, time_range: TimeRange, tenant: Tenant | None = None) -> list[dict]:
    """Charges per bucket, tenant and worker: ``stream_gpu_seconds`` (chunks), ``job_gpu_seconds``."""
    chunks = ChunkRecord.objects.filter(created_at__gte=time_range.start, created_at__lt=time_range.end)
    jobs = Job.objects.filter(
        finished_at__gte=time_range.start, finished_at__lt=time_range.end, run_s__isnull=False
    )
    if tenant is not None:
        chunks = chunks.filter(_of_tenant(tenant, "session__tenant"))
        jobs = jobs.filter(_of_tenant(tenant, "tenant"))
    rows: dict[tuple, dict] = {}
    for kind, query in (
        (
            "stream_gpu_seconds",
            chunks.annotate(
                bucket=Trunc("created_at", time_range.bucket),
                tenant_name=_tenant_name("session__tenant__name"),
            )
            .values("bucket", "tenant_name", "worker_id")
            .annotate(s=_chunk_share()),
        ),
        (
            "job_gpu_seconds",
            jobs.annotate(
                bucket=Trunc("finished_at", time_range.bucket), tenant_name=_tenant_name("tenant__name")
            )
            .values("bucket", "tenant_name", "worker_id")
            .annotate(s=Sum("run_s")),
        ),
    ):
        for row in query:
            key = (row["bucket"], row["tenant_name"], row["worker_id"])
            entry = rows.setdefault(
                key,
                {
                    "bucket": row["bucket"],
                    "tenant": row["tenant_name"],
                    "worker_id": row["worker_id"],
                    "stream_gpu_seconds": 0.0,
                    "job_gpu_seconds": 0.0,
                },
            )
            entry[kind] += row["s"] or 0.0
    return sorted(rows.values(), key=lambda r: (r["bucket"], r["tenant"], r["worker_id"] or 0))


def _per_second(worker_ids) -> dict:
    return {
        pk: Decimal(price) / Decimal(3600)
        for pk, price in GpuWorker.objects.filter(pk__in=worker_ids).values_list("pk", "price_per_hour")
    }


def _figures() -> dict:
    return {"stream_gpu_seconds": 0.0, "job_gpu_seconds": 0.0, "gpu_seconds": 0.0, "cost_usd": Decimal(0)}


def _charge(figures: dict, row: dict, cost: Decimal) -> None:
    figures["stream_gpu_seconds"] += row["stream_gpu_seconds"]
    figures["job_gpu_seconds"] += row["job_gpu_seconds"]
    figures["gpu_seconds"] += row["stream_gpu_seconds"] + row["job_gpu_seconds"]
    figures["cost_usd"] += cost


def usage_buckets(*, time_range: TimeRange, tenant: Tenant | None = None) -> dict:
    """Per bucket: each tenant's charged GPU-seconds and money; with ``tenant=None`` (the whole pool)
    also the ledger's figures and the pool's overhead (ledger − charged), so that per bucket the
    tenants plus the overhead are the ledger. A chunk record without a worker (its row deleted) is
    charged seconds at no price."""
    charges = charge_rows(time_range=time_range, tenant=tenant)
    price = _per_second({r["worker_id"] for r in charges if r["worker_id"] is not None})
    buckets: dict = {}
    totals: dict = {"by_tenant": defaultdict(_figures)}
    for row in charges:
        seconds = row["stream_gpu_seconds"] + row["job_gpu_seconds"]
        cost = (price.get(row["worker_id"], Decimal(0)) * Decimal(repr(seconds))).quantize(CENT_MICROS)
        entry = buckets.setdefault(
            row["bucket"], {"start": row["bucket"], "by_tenant": defaultdict(_figures)}
        )
        _charge(entry["by_tenant"][row["tenant"]], row, cost)
        _charge(totals["by_tenant"][row["tenant"]], row, cost)
    report: dict = {"start": time_range.start, "end": time_range.end, "bucket": time_range.bucket}
    if tenant is None:
        ledger = (
            CostLedgerEntry.objects.filter(
                interval_start__gte=time_range.start, interval_start__lt=time_range.end
            )
            .annotate(bucket=Trunc("interval_start", time_range.bucket))
            .values("bucket")
            .annotate(gpu_seconds=Sum("gpu_seconds"), cost_usd=Sum("cost_usd"))
        )
        for row in ledger:
            buckets.setdefault(row["bucket"], {"start": row["bucket"], "by_tenant": defaultdict(_figures)})
            buckets[row["bucket"]]["ledger"] = {
                "gpu_seconds": row["gpu_seconds"],
                "cost_usd": row["cost_usd"],
            }
        totals["ledger"] = {"gpu_seconds": 0.0, "cost_usd": Decimal(0)}
        totals["pool_overhead"] = {"gpu_seconds": 0.0, "cost_usd": Decimal(0)}
        for entry in buckets.values():
            entry.setdefault("ledger", {"gpu_seconds": 0.0, "cost_usd": Decimal(0)})
            entry["pool_overhead"] = _overhead(entry["ledger"], entry["by_tenant"].values())
            for part in ("ledger", "pool_overhead"):
                totals[part]["gpu_seconds"] += entry[part]["gpu_seconds"]
                totals[part]["cost_usd"] += entry[part]["cost_usd"]
    report["buckets"] = [
        {**entry, "by_tenant": dict(entry["by_tenant"])} for _, entry in sorted(buckets.items())
    ]
    report["totals"] = {**totals, "by_tenant": dict(totals["by_tenant"])}
    return report


def _overhead(ledger: dict, charged) -> dict:
    charged = list(charged)
    return {
        "gpu_seconds": ledger["gpu_seconds"] - sum(f["gpu_seconds"] for f in charged),
        "cost_usd": ledger["cost_usd"] - sum((f["cost_usd"] for f in charged), Decimal(0)),
    }


def usage_csv_rows(report: dict) -> list[list]:
    """One row per bucket and tenant (then the pool's overhead, when the report has it), for
    chargeback: bucket start, tenant, stream, job and total GPU-seconds, money."""
    rows = []
    for entry in report["buckets"]:
        for name, figures in sorted(entry["by_tenant"].items()):
            rows.append(
                [
                    entry["start"],
                    name,
                    figures["stream_gpu_seconds"],
                    figures["job_gpu_seconds"],
                    figures["gpu_seconds"],
                    figures["cost_usd"],
                ]
            )
        if "pool_overhead" in entry:
            overhead = entry["pool_overhead"]
            rows.append(
                [entry["start"], "(pool overhead)", "", "", overhead["gpu_seconds"], overhead["cost_usd"]]
            )
    return rows


USAGE_CSV_HEADER = [
    "bucket_start",
    "tenant",
    "stream_gpu_seconds",
    "job_gpu_seconds",
    "gpu_seconds",
    "cost_usd",
]
