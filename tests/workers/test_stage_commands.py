"""`manage.py stage_memory` (the shared encoder pool's memory model) and `bench_stage_handoff`."""

from __future__ import annotations

import json
from io import StringIO

import pytest
import torch
from django.core.management import CommandError, call_command

from workers.runtime.models.causal_dit import PRESETS as DIT_PRESETS
from workers.runtime.stages.contract import stage_weight_bytes
from workers.runtime.stages.memory import ENCODERS, T5EncoderShape


def run(command: str, *args: str) -> dict:
    out = StringIO()
    call_command(command, *args, "--json", stdout=out)
    return json.loads(out.getvalue())


def test_the_encoder_parameter_count_is_the_one_transformers_builds():
    # Given a small UMT5 configuration, built by transformers on the meta device (no memory),
    from transformers import UMT5Config, UMT5EncoderModel

    shape = T5EncoderShape(
        d_model=64,
        d_ff=160,
        layers=3,
        heads=4,
        d_kv=16,
        vocab=1000,
        relative_buckets=32,
        bytes_per_parameter=2,
    )
    config = UMT5Config(
        d_model=64, d_ff=160, num_layers=3, num_heads=4, d_kv=16, vocab_size=1000,
        relative_attention_num_buckets=32, feed_forward_proj="gated-gelu",
    )  # fmt: skip
    with torch.device("meta"):
        built = UMT5EncoderModel(config)
    # then the analytic count is the built model's; UMT5-XXL's is the 5.68 B of Wan2.1's 11.4 GB file.
    assert shape.parameter_count() == sum(p.numel() for p in built.parameters())
    assert ENCODERS["umt5-xxl"].parameter_count() == 5_680_910_336


def test_stage_memory_counts_sessions_with_and_without_the_encoder():
    # Given the preset's exact figures (state region, diffuse + decode weights, UMT5-XXL),
    report = run(
        "stage_memory", "--preset", "wan-1.3b", "--encoder", "umt5-xxl", "--gpu-memory-gb", "80", "40"
    )
    weights = stage_weight_bytes("wan-1.3b")
    cfg = DIT_PRESETS["wan-1.3b"]
    state, encoder = cfg.state_bytes(), ENCODERS["umt5-xxl"].weight_bytes()
    workspace = cfg.tokens_per_frame * cfg.frames_per_chunk * cfg.dim * 2 * 24  # bf16, 24 live tensors
    assert report["figures"]["worker_weight_bytes"] == weights["D"] + weights["C"]
    assert report["figures"]["encoder_weight_bytes"] == encoder
    # then each row fits state regions into what the weights, the reserve and 4 chunks leave.
    for row, memory in zip(report["rows"], (80, 40), strict=True):
        free = memory * 10**9 - 2 * 10**9 - weights["D"] - weights["C"] - 4 * workspace
        assert row["sessions_monolithic"] == (free - encoder) // state
        assert row["sessions_with_pool"] == free // state
        mono, pooled = (free - encoder) // state, free // state
        assert row["gain"] == (pooled - mono) / mono
        assert row["encoder_share"] == encoder / free
    assert report["rows"][0]["gain"] < 0.3 < report["rows"][1]["gain"]


def test_stage_memory_charges_the_pool_by_its_encode_load():
    report = run("stage_memory", "--switch-interval-s", "10", "--encode-ms", "20", "--active", "0")
    (row,) = report["rows"]
    assert (row["gpu"], row["memory_gb"], row["active"]) == ("H100", 80.0, 0)
    pool_share = row["sessions_with_pool"] / 10 * 0.02
    assert row["pool_gpus_per_100"] == 100 * pool_share
    assert row["amortised_gain"] == pytest.approx(
        (row["sessions_with_pool"] / (1 + pool_share)) / row["sessions_monolithic"] - 1
    )


@pytest.mark.parametrize(
    ("args", "flag"),
    [
        (["--encoder", "t5-base"], "--encoder"),
        (["--gpu", "a100"], "--gpu"),
        (["--gpu-memory-gb", "0"], "--gpu-memory-gb"),
        (["--reserved-gb", "90"], "--reserved-gb"),
        (["--active", "-1"], "--active"),
        (["--switch-interval-s", "0"], "--switch-interval-s"),
        (["--preset", "nope"], "--preset"),
        (["--preset", "demo"], "--preset"),
    ],
)
def test_stage_memory_names_the_bad_flag(args, flag):
    with pytest.raises(CommandError, match=flag):
        call_command("stage_memory", *args, stdout=StringIO())


def test_bench_stage_handoff_measures_each_payload_between_two_processes():
    report = run(
        "bench_stage_handoff", "--presets", "tiny", "--repeats", "2", "--warmup", "0", "--stream", "3",
        "--stage-times", "tiny",
    )  # fmt: skip
    assert report["backend"] == "gloo" and report["device"] == "cpu"
    rows = {row["payload"]: row for row in report["results"]}
    assert rows["embeddings"]["bytes"] == 32 * 128 * 4 and rows["latents"]["bytes"] == 2 * 4 * 8 * 8 * 4
    for row in rows.values():
        assert row["latency_ms"]["count"] == 2 and row["latency_ms"]["p50"] > 0
        assert row["throughput"]["messages"] == 3 and row["throughput"]["gb_per_s"] > 0
    assert set(report["stage_ms"]) == {"tiny"}
    assert all(report["stage_ms"]["tiny"][stage]["count"] == 2 for stage in ("encode", "diffuse", "decode"))
    assert "machine" in report


def test_bench_stage_handoff_rejects_an_unknown_preset():
    with pytest.raises(CommandError, match="--presets"):
        call_command("bench_stage_handoff", "--presets", "nope", stdout=StringIO())
