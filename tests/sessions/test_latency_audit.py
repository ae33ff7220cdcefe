from __future__ import annotations

import csv
import io
from datetime import UTC, datetime, timedelta

import pytest
from django.utils import timezone

from gpu.models import Region
from sessions.models import ChunkLatencyRollup, ChunkRecord
from sessions.selectors import histogram_percentile, latency_bucket_index
from sessions.services import chunk_records_prune, chunk_rollup
from tests.factories import ChunkRecordFactory, GpuWorkerFactory, SessionFactory

pytestmark = pytest.mark.django_db

T0 = datetime(2026, 3, 1, 10, 0, tzinfo=UTC)


def _chunks(latencies_by_minute: dict[int, list[float]]):
    worker = GpuWorkerFactory()
    session = SessionFactory()
    index = 0
    for minute, latencies in latencies_by_minute.items():
        for i, ms in enumerate(latencies):
            ChunkRecordFactory(
                session=session,
                chunk_index=index,
                worker=worker,
                generation_ms=ms,
                created_at=T0 + timedelta(minutes=minute, seconds=i * 0.5),
            )
            index += 1
    return worker


def _interp_percentile(values: list[float], p: float) -> float:
    """Hand-rolled percentile_cont: linear interpolation between closest ranks."""
    ordered = sorted(values)
    rank = p * (len(ordered) - 1)
    lo, hi = int(rank), min(int(rank) + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (rank - lo)


def test_latency_audit_percentiles_match_hand_computed_values(staff_api):
    minute0 = [100.0, 200.0, 300.0, 400.0, 1500.0]
    minute1 = [250.0, 260.0]
    _chunks({0: minute0, 1: minute1})
    response = staff_api.get(
        "/api/audit/latency/",
        {
            "start": "2026-03-01T10:00:00Z",
            "end": "2026-03-01T10:05:00Z",
            "bucket": "minute",
            "slo_ms": 1000,
            "source": "raw",
        },
    )
    assert response.status_code == 200, response.content
    body = response.json()
    first, second = body["buckets"]
    assert first["count"] == 5 and second["count"] == 2
    assert first["p50_ms"] == pytest.approx(_interp_percentile(minute0, 0.5))
    assert first["p95_ms"] == pytest.approx(_interp_percentile(minute0, 0.95))
    assert first["p99_ms"] == pytest.approx(_interp_percentile(minute0, 0.99))
    assert first["max_ms"] == 1500.0
    assert first["slo_passed"] == 4 and second["slo_passed"] == 2
    assert body["totals"]["slo_pass_rate"] == pytest.approx(6 / 7)
    hourly = staff_api.get(
        "/api/audit/latency/",
        {"start": "2026-03-01T10:00:00Z", "end": "2026-03-01T11:00:00Z", "bucket": "hour", "source": "raw"},
    ).json()
    assert hourly["buckets"][0]["p50_ms"] == pytest.approx(_interp_percentile(minute0 + minute1, 0.5))


def test_latency_audit_csv_matches_json(staff_api):
    _chunks({0: [100.0, 120.0], 2: [90.0]})
    params = {"start": "2026-03-01T10:00:00Z", "end": "2026-03-01T10:10:00Z", "source": "raw"}
    body = staff_api.get("/api/audit/latency/", params).json()
    rows = list(
        csv.DictReader(
            io.StringIO(staff_api.get("/api/audit/latency/", {**params, "format": "csv"}).content.decode())
        )
    )
    assert [int(r["count"]) for r in rows] == [b["count"] for b in body["buckets"]] == [2, 1]
    assert float(rows[0]["max_ms"]) == 120.0
    assert {r["region"] for r in rows} == {"local"}


def test_rollup_histograms_agree_with_raw_percentiles_within_bucket_width(staff_api):
    latencies = [80.0 + 7.3 * i for i in range(200)]
    _chunks({0: latencies[:100], 1: latencies[100:]})
    assert chunk_rollup(since=T0, until=T0 + timedelta(minutes=5)) == 2
    rollups = list(ChunkLatencyRollup.objects.order_by("minute"))
    assert [r.count for r in rollups] == [100, 100]
    assert sum(rollups[0].histogram) == 100
    params = {"start": "2026-03-01T10:00:00Z", "end": "2026-03-01T11:00:00Z", "bucket": "hour"}
    raw = staff_api.get("/api/audit/latency/", {**params, "source": "raw"}).json()["buckets"][0]
    rolled = staff_api.get("/api/audit/latency/", {**params, "source": "rollup"}).json()["buckets"][0]
    assert rolled["count"] == raw["count"] == 200
    assert rolled["max_ms"] == raw["max_ms"]
    for key in ("p50_ms", "p95_ms", "p99_ms"):
        assert rolled[key] == pytest.approx(raw[key], rel=0.075)
    # Re-running the rollup over the same minutes upserts rather than duplicating.
    chunk_rollup(since=T0, until=T0 + timedelta(minutes=5))
    assert ChunkLatencyRollup.objects.count() == 2


def test_latency_audit_splits_by_region_from_raw_records_and_from_rollups(staff_api):
    # given chunks from a worker in the local region (no region) and, in the same minute, from one in east
    _chunks({0: [100.0, 300.0]})
    east = GpuWorkerFactory(region=Region.objects.create(name="east", rtt_ms={"nyc": 3}))
    session = SessionFactory()
    for i, ms in enumerate([200.0, 1200.0, 400.0]):
        ChunkRecordFactory(
            session=session,
            chunk_index=i,
            worker=east,
            generation_ms=ms,
            created_at=T0 + timedelta(seconds=i),
        )
    params = {
        "start": "2026-03-01T10:00:00Z",
        "end": "2026-03-01T10:05:00Z",
        "bucket": "minute",
        "slo_ms": 1000,
    }
    # when the audit is read from raw records, then each bucket and the totals split by region
    raw = staff_api.get("/api/audit/latency/", {**params, "source": "raw"}).json()
    (bucket,) = raw["buckets"]
    assert {name: (r["count"], r["max_ms"], r["slo_passed"]) for name, r in bucket["by_region"].items()} == {
        "east": (3, 1200.0, 2),
        "local": (2, 300.0, 2),
    }
    assert bucket["by_region"]["east"]["p50_ms"] == pytest.approx(400.0)
    assert raw["totals"]["by_region"]["east"]["slo_pass_rate"] == pytest.approx(2 / 3)
    assert raw["totals"]["count"] == 5
    # and the CSV has one row per bucket and region, with the JSON's figures
    csv_rows = list(
        csv.DictReader(
            io.StringIO(
                staff_api.get(
                    "/api/audit/latency/", {**params, "source": "raw", "format": "csv"}
                ).content.decode()
            )
        )
    )
    assert [(r["region"], int(r["count"]), int(r["slo_passed"])) for r in csv_rows] == [
        ("east", 3, 2),
        ("local", 2, 2),
    ]
    assert float(csv_rows[0]["p50_ms"]) == pytest.approx(400.0)
    assert {r["bucket_start"] for r in csv_rows} == {"2026-03-01T10:00:00+00:00"}
    # and the rollups (one per worker and minute) give the same split
    chunk_rollup(since=T0, until=T0 + timedelta(minutes=5))
    rolled = staff_api.get("/api/audit/latency/", {**params, "source": "rollup"}).json()
    assert {name: r["count"] for name, r in rolled["buckets"][0]["by_region"].items()} == {
        "east": 3,
        "local": 2,
    }
    assert rolled["totals"]["by_region"]["east"]["max_ms"] == 1200.0


def test_histogram_helpers_follow_width_bucket_convention():
    assert latency_bucket_index(0.0) == 0
    assert latency_bucket_index(5.0) == 1  # [5, 5.75) is bucket 1
    hist = [0] * 61
    hist[latency_bucket_index(100.0)] = 10
    assert 90 <= histogram_percentile(hist, 0.5) <= 115
    assert histogram_percentile([0] * 61, 0.5) is None


def test_prune_deletes_only_rolled_up_rows_past_retention(settings):
    settings.STREAMSERVE = {**settings.STREAMSERVE, "CHUNK_RETENTION_DAYS": 1}
    now = timezone.now()
    old = now - timedelta(days=3)
    worker = GpuWorkerFactory()
    session = SessionFactory()
    for i in range(3):
        ChunkRecordFactory(
            session=session, chunk_index=i, worker=worker, created_at=old + timedelta(seconds=i)
        )
    ChunkRecordFactory(session=session, chunk_index=3, worker=worker, created_at=now)
    assert chunk_records_prune(now=now) == 0  # nothing rolled up yet: keep everything
    chunk_rollup(since=old - timedelta(minutes=1), until=old + timedelta(minutes=2))
    assert chunk_records_prune(now=now) == 3
    assert list(ChunkRecord.objects.values_list("chunk_index", flat=True)) == [3]


def test_latency_audit_rejects_bad_parameters(staff_api):
    assert "slo_ms" in staff_api.get("/api/audit/latency/", {"slo_ms": "-3"}).json()
    assert "source" in staff_api.get("/api/audit/latency/", {"source": "magic"}).json()
