from __future__ import annotations

import csv
import io
from datetime import UTC, datetime, timedelta
from decimal import Decimal

import pytest

from gpu.models import CostLedgerEntry, GpuWorker, Region
from gpu.services import ledger_accrue
from tests.factories import GpuWorkerFactory

pytestmark = pytest.mark.django_db

T0 = datetime(2026, 3, 1, 10, 0, tzinfo=UTC)


def test_ledger_bills_from_request_to_release_in_minute_slices():
    # Requested 10:00:30, released 10:03:15 at $3.60/h = $0.001/s → 165 s, $0.165.
    worker = GpuWorkerFactory(
        requested_at=T0 + timedelta(seconds=30),
        ready_at=T0 + timedelta(seconds=90),
        status=GpuWorker.Status.RELEASED,
        released_at=T0 + timedelta(minutes=3, seconds=15),
    )
    written = ledger_accrue(until=T0 + timedelta(hours=1))
    entries = list(CostLedgerEntry.objects.filter(worker=worker).order_by("interval_start"))
    assert written == 4
    assert [e.gpu_seconds for e in entries] == [30.0, 60.0, 60.0, 15.0]
    assert sum(e.cost_usd for e in entries) == Decimal("0.165000")
    # Idempotent: running again writes nothing new.
    assert ledger_accrue(until=T0 + timedelta(hours=2)) == 0


def test_ledger_writes_only_closed_minutes_of_live_workers_and_continues_later():
    worker = GpuWorkerFactory(requested_at=T0, status=GpuWorker.Status.READY)
    ledger_accrue(until=T0 + timedelta(minutes=2, seconds=40))
    assert CostLedgerEntry.objects.filter(worker=worker).count() == 2
    ledger_accrue(until=T0 + timedelta(minutes=5, seconds=1))
    entries = CostLedgerEntry.objects.filter(worker=worker)
    assert entries.count() == 5
    assert sum(e.gpu_seconds for e in entries) == 300.0


def _ledger_fixture():
    h100 = GpuWorkerFactory(
        gpu_type="h100",
        price_per_hour=Decimal("3.6"),
        requested_at=T0,
        status=GpuWorker.Status.RELEASED,
        released_at=T0 + timedelta(minutes=90),
    )
    h20 = GpuWorkerFactory(
        gpu_type="h20",
        price_per_hour=Decimal("1.8"),
        requested_at=T0 + timedelta(minutes=30),
        status=GpuWorker.Status.RELEASED,
        released_at=T0 + timedelta(minutes=150),
    )
    ledger_accrue(until=T0 + timedelta(hours=5))
    return h100, h20


def test_cost_audit_buckets_by_hour_and_gpu_type_match_hand_computed_values(staff_api):
    _ledger_fixture()
    response = staff_api.get(
        "/api/audit/cost/", {"start": "2026-03-01T10:00:00Z", "end": "2026-03-01T13:00:00Z", "bucket": "hour"}
    )
    assert response.status_code == 200, response.content
    body = response.json()
    # 10:00–11:00: h100 3600 s ($3.60) + h20 1800 s ($0.90); 11:00–12:00: h100 1800 s ($1.80) + h20 3600 s
    # ($1.80); 12:00–13:00: h20 1800 s ($0.90).
    got = [
        (b["start"][:13], b["gpu_seconds"], Decimal(str(b["cost_usd"])), sorted(b["by_gpu_type"]))
        for b in body["buckets"]
    ]
    assert got == [
        ("2026-03-01T10", 5400.0, Decimal("4.5"), ["h100", "h20"]),
        ("2026-03-01T11", 5400.0, Decimal("3.6"), ["h100", "h20"]),
        ("2026-03-01T12", 1800.0, Decimal("0.9"), ["h20"]),
    ]
    assert body["totals"]["gpu_seconds"] == 12600.0
    assert Decimal(str(body["totals"]["cost_usd"])) == Decimal("9.0")
    assert Decimal(str(body["totals"]["by_gpu_type"]["h20"]["cost_usd"])) == Decimal("3.6")


def test_cost_audit_csv_totals_match_json(staff_api):
    _ledger_fixture()
    params = {"start": "2026-03-01T10:00:00Z", "end": "2026-03-01T13:00:00Z", "bucket": "day"}
    json_body = staff_api.get("/api/audit/cost/", params).json()
    response = staff_api.get("/api/audit/cost/", {**params, "format": "csv"})
    assert response.status_code == 200
    assert response["Content-Type"].startswith("text/csv")
    rows = list(csv.DictReader(io.StringIO(response.content.decode())))
    assert {r["gpu_type"] for r in rows} == {"h100", "h20"}
    assert sum(Decimal(r["cost_usd"]) for r in rows) == Decimal(str(json_body["totals"]["cost_usd"]))
    assert sum(float(r["gpu_seconds"]) for r in rows) == json_body["totals"]["gpu_seconds"]


@pytest.mark.parametrize(
    ("params", "field"),
    [
        ({"start": "yesterday"}, "start"),
        ({"start": "2026-03-01T12:00:00Z", "end": "2026-03-01T10:00:00Z"}, "end"),
        ({"bucket": "week"}, "bucket"),
        ({"start": "2020-01-01T00:00:00Z", "end": "2026-01-01T00:00:00Z", "bucket": "minute"}, "bucket"),
    ],
)
def test_cost_audit_rejects_invalid_time_ranges(staff_api, params, field):
    response = staff_api.get("/api/audit/cost/", params)
    assert response.status_code == 400
    assert field in response.json()


def test_audit_and_operator_endpoints_are_staff_only(user_api):
    for url in [
        "/api/audit/cost/",
        "/api/audit/latency/",
        "/api/workers/",
        "/api/decisions/",
        "/api/migrations/",
        "/api/scaling-actions/",
        "/api/scheduler/config/",
    ]:
        assert user_api.get(url).status_code == 403, url


def test_cost_audit_splits_by_region(staff_api):
    # given the h100 in region east and the h20 without a region (the local region)
    h100, _h20 = _ledger_fixture()
    h100.region = Region.objects.create(name="east")
    h100.save(update_fields=["region"])
    params = {"start": "2026-03-01T10:00:00Z", "end": "2026-03-01T13:00:00Z", "bucket": "hour"}
    # when the audit is read as JSON and as CSV
    body = staff_api.get("/api/audit/cost/", params).json()
    rows = list(
        csv.DictReader(
            io.StringIO(staff_api.get("/api/audit/cost/", {**params, "format": "csv"}).content.decode())
        )
    )
    # then each bucket and the totals carry the split by region (h100 90 min, h20 120 min)
    first = body["buckets"][0]["by_region"]
    assert {name: figures["gpu_seconds"] for name, figures in first.items()} == {
        "east": 3600.0,
        "local": 1800.0,
    }
    totals = body["totals"]["by_region"]
    assert (Decimal(str(totals["east"]["cost_usd"])), Decimal(str(totals["local"]["cost_usd"]))) == (
        Decimal("5.4"),
        Decimal("3.6"),
    )
    # and the CSV has one row per bucket, GPU type and region
    assert {(r["gpu_type"], r["region"]) for r in rows} == {("h100", "east"), ("h20", "local")}
