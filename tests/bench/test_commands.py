"""Each live-loop benchmark runs end to end with tiny sizes and prints one JSON object of the documented
shape with positive figures (no timing is asserted: benchmarks are commands, not tests)."""

from __future__ import annotations

import io
import json

import pytest
from django.core.management import call_command
from django.db import connection

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.slow]


def run(name: str, **options) -> dict:
    out = io.StringIO()
    # The test database itself: the command's child processes see what the test commits.
    call_command(name, json=True, database=connection.settings_dict["NAME"], stdout=out, **options)
    lines = [line for line in out.getvalue().splitlines() if line.strip()]
    assert len(lines) == 1, out.getvalue()
    return json.loads(lines[0])


def positive_summary(summary: dict, count: int | None = None) -> None:
    assert set(summary) == {"count", "p50", "p99", "max", "mean"}
    assert summary["count"] > 0 if count is None else summary["count"] == count
    assert 0 < summary["p50"] <= summary["p99"] <= summary["max"]


def test_bench_ingest_inserts_every_record_and_cleans_up():
    from django.contrib.auth import get_user_model

    from gpu.models import GpuWorker
    from sessions.models import ChunkRecord, GenerationSession

    report = run("bench_ingest", records=300, batch=40, sessions=3)

    assert report["benchmark"] == "ingest"
    assert report["inserted"] == report["stored"] == 300
    assert report["batches"] == 8
    assert report["records_per_s"] > 0 and report["min_window_records_per_s"] > 0
    positive_summary(report["batch_ms"], count=8)
    assert isinstance(report["target_met"], bool)
    assert not GenerationSession.objects.filter(model_name="bench-ingest").exists()
    assert not GpuWorker.objects.filter(name__startswith="bench-ingest-").exists()
    assert not get_user_model().objects.filter(username__startswith="bench-ingest-").exists()
    assert ChunkRecord.objects.count() == 0


def test_bench_delivery_delivers_every_chunk_to_every_stream():
    from sessions.models import GenerationSession

    report = run("bench_delivery", streams="3", chunks_per_stream=4, warmup=1, period=0.2)

    assert report["benchmark"] == "delivery"
    (result,) = report["runs"]
    assert result["streams"] == 3
    assert result["expected"] == 12
    assert result["received"] + result["lost"] + result["skipped"] == 12
    positive_summary(result["added_delay_ms"])
    assert result["publisher"]["published"] == 12
    assert 1500 < result["chunk_bytes_mean"] / 4 < 5000
    assert report["target_met"] is None  # no 200-stream run
    assert not GenerationSession.objects.exists()


def test_bench_delivery_at_the_models_size_delivers_photo_fragments_sent_beside_their_messages():
    from contracts.wire.frames import PAYLOAD_INLINE_MAX_BYTES

    report = run(
        "bench_delivery",
        streams="2",
        chunks_per_stream=3,
        warmup=0,
        period=0.75,
        width=832,
        height=480,
        frames=12,
        codec="h264",
    )

    (result,) = report["runs"]
    assert report["shape"]["content"] == "photo"
    assert (result["received"], result["lost"], result["skipped"]) == (6, 0, 0)
    # The fragments are over the inline limit: each reached its viewer through its Redis key
    assert min(result["publisher"]["each"][0]["chunk_bytes"]) > PAYLOAD_INLINE_MAX_BYTES
    assert result["chunk_bytes_mean"] > PAYLOAD_INLINE_MAX_BYTES
    assert result["redis_bytes_per_s"]["out"] > 0


def test_bench_delivery_with_webrtc_viewers_reports_the_web_loop_lag_beside_the_socket_delay():
    from sessions.models import GenerationSession

    report = run(
        "bench_delivery",
        streams="1",
        chunks_per_stream=3,
        warmup=0,
        period=0.5,
        codec="h264",
        webrtc_viewers="0,2",
    )

    assert report["webrtc_viewers"] == [0, 2]
    assert report["webrtc_media"] == "process"  # the peer connections in a media process, as deployed
    without, with_webrtc = report["runs"]
    assert with_webrtc["media_cpu_s"] > 0
    for result in (without, with_webrtc):
        assert (result["received"], result["lost"], result["skipped"]) == (3, 0, 0)
        assert result["loop_lag_ms"]["count"] > 0 and result["loop_lag_ms"]["max"] >= 0
    assert without["webrtc"] is None
    webrtc = with_webrtc["webrtc"]
    # Both peers got the pictures over their peer connections (each chunk once, announced on its socket)
    assert (webrtc["connected"], webrtc["errors"], webrtc["skipped"]) == (2, [], 0)
    assert webrtc["chunks_announced"] == 2 * 3
    # every picture but each peer's last (aiortc completes a picture when the next one begins)
    assert webrtc["pictures_received"] == webrtc["pictures_expected"] == 2 * (3 * 4 - 1)
    assert not GenerationSession.objects.exists()


def test_bench_delivery_refuses_webrtc_viewers_without_h264():
    from django.core.management.base import CommandError

    with pytest.raises(CommandError, match=r"WebRTC carries H\.264 only"):
        run("bench_delivery", streams="1", webrtc_viewers="1", codec="jpeg")


@pytest.mark.browser  # it drives Chromium through Playwright
def test_bench_glass_reports_glass_to_glass_for_each_transport_in_chromium():
    from sessions.models import GenerationSession

    report = run("bench_glass", chunks=6, warmup=2, period=0.5, width=64, height=64, frames=4)

    assert report["benchmark"] == "glass" and "one machine" in report["clock"]
    assert [r["transport"] for r in report["runs"]] == ["mse", "webrtc", "jpeg"]
    for result in report["runs"]:
        assert result["page_errors"] == [] and result["player_stats"]["decodeErrors"] == 0, result
        positive_summary(result["arrival_ms"])
        positive_summary(result["glass_ms"])
        # A frame is on screen after its chunk arrived, never before
        assert result["glass_ms"]["p50"] >= result["arrival_ms"]["p50"]
        assert result["publisher"]["published"] == 6
    assert set(report["target_met"]) == {"mse", "webrtc", "jpeg"}
    assert not GenerationSession.objects.exists()


def test_bench_activation_measures_the_control_plane_share():
    from gpu.models import GpuWorker
    from sessions.models import GenerationSession

    report = run("bench_activation", sessions=1, warmup=0, workers=1, pause=0.0, paths="native,realtime")

    assert report["benchmark"] == "activation" and report["paths"] == ["native", "realtime"]
    assert report["measured"] == 2 and report["incomplete"] == 0
    for path in ("native", "realtime"):  # the same activation through both front doors
        for key in ("control_plane_ms", "generation_ms", "first_chunk_ms", "command_to_ack_ms"):
            positive_summary(report["components_ms_by_path"][path][key], count=1)
    assert report["components_ms"] == report["components_ms_by_path"]["native"]
    sample = next(s for s in report["samples"] if s["path"] == "native")
    parts = sample["to_decision_ms"] + sample["decision_to_command_ms"] + sample["command_to_ack_ms"]
    assert sample["control_plane_ms"] == pytest.approx(parts, abs=0.01)
    assert sample["api_ms"] > 0 and sample["decision_to_command_ms"] >= 0
    assert not GenerationSession.objects.exists()
    assert not GpuWorker.objects.filter(status__in=GpuWorker.LIVE_STATUSES).exists()


def test_soak_reports_what_its_clients_saw_and_every_process_memory():
    from sessions.models import GenerationSession

    # Every idle period is a viewer leaving (its socket closed, reopened after it), under a short grace.
    report = run(
        "soak",
        sessions=2,
        minutes=0.4,
        max_workers=1,
        mean_period=10.0,
        sample=5.0,
        leave_share=1.0,
        viewer_grace_s=1.0,
    )

    assert report["benchmark"] == "soak" and report["sessions"] == 2
    assert report["chunks_received"] > 0
    assert report["chunks_per_session"]["count"] == 2
    for key in (
        "duplicates",
        "skips",
        "out_of_order",
        "lost_records",
        "dropped_for_slow_clients",
        "published_before_client_joined",
        "viewer_leaves",
        "missed_while_away",
    ):
        assert isinstance(report[key], int) and report[key] >= 0
    assert report["viewer_rule_env"] == {"SESSION_VIEWER_GRACE_S": "1.0"}
    assert report["viewer_leaves"] >= 1 and report["pauses"] == 0
    assert report["client_error_count"] == 0, report["client_errors"]
    assert set(report["idle_reasons"]) <= {"user", "no_viewers"}
    roles = set(report["memory_mb"])
    assert {"web", "celery", "beat"} <= roles
    assert any(role.startswith("gpuworker:") for role in roles), roles
    for series in report["memory_mb"].values():
        assert series["max"] >= series["first"] > 0 and series["samples"]
    assert report["platform_died"] is None
    assert not GenerationSession.objects.exists()  # the run's sessions are cleaned up
