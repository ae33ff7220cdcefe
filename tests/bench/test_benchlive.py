"""The benchmarks' pure helpers: percentiles, summaries, JSON, URLs, frames, the activation arithmetic."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

from workers.benchlive import dumps, jpeg_frames, percentile, redis_url_with_db, summarize


@pytest.mark.parametrize("q", [0, 1, 50, 90, 99, 100])
def test_percentile_matches_numpy_linear(q):
    values = sorted(float(v) for v in np.random.default_rng(3).exponential(5.0, size=257))
    assert percentile(values, q) == pytest.approx(float(np.percentile(values, q)))


def test_summary_of_nothing_is_null_in_json():
    report = json.loads(dumps({"figures": summarize([])}))
    assert report["figures"] == {"count": 0, "p50": None, "p99": None, "max": None, "mean": None}


def test_summary_figures():
    figures = summarize([4.0, 1.0, 3.0, 2.0])
    assert (
        figures["count"] == 4 and figures["max"] == 4.0 and figures["p50"] == 2.5 and figures["mean"] == 2.5
    )
    assert not math.isnan(figures["p99"])


def test_redis_url_with_db_keeps_server_and_credentials():
    assert redis_url_with_db("redis://:pw@10.0.0.1:6380/0", 14) == "redis://:pw@10.0.0.1:6380/14"
    assert redis_url_with_db("redis://127.0.0.1:6379", 15) == "redis://127.0.0.1:6379/15"


def test_jpeg_frames_are_real_jpegs_of_the_tiny_size():
    from io import BytesIO

    from PIL import Image

    frames = jpeg_frames(64, 64, 4, seed=1)
    assert len(frames) == 4
    for frame in frames:
        image = Image.open(BytesIO(frame))
        assert image.format == "JPEG" and image.size == (64, 64)
        assert 1500 < len(frame) < 5000  # the tiny model's frames are ~2.7 KB


def test_activation_components_from_timestamps():
    from scheduling.management.commands.bench_activation import components

    sample = {
        "t0": 100.0, "t_created": 100.05, "t_decision": 100.08, "t_command": 100.1, "t_ack": 100.13,
        "t_first": 100.3, "generated_at": 100.29, "generation_ms": 70.0,
    }  # fmt: skip
    c = components(sample)
    assert c["api_ms"] == pytest.approx(50.0)
    assert c["to_decision_ms"] == pytest.approx(80.0)
    assert c["decision_to_command_ms"] == pytest.approx(20.0)
    assert c["command_to_ack_ms"] == pytest.approx(30.0)
    assert c["control_plane_ms"] == pytest.approx(130.0)
    assert c["first_chunk_ms"] == pytest.approx(300.0)
    assert c["delivery_ms"] == pytest.approx(10.0)
    assert c["generation_ms"] == 70.0
