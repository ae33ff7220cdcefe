"""The benchmarks' harness (contracts.bench) and pure helpers: summaries, rounds, the machine, JSON
out, URLs, frames, the activation arithmetic."""

from __future__ import annotations

import argparse
import io
import json
import math
from io import BytesIO

import pytest
from django.core.management import call_command
from PIL import Image

from contracts import bench
from scheduling.benchmarks.activation import components
from workers.benchmarks.delivery_publisher import jpeg_frames
from workers.benchmarks.live import redis_url_with_db


def test_summary_of_nothing_is_null_in_json():
    report = json.loads(bench.dumps({"figures": bench.summarize([])}))
    assert report["figures"] == {"count": 0, "p50": None, "p99": None, "max": None, "mean": None}


def test_summary_figures():
    figures = bench.summarize([4.0, 1.0, 3.0, 2.0])
    assert (
        figures["count"] == 4 and figures["max"] == 4.0 and figures["p50"] == 2.5 and figures["mean"] == 2.5
    )
    assert figures["p99"] == pytest.approx(3.97)  # linear interpolation between the two largest
    assert all(type(v) in (int, float) for v in figures.values())  # JSON-able, not numpy scalars


def test_rounds_drop_the_warmup_and_count_every_round():
    assert list(bench.rounds(3, warmup=2)) == [(0, False), (1, False), (2, True), (3, True), (4, True)]
    assert [r.measured for r in bench.rounds(2)] == [True, True]


def test_common_arguments_parse():
    parser = argparse.ArgumentParser()
    bench.add_report_arguments(parser)
    bench.add_warmup_argument(parser, default=2, help="warm-up")
    bench.add_repeats_argument(parser, default=5, help="repeats")
    bench.add_seed_argument(parser)
    args = parser.parse_args(["--json", "--out", "r.json", "--warmup", "1", "--repeats", "3", "--seed", "7"])
    assert (args.json, args.out, args.warmup, args.repeats, args.seed) == (True, "r.json", 1, 3, 7)
    defaults = parser.parse_args([])
    assert (defaults.json, defaults.out, defaults.warmup, defaults.repeats, defaults.seed) == (
        False,
        None,
        2,
        5,
        0,
    )


def test_machine_description_names_the_hardware_and_versions():
    machine = bench.describe_machine()
    assert machine["cores_logical"] >= 1 and machine["memory_bytes"] > 0
    assert machine["cpu"] and machine["python"].count(".") == 2
    assert machine["torch"]  # installed with the project
    assert "gpu" in machine and len(machine["loadavg"]) == 3
    json.dumps(machine)


def test_emit_prints_one_json_line_and_writes_out(tmp_path):
    printed: list[str] = []
    out = tmp_path / "report.json"
    report = {"figure": math.nan, "rows": [1.5]}
    bench.emit(report, json_mode=True, out=str(out), text=lambda r: "text", write=printed.append)
    (line,) = printed
    assert "\n" not in line
    assert json.loads(line) == json.loads(out.read_text())
    assert json.loads(line)["figure"] is None and "machine" in json.loads(line)


def test_emit_prints_the_text_and_nothing_when_it_is_empty():
    printed: list[str] = []
    bench.emit({"a": 1}, json_mode=False, out=None, text=lambda r: f"a = {r['a']}", write=printed.append)
    bench.emit({"a": 1}, json_mode=False, out=None, text=lambda r: "", write=printed.append)
    assert printed == ["a = 1"]


def test_a_command_prints_one_json_line_and_writes_the_same_report_to_out(tmp_path):
    out, printed = tmp_path / "bench.json", io.StringIO()
    call_command("bench_scheduler", gpus="2", events=20, json=True, out=str(out), stdout=printed)
    (line,) = printed.getvalue().splitlines()
    report = json.loads(line)
    assert report == json.loads(out.read_text())
    assert [row["gpus"] for row in report["sizes"]] == [2] and report["machine"]["cores_logical"] >= 1


def test_redis_url_with_db_keeps_server_and_credentials():
    assert redis_url_with_db("redis://:pw@10.0.0.1:6380/0", 14) == "redis://:pw@10.0.0.1:6380/14"
    assert redis_url_with_db("redis://127.0.0.1:6379", 15) == "redis://127.0.0.1:6379/15"


def test_jpeg_frames_are_real_jpegs_of_the_tiny_size():
    frames = jpeg_frames(64, 64, 4, seed=1)
    assert len(frames) == 4
    for frame in frames:
        image = Image.open(BytesIO(frame))
        assert image.format == "JPEG" and image.size == (64, 64)
        assert 1500 < len(frame) < 5000  # the tiny model's frames are ~2.7 KB


def test_activation_components_from_timestamps():
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
