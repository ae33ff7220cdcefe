"""bench_layersplit: report shape, and the split chunk equals the whole chunk (real processes, Gloo)."""

from __future__ import annotations

import json
from io import StringIO

import pytest
from django.core.management import CommandError, call_command

from workers.benchmarks.layersplit import block_bytes, load_timeline, projection_wan


def test_layersplit_command_reports_equal_split_chunks():
    out = StringIO()
    call_command(
        "bench_layersplit", "--preset", "tiny", "--k", "1", "--m", "2", "--splits", "1,3",
        "--repeats", "1", "--warmup", "0", "--warm-chunks", "1", "--json", stdout=out,
    )  # fmt: skip
    report = json.loads(out.getvalue())
    assert report["bench"] == "layersplit" and report["b"] == 3
    assert set(report["split"]) == {"1", "3"}
    cfg = report["config"]
    tokens = cfg["latent_height"] * cfg["latent_width"] // cfg["patch"] ** 2 * cfg["frames_per_chunk"]
    assert report["activation_bytes_per_handoff"] == 2 * tokens * cfg["dim"] * 4
    kv_per_block = 2 * cfg["window_frames"] * tokens // cfg["frames_per_chunk"] * cfg["dim"] * 4
    for key, row in report["split"].items():
        # The split must compute the same chunk: frames, latents and the old worker's KV blocks.
        assert row["equal_to_whole"] is True, key
        assert row["max_abs_diff"] == 0.0
        assert row["kv_move_bytes"] == 2 * int(key) * kv_per_block
        assert row["moved_chunk_s"]["count"] == 1 and row["moved_chunk_s"]["p50"] > 0
        # One hand-off was timed; a loopback hand-off of the tiny preset can round to 0.000 s.
        assert row["handoff_s_per_chunk"]["count"] == 1 and row["handoff_s_per_chunk"]["p50"] >= 0
    for label in ("B", "K", "M"):
        assert report["whole_chunk_s"][label]["p50"] > 0
    weights = report["weights"]
    assert len(weights["block_bytes"]) == cfg["blocks"]
    assert report["timeline"]["load_window_s"] == pytest.approx(weights["total_bytes"] / (1000e6 / 8))
    assert report["projection_wan_1_3b"]["label"].startswith("projection")
    assert "machine" in report


def test_bad_split_is_refused_naming_the_flag():
    with pytest.raises(CommandError, match="--splits"):
        call_command("bench_layersplit", "--preset", "tiny", "--splits", "4", "--json", stdout=StringIO())


def test_load_timeline_counts_steps_and_savings():
    # 1 s prefix + 4 blocks of 1 s each at 1 B/s: window 5 s; chunks at B take 1 s.
    flat = load_timeline(
        prefix_bytes=1, blocks=[1, 1, 1, 1], bytes_per_s=1.0, whole_b=1.0, split_latency=lambda have: None
    )
    assert flat["load_window_s"] == 5.0 and flat["chunk_steps_in_window_split"] == 5
    assert flat["latency_saved_s"] == 0.0
    faster = load_timeline(
        prefix_bytes=1, blocks=[1, 1, 1, 1], bytes_per_s=1.0, whole_b=1.0, split_latency=lambda have: 0.5
    )
    assert faster["latency_saved_s"] > 0 and faster["chunk_steps_in_window_split"] > 5
    slower = load_timeline(
        prefix_bytes=1, blocks=[1, 1, 1, 1], bytes_per_s=1.0, whole_b=1.0, split_latency=lambda have: 3.0
    )
    assert slower["latency_saved_s"] == 0.0  # a slower split is never chosen


def test_wan_projection_sizes():
    prefix, blocks, suffix = block_bytes("wan-1.3b")
    assert len(blocks) == 30 and len(set(blocks)) == 1
    proj = projection_wan()
    # 3 latent frames × 1,560 tokens × 1536 × bf16 per moved session and block boundary.
    assert proj["activation_bytes_per_handoff"] == proj["m"] * 3 * 1560 * 1536 * 2
    assert proj["kv_bytes_per_block_per_session"] == 2 * 12 * 1560 * 1536 * 2
    assert proj["dit_weights_bytes"] == prefix + sum(blocks) + suffix
    assert prefix > 0 and suffix > 0  # text encoder/embeddings before, head/decoder after
