"""The pure parts the live stage planner adds: role changes for a live pool, the trigger's persisted
state, and a small pool's plan with streams' encodes (no database)."""

from __future__ import annotations

from collections import Counter

import pytest

from scheduling.benchmarks.stages import run_bench_replan
from scheduling.core.stages.placement import PlacementError, ReplacementTrigger, plan_placement, role_changes
from scheduling.core.stages.stage_profiles import H100, WAN_13B_STREAM, Shape
from scheduling.sim.stages.cli import StagesCliError


def test_role_changes_keep_what_fits_and_give_the_encoder_to_an_idle_worker():
    # given three EDC workers, w1 and w3 busy with sessions, and a plan of one E and two EDC
    current = {"w1": "EDC", "w2": "EDC", "w3": "EDC"}
    # when the changes are computed
    changes = role_changes(current, ("EDC", "E", "EDC"), busy={"w1", "w3"})
    # then only the idle worker changes, to E
    assert changes == [("w2", "EDC", "E")]


def test_role_changes_reach_the_planned_counts_with_fewest_changes_encoders_first():
    current = {"a": "EDC", "b": "EDC", "c": "EDC", "d": "DC"}
    changes = role_changes(current, ("DC", "DC", "E", "EDC"), busy={"a", "b"})
    after = {**current, **{w: new for w, _, new in changes}}
    assert Counter(after.values()) == Counter({"DC": 2, "E": 1, "EDC": 1})
    assert len(changes) == 2  # d keeps DC, a (busy, first by name) keeps EDC
    assert after["a"] == "EDC" and after["d"] == "DC"
    # the idle c takes E, the busy b drops its encoder only after that
    assert changes == [("c", "EDC", "E"), ("b", "EDC", "DC")]


def test_role_changes_refuse_a_plan_of_another_size():
    with pytest.raises(PlacementError):
        role_changes({"a": "EDC"}, ("EDC", "E"))


def test_trigger_state_survives_a_round_trip_and_keeps_the_cooldown():
    trigger = ReplacementTrigger(60.0, 1.5, min_ops=1)
    assert trigger.should_replace(100.0, backlog=1, unserved=True)
    restored = ReplacementTrigger(60.0, 1.5, min_ops=1)
    restored.load_state_dict(trigger.state_dict())
    assert restored.state_dict() == {"last_fire": 100.0}
    assert not restored.should_replace(130.0, backlog=1, unserved=True)  # within one window
    assert restored.should_replace(161.0, backlog=1, unserved=True)
    assert ReplacementTrigger(60.0).state_dict() == {"last_fire": None}


def test_a_two_gpu_pool_with_only_encodes_keeps_one_gpu_for_the_diffusion_model():
    # Before the bound, the encoder pool took both GPUs and the plan failed on zero GPUs left.
    plan = plan_placement(WAN_13B_STREAM, [Shape(64, 64, 1, 4)], 2, H100, encode_only_s=100.0)
    assert sorted(plan.roles) == ["E", "EDC"]


def test_the_replan_bench_reports_the_live_roles_and_names_a_bad_flag():
    result = run_bench_replan(workers=8, chunks=64, jobs=4, encodes=10, repeats=1)
    assert sum(result["live_roles"].values()) == 8 and set(result["live_roles"]) <= {"EDC", "DC", "E"}
    assert result["plan_ms_p50"] > 0
    with pytest.raises(StagesCliError, match="--workers"):
        run_bench_replan(workers=0)


def test_stream_requests_only_get_roles_holding_d_and_c_while_jobs_of_the_same_size_unfold():
    # given 12-frame chunks at 832×480, whose best decode degree (2) exceeds their diffuse degree (1):
    # as one-shot jobs Alg. 2 prefers ED + C (V1) for them
    chunk = Shape(832, 480, 12, WAN_13B_STREAM.default_steps)
    as_jobs = Counter(plan_placement(WAN_13B_STREAM, [chunk] * 40, 8, H100, encode_only_s=1.0).roles)
    assert as_jobs["ED"] > 0 and as_jobs["C"] > 0
    # when the same work comes from streams, it only gets GPUs with D and C together
    streams = plan_placement(WAN_13B_STREAM, [], 8, H100, encode_only_s=1.0, stream_shapes=[chunk] * 40)
    assert set(streams.roles) <= {"EDC", "DC", "E"} and "EDC" in streams.roles
    # and with both, the jobs keep their ED + C share beside the streams' EDC workers
    mixed = Counter(
        plan_placement(
            WAN_13B_STREAM, [chunk] * 40, 8, H100, encode_only_s=1.0, stream_shapes=[chunk] * 40
        ).roles
    )
    assert mixed["EDC"] > 0 and mixed["ED"] > 0 and mixed["C"] > 0 and sum(mixed.values()) == 8


def test_a_stream_request_that_cannot_hold_d_and_c_on_one_gpu_is_refused():
    huge = Shape(8192, 8192, 121, WAN_13B_STREAM.default_steps)
    with pytest.raises(PlacementError, match="D and C together"):
        plan_placement(WAN_13B_STREAM, [], 8, H100, stream_shapes=[huge])
