"""The streams' shared encoder pool (memory model) and the reproduction command."""

from __future__ import annotations

import json
from dataclasses import replace
from io import StringIO

from django.core.management import call_command

from scheduling.core.stages.stage_profiles import GB, H100, L20, WAN_13B_STREAM, Shape
from scheduling.sim.stages.encoder_pool import encoder_pool_gain, sessions_per_gpu, stream_model
from workers.runtime.stages.memory import ENCODERS, stream_figures

MODEL = stream_model(**stream_figures("wan-1.3b", encoder="umt5-xxl"))


def test_the_pool_frees_the_encoder_and_fits_more_sessions():
    result = encoder_pool_gain(MODEL, L20)
    assert result.freed_gb == ENCODERS["umt5-xxl"].weight_bytes() / GB
    # The encode time is the profile's at the encoder's own parameter count.
    assert MODEL.profile.encoder_params == ENCODERS["umt5-xxl"].parameter_count()
    assert result.encode_s == MODEL.encode_s(L20) < WAN_13B_STREAM.encode_s(Shape(832, 480, 1, 1), L20)
    free = (
        L20.memory_bytes
        - L20.reserve_bytes
        - MODEL.worker_weight_bytes
        - MODEL.encoder_weight_bytes
        - 4 * MODEL.chunk_workspace_bytes
    )
    assert result.sessions_monolithic == int(free // MODEL.state_bytes)
    assert result.sessions_with_pool == int((free + MODEL.encoder_weight_bytes) // MODEL.state_bytes)
    assert (
        result.gain == (result.sessions_with_pool - result.sessions_monolithic) / result.sessions_monolithic
    )
    # The pool's own GPUs are charged: the amortised gain is below the raw one.
    assert result.amortised_gain < result.gain


def test_the_gain_shrinks_as_memory_grows():
    gains = [encoder_pool_gain(MODEL, replace(H100, memory_bytes=m * GB)).gain for m in (48, 80, 141)]
    assert gains[0] > gains[1] > gains[2] > 0


def test_sessions_never_go_negative_when_the_weights_do_not_fit():
    assert sessions_per_gpu(10 * GB, 2 * GB, 20 * GB, MODEL, active=4) == 0


def test_reproduce_stages_writes_markdown_and_json(tmp_path):
    call_command(
        "reproduce_stages",
        out=str(tmp_path),
        gpus=16,
        duration_s=240.0,
        seeds=[0],
        image_gpus=16,
        image_duration_s=60.0,
    )
    report = json.loads((tmp_path / "stages.json").read_text())
    workloads = {"steady-light", "steady-medium", "steady-heavy", "dynamic"}
    assert {r["workload"] for r in report["runs"]} == workloads | {f"sd3-image/{w}" for w in workloads}
    assert len(report["runs"]) == 18 + 12
    assert [row["gpu"] for row in report["encoder_pool"]] == ["L20", "H100", "H200"]
    # One memory model: `stage_memory` prints the same rows for the same GPU profiles.
    for row in report["encoder_pool"]:
        out = StringIO()
        call_command("stage_memory", "--gpu", row["gpu"], "--json", stdout=out)
        assert json.loads(out.getvalue())["rows"] == [row]
    text = (tmp_path / "stages.md").read_text()
    assert "2.1–6.6×" in text and "wo-scheduler" in text and "bench_stages_dispatch --gpus 128" in text
    assert "## Targets (issue 15)" in text and "zero out-of-memory events" in text
