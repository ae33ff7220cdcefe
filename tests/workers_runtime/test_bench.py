"""workers.benchmarks.runtime: bench and profile functions give well-formed figures (no timing asserted)."""

from __future__ import annotations

import pytest

from scheduling.core.gpu_profiles import profile_from_json
from workers.benchmarks import runtime
from workers.runtime.models.causal_dit import PRESETS


def test_profile_loads_in_the_scheduler_and_is_monotone():
    profile, raw = runtime.profile_model("tiny", max_batch=3, steps=1)
    spec = profile_from_json(profile)
    assert spec.state_bytes == PRESETS["tiny"].state_bytes()
    assert [load for load, _ in profile["latency_ms"]] == [1, 2, 3]
    latencies = [ms for _, ms in profile["latency_ms"]]
    assert latencies == sorted(latencies)
    assert all(
        a <= b for (_, a), (_, b) in zip(raw["latency_ms_measured"], profile["latency_ms"], strict=True)
    )
    assert profile["memory_limit_sessions"] >= 1 and profile["host_link_gbps"] > 0
    # The measured phases travel with the profile: its own scale-out is boot + the disk load it measured.
    phases = dict(spec.scale_out.measured_phases_s)
    assert spec.scale_out.path == "disk" and set(phases) == {"process_up", "weights_disk"}
    assert spec.scale_out.boot_s == pytest.approx(phases["process_up"])
    assert spec.scale_out.weights_bytes > 0
    disk = spec.scale_out.nominal_delay_s("disk")
    assert disk == pytest.approx(phases["process_up"] + phases["weights_disk"], rel=0.01, abs=0.02)


def test_profile_needs_two_points():
    with pytest.raises(ValueError, match="max-batch"):
        runtime.profile_model("tiny", max_batch=1)


def test_run_bench_reports_every_section(tiny_model, monkeypatch):
    monkeypatch.setattr(runtime, "build_model", lambda preset, device="cpu": tiny_model)
    report = runtime.run_bench(
        "tiny", batches=(1, 2), steps=1, offload_repeats=1, offload_presets=("tiny",), migration=False
    )
    assert [row["batch"] for row in report["coalescing"]] == [1, 2]
    for row in report["coalescing"]:
        assert row["engine_step_ms"] > 0 and row["bare_forward_ms"] > 0 and row["chunks_per_s_batched"] > 0
    assert report["offload"]["tiny"]["state_bytes"] == PRESETS["tiny"].state_bytes()
    assert set(report["state_sizes"]) == set(PRESETS)
    projection = report["wan_1_3b_projection"]
    assert projection["state_bytes"] == PRESETS["wan-1.3b"].state_bytes()
    assert projection["migration_ms_nvlink"] == pytest.approx(
        projection["state_bytes"] / (runtime.NVLINK_GBPS * 1e9) * 1000, abs=0.1
    )
    assert "coalescing" in runtime.format_bench(report)
