"""The stage-level simulator over mixed traces (scheduling.sim.traces): policies' invariants (no OOM by construction, lazy stage
loads on re-placement), the baselines' documented behaviour, and the commands' flags."""

from __future__ import annotations

import io
import json
from dataclasses import replace

import pytest
from django.core.management import call_command
from django.core.management.base import CommandError

from scheduling.core.stages.stage_profiles import GB, L20, WAN_T2V, Shape
from scheduling.sim.stages.cli import RESULT_KEYS
from scheduling.sim.stages.simulator import Cluster, StageSimConfig, simulate_stages, static_degree
from scheduling.sim.traces import JobEvent, TraceEvent, read_mixed_trace, write_mixed_trace

CONFIG = StageSimConfig(gpus=16, gpu=L20, window_s=30.0)


def _job(t: float, name: str, size: tuple[int, int, int]) -> JobEvent:
    shape = Shape(*size, 6)
    return JobEvent(t, name, "submit", "video", "wan-t2v", *size, 6, 2.5 * WAN_T2V.best_latency_s(shape, L20))


def _burst(start: float, size: tuple[int, int, int], count: int, gap: float, prefix: str) -> list[JobEvent]:
    return [_job(start + i * gap, f"{prefix}{i}", size) for i in range(count)]


def test_tridentserve_never_runs_out_of_memory_where_the_static_baseline_does():
    # 720p videos of 81 and 121 frames: at the static degree 4 next to the encoder they do not fit.
    jobs = _burst(0.0, (1280, 720, 81), 6, 5.0, "a") + _burst(2.0, (1280, 720, 121), 4, 7.0, "b")
    jobs.sort(key=lambda j: j.t)
    static = simulate_stages(jobs, [], "pipeline-static", CONFIG)
    trident = simulate_stages(jobs, [], "tridentserve", CONFIG)
    assert static_degree(WAN_T2V, [Shape(1280, 720, 121, 6)], L20) == 4
    assert static["oom_events"] > 0 and static["failed"] == static["oom_events"]
    assert trident["oom_events"] == 0 and trident["finished"] == trident["jobs"] == 10
    assert set(RESULT_KEYS) <= set(trident) and trident["virtual_replicas"]["V2"] >= 4  # 121 frames: DC + E


def test_a_type_the_plan_lacks_triggers_a_re_placement_without_oom():
    # Light videos, then 121-frame ones that V0 cannot hold: no replica serves them until the
    # trigger re-places (GPUs turned DC drop the encoder as they next work); without switching
    # they are never served.
    jobs = _burst(0.0, (832, 480, 33), 40, 1.5, "l") + _burst(60.0, (1280, 720, 121), 3, 2.0, "h")
    result = simulate_stages(jobs, [], "tridentserve", CONFIG)
    assert result["replacements"] == 1 and "DC" in result["final_roles"]
    assert result["oom_events"] == 0 and result["finished"] == 43
    frozen = simulate_stages(jobs, [], "tridentserve", CONFIG, options={"switching": False})
    assert frozen["replacements"] == 0 and frozen["finished"] == 40


def test_a_lazy_stage_load_costs_one_weight_transfer():
    cluster = Cluster(WAN_T2V, CONFIG, ["DC"] * 8 + ["E"] * 8)
    end, oom = cluster.run(cluster.gpus[:1], "D", 0.0, 10.0, 1 * GB)
    assert (end, oom) == (10.0, False) and cluster.stage_loads == 0
    # Re-placed E -> C on machine 1: no peer there holds the decoder, so it comes from the host cache,
    # and the encoder is dropped first; the next GPU of machine 1 then gets it from that peer.
    cluster.gpus[8].role = cluster.gpus[9].role = "C"
    end, oom = cluster.run(cluster.gpus[8:9], "C", 0.0, 1.0, 1 * GB)
    assert end == pytest.approx(1.0 + WAN_T2V.weight_bytes("C") / L20.host_load_bytes_per_s)
    assert cluster.gpus[8].resident == {"C"} and cluster.stage_loads == 1 and not oom
    end, _ = cluster.run(cluster.gpus[9:10], "C", 0.0, 1.0, 1 * GB)
    assert end == pytest.approx(1.0 + WAN_T2V.weight_bytes("C") / L20.link_bytes_per_s)


def test_stream_sessions_encode_on_the_shared_pool():
    jobs = _burst(0.0, (832, 480, 33), 5, 3.0, "j")
    sessions = [TraceEvent(float(t), f"s{t}", "arrive", model="wan-1.3b") for t in range(0, 20, 2)]
    result = simulate_stages(jobs, sessions, "tridentserve", CONFIG)
    assert result["streams"] == 10 and 0 < result["stream_encode_p95_s"] < 5
    assert result["jobs"] == 5


def _json(command: str, **kwargs) -> dict:
    out = io.StringIO()
    call_command(command, json=True, stdout=out, **kwargs)
    return json.loads(out.getvalue())


@pytest.mark.parametrize("policy", ["tridentserve", "pipeline-static", "stage-srtf"])
def test_simulate_stages_command_prints_the_documented_keys(tmp_path, policy):
    trace = tmp_path / "jobs.jsonl"
    write_mixed_trace(trace, [], _burst(0.0, (832, 480, 81), 6, 4.0, "j"))
    result = _json("simulate_stages", trace=str(trace), policy=policy, gpus=16)
    assert set(RESULT_KEYS) <= set(result) and result["policy"] == policy
    assert 0 <= result["slo_attainment"] <= 1 and result["mean_latency_s"] > 0 and result["gpu_cost_usd"] > 0


def test_simulate_stages_generates_a_workload_and_an_ablation(tmp_path):
    written = tmp_path / "dyn.jsonl"
    result = _json(
        "simulate_stages",
        workload="dynamic",
        gpus=16,
        duration_s=300.0,
        ablation="wo-scheduler",
        write_trace=str(written),
    )
    assert result["policy"] == "tridentserve/wo-scheduler" and result["jobs"] == len(
        read_mixed_trace(written)[2]
    )


@pytest.mark.parametrize(
    ("kwargs", "flag"),
    [
        ({"workload": "dynamic", "policy": "fifo"}, "--policy"),
        ({"workload": "dynamic", "gpus": 0}, "--gpus"),
        ({"workload": "bursty"}, "--workload"),
        ({}, "--trace"),
        ({"trace": "/nonexistent/trace.jsonl"}, "--trace"),
        ({"workload": "dynamic", "ablation": "wo-switch", "policy": "stage-srtf"}, "--ablation"),
        ({"workload": "dynamic", "gpu": "a100"}, "--gpu"),
        ({"workload": "dynamic", "threshold": 1.0}, "--threshold"),
    ],
)
def test_simulate_stages_flag_errors_name_the_flag(kwargs, flag):
    with pytest.raises(CommandError, match=flag):
        call_command("simulate_stages", **kwargs)


def test_a_trace_mixing_pipelines_is_refused_naming_the_trace(tmp_path):
    trace = tmp_path / "mixed.jsonl"
    image = JobEvent(1.0, "i1", "submit", "image", None, 1024, 1024, None, 20, 10.0)
    write_mixed_trace(trace, [], [*_burst(0.0, (832, 480, 33), 1, 1.0, "v"), image])
    with pytest.raises(
        CommandError, match=r"--trace: job 'i1' needs pipeline 'sd3-image'; this run serves 'wan-t2v'"
    ):
        call_command("simulate_stages", trace=str(trace), gpus=16)


def test_bench_stages_dispatch_reports_percentiles_and_rejects_bad_flags():
    result = _json("bench_stages_dispatch", gpus=16, repeats=3)
    assert result["gpus"] == 16 and result["pending"] == 16
    assert 0 < result["dispatch_ms_p50"] <= result["dispatch_ms_p99"]
    with pytest.raises(CommandError, match="--idle-fraction"):
        call_command("bench_stages_dispatch", idle_fraction=0.0)


def test_tight_memory_has_no_whole_pipeline_replica():
    tight = replace(L20, memory_bytes=40 * GB)
    jobs = _burst(0.0, (832, 480, 33), 6, 2.0, "j")
    result = simulate_stages(jobs, [], "tridentserve", replace(CONFIG, gpu=tight))
    assert result["oom_events"] == 0 and "EDC" not in result["final_roles"]


def test_an_out_of_memory_crashes_the_group_for_the_stated_restart_then_reloads_its_weights():
    # given one EDC GPU and a decode activation larger than its memory
    config = replace(CONFIG, oom_restart_s=7.0)
    cluster = Cluster(WAN_T2V, config, ["EDC"] * 16)
    # when it runs, then it crashes at its first step: busy for the restart, not the stage's 10 s
    end, oom = cluster.run(cluster.gpus[:1], "D", 0.0, 10.0, 10_000 * GB)
    assert oom and end == pytest.approx(7.0) and cluster.gpus[0].free_at == pytest.approx(7.0)
    # and its weights are gone: its next run waits for the restart, then reloads (from a peer)
    assert cluster.gpus[0].resident == set()
    end, oom = cluster.run(cluster.gpus[:1], "D", 0.0, 10.0, 1 * GB)
    assert not oom and end == pytest.approx(7.0 + WAN_T2V.weight_bytes("D") / L20.link_bytes_per_s + 10.0)
    with pytest.raises(ValueError, match="oom_restart_s"):
        StageSimConfig(gpus=1, gpu=L20, oom_restart_s=-1.0)


def test_the_static_baseline_pays_for_its_out_of_memory_runs():
    # given four 121-frame 720p videos the static degree-4 groups cannot hold, among 20 light ones
    jobs = _burst(0.0, (1280, 720, 121), 4, 0.5, "b") + _burst(0.2, (832, 480, 33), 20, 0.3, "l")
    jobs.sort(key=lambda j: j.t)
    config = replace(CONFIG, gpus=8)
    free = simulate_stages(jobs, [], "pipeline-static", replace(config, oom_restart_s=0.0))
    paid = simulate_stages(jobs, [], "pipeline-static", replace(config, oom_restart_s=30.0))
    assert paid["oom_events"] == free["oom_events"] == 4 and paid["finished"] == 20
    # then the crashed groups are out for the restart and reload their weights: the light jobs wait
    assert paid["mean_latency_s"] > free["mean_latency_s"]
