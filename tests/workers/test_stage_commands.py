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
    report = run("stage_memory", "--preset", "wan-1.3b", "--encoder", "umt5-xxl", "--gpu-memory-gb", "80")
    weights = stage_weight_bytes("wan-1.3b")
    state = DIT_PRESETS["wan-1.3b"].state_bytes()
    encoder = ENCODERS["umt5-xxl"].weight_bytes()
    free = 80 * 10**9 - weights["D"] - weights["C"]
    assert report["encoder_bytes_freed_per_diffusion_worker"] == encoder
    assert report["sessions_per_gpu"]["monolithic"] == (free - encoder) // state
    assert report["sessions_per_gpu"]["shared_pool"] == free // state
    share = report["sessions_per_gpu"]["shared_pool_with_encoder_share"]
    assert share == (8 * (free // state) - -(-encoder // state)) / 8
    assert report["gain"]["shared_pool"] == round((free // state) / ((free - encoder) // state) - 1, 4)


def test_stage_memory_sizes_the_encoder_load_when_asked():
    report = run("stage_memory", "--switch-interval-s", "10", "--encode-ms", "20", "--gpus-per-encoder", "2")
    pooled = report["sessions_per_gpu"]["shared_pool"]
    assert report["encoder_load"]["encodes_per_s_per_replica"] == round(2 * pooled / 10, 3)
    assert report["encoder_load"]["replica_utilisation"] == round(2 * pooled / 10 * 0.02, 4)


@pytest.mark.parametrize(
    ("args", "flag"),
    [
        (["--encoder", "t5-base"], "--encoder"),
        (["--gpu-memory-gb", "0"], "--gpu-memory-gb"),
        (["--reserved-gb", "90"], "--reserved-gb"),
        (["--gpus-per-encoder", "0"], "--gpus-per-encoder"),
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
