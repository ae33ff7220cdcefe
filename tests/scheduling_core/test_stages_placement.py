"""Stage profiles and TridentServe placement: degrees, memory feasibility by construction, Alg. 2, trigger."""

from __future__ import annotations

from dataclasses import replace

import pytest

from scheduling.core.stages.placement import (
    AUX_STAGES,
    PRIMARY_ROLE,
    VR_TYPES,
    PlacementError,
    ReplacementTrigger,
    pack_per_machine,
    plan_placement,
    preferred_type,
    request_options,
    role_weight_bytes,
    split_type,
)
from scheduling.core.stages.stage_profiles import EFFICIENCY_THRESHOLD, GB, L20, SD3_IMAGE, WAN_T2V, Shape
from scheduling.sim.stages.workloads import MIXES

# A 40 GB card: the Wan-like pipeline no longer fits whole on one GPU, so placements must split stages.
TIGHT = replace(L20, name="tight", memory_bytes=40 * GB)


def _shapes(pipeline, level="medium"):
    return [Shape(*size, pipeline.default_steps) for size in MIXES[pipeline.name][level]]


@pytest.mark.parametrize("pipeline", [WAN_T2V, SD3_IMAGE])
def test_best_degree_is_the_highest_efficient_one_and_grows_with_the_request(pipeline):
    shapes = sorted(_shapes(pipeline, "heavy"), key=pipeline.tokens)
    best = [pipeline.best_degree("D", s, L20) for s in shapes]
    for shape, k in zip(shapes, best, strict=True):
        assert pipeline.efficiency("D", shape, k, L20) >= EFFICIENCY_THRESHOLD
        if k < 8:
            assert pipeline.efficiency("D", shape, 2 * k, L20) < EFFICIENCY_THRESHOLD
    assert best == sorted(best)
    # Decode is memory-bound and scales worse than diffuse at the same degree (§3, Fig. 3).
    assert all(pipeline.efficiency("C", s, 4, L20) < pipeline.efficiency("D", s, 4, L20) for s in shapes)
    assert pipeline.best_degree("E", shapes[-1], L20) == 1


@pytest.mark.parametrize("gpu", [L20, TIGHT])
def test_every_offered_option_fits_in_memory(gpu):
    for shape in _shapes(WAN_T2V, "heavy") + _shapes(WAN_T2V, "light"):
        for vr in VR_TYPES:
            for option in request_options(WAN_T2V, shape, gpu, vr):
                role = PRIMARY_ROLE[vr]
                base = role_weight_bytes(WAN_T2V, role) + gpu.reserve_bytes
                assert base + WAN_T2V.activation_bytes("D", shape, option.degree) <= gpu.memory_bytes
                decode_role = "C" if "C" in AUX_STAGES[vr] else role
                decode = role_weight_bytes(WAN_T2V, decode_role) + gpu.reserve_bytes
                assert decode + WAN_T2V.activation_bytes("C", shape, option.decode_degree) <= gpu.memory_bytes
                assert option.decode_degree <= (8 if "C" in AUX_STAGES[vr] else option.degree)


def test_preferred_type_is_the_least_communicating_feasible_one():
    small = Shape(832, 480, 33, 6)
    assert preferred_type(WAN_T2V, small, L20) == "V0"
    # On 40 GB the encoder and the DiT no longer share a GPU: V0 and V1 are out, V2 (DC + E) is first.
    assert not request_options(WAN_T2V, small, TIGHT, "V0") and not request_options(
        WAN_T2V, small, TIGHT, "V1"
    )
    assert preferred_type(WAN_T2V, small, TIGHT) == "V2"
    with pytest.raises(PlacementError):
        preferred_type(WAN_T2V, small, replace(L20, memory_bytes=20 * GB))


@pytest.mark.parametrize(("gpu", "gpus"), [(L20, 128), (TIGHT, 128), (TIGHT, 20)])
def test_plan_placement_uses_every_gpu_and_serves_every_request(gpu, gpus):
    shapes = _shapes(WAN_T2V, "heavy") * 3 + _shapes(WAN_T2V, "light")
    plan = plan_placement(WAN_T2V, shapes, gpus, gpu)
    assert len(plan.roles) == gpus
    for shape in shapes:
        assert preferred_type(WAN_T2V, shape, gpu) in plan.types()
    for g, role in enumerate(plan.roles):  # every GPU can hold its role's weights
        assert role_weight_bytes(WAN_T2V, role) + gpu.reserve_bytes <= gpu.memory_bytes, (g, role)


@pytest.mark.parametrize("gpus", [24, 60, 128])
def test_disaggregated_placement_aligns_primaries_and_packs_whole_machines(gpus):
    plan = plan_placement(WAN_T2V, _shapes(WAN_T2V, "heavy"), gpus, TIGHT)
    assert plan.count("E") >= 1 and plan.count("DC") >= 8
    # Primaries round up to whole machines unless that would take the last auxiliary away.
    assert plan.count("DC") % 8 == 0 or plan.count("E") == 1
    machines = [plan.roles[m * 8 : (m + 1) * 8] for m in range(gpus // 8)]
    assert sum(1 for roles in machines if len(set(roles)) > 1) <= 1


def test_split_is_inverse_to_service_rates_and_keeps_one_of_each_role():
    # The auxiliary does a quarter of the primary's work: it gets a fifth of the GPUs.
    assert split_type("V1", 20, primary_work=4.0, aux_work={"E": 0.0, "C": 1.0}) == {"ED": 16, "C": 4}
    counts = split_type("V3", 10, primary_work=100.0, aux_work={"E": 0.1, "C": 0.1})
    assert counts == {"D": 8, "E": 1, "C": 1}
    assert split_type("V3", 2, primary_work=1.0, aux_work={"E": 1.0, "C": 1.0}) == {"D": 2}


def test_pack_per_machine_fills_homogeneous_machines_first():
    from collections import Counter

    roles = pack_per_machine(Counter({"DC": 16, "E": 3, "C": 5}), 8)
    assert roles[:16] == ("DC",) * 16
    assert sorted(roles[16:]) == ["C"] * 5 + ["E"] * 3


def test_trigger_fires_on_a_skew_above_the_threshold_with_a_backlog_and_then_cools_down():
    trigger = ReplacementTrigger(window_s=10.0, threshold=1.5, min_ops=4)
    for t in range(10):
        for stage in ("E", "D", "C"):
            trigger.record(float(t), stage)
    assert not trigger.should_replace(10.0, backlog=5)  # balanced
    for t in range(10):
        trigger.record(10.0 + t, "E")
        if t % 2 == 0:
            trigger.record(10.0 + t, "D")
            trigger.record(10.0 + t, "C")
    assert not trigger.should_replace(19.5, backlog=0)  # skewed but nothing waits
    assert trigger.should_replace(19.5, backlog=5)  # encode 2x the diffuse stage
    assert not trigger.should_replace(20.0, backlog=5)  # within one window of the last one
    assert trigger.throughputs(19.5)["D"] == pytest.approx(0.5)


def test_trigger_fires_for_an_unserved_type_without_a_skew_but_not_during_cooldown():
    trigger = ReplacementTrigger(window_s=10.0, threshold=1.5, min_ops=4)
    assert not trigger.should_replace(5.0, backlog=3)  # no ops seen, no skew
    assert trigger.should_replace(5.0, backlog=3, unserved=True)
    assert not trigger.should_replace(9.0, backlog=3, unserved=True)
    assert not trigger.should_replace(30.0, backlog=0, unserved=True)
