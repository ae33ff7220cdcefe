"""Unit tests of the scheduling core's building blocks (pure Python, no database)."""

from __future__ import annotations

import json
import math

import pytest

from scheduling.core.detector import VolatilityLevel, VolatilityTable, WorkloadDetector, load_volatility_table
from scheduling.core.gpu_profiles import BUILTIN_PROFILES, ProfileError, load_profile, profile_from_json
from scheduling.core.placement import PlacementWork, migration_gain
from scheduling.core.policy import Policy, PolicyError, make_policy, resolve_policy_class
from scheduling.core.turboserve import TurboServePolicy, cheapest_type, hysteresis, target_budget
from scheduling.core.types import GB, Decision, Event, GpuTypeSpec, GpuView, SessionView, Snapshot


def spec(name="t", k=4.0, mem=8, price=1.0, base=100.0, slope=50.0, **kw) -> GpuTypeSpec:
    return GpuTypeSpec(
        name=name,
        gpu_type=name,
        capacity=k,
        latency_points=((0.0, base), (2 * k, base + slope * 2 * k)),
        price_per_hour=price,
        provisioning_delay_s=10.0,
        memory_limit_sessions=mem,
        **kw,
    )


class NoopPolicy(Policy):
    """Used by the dotted-path test: a policy defined outside the registry."""

    name = "noop"

    def decide(self, snapshot, event):
        return Decision(time=snapshot.time, queue=snapshot.pending)


class NotAPolicy:
    pass


def test_latency_curve_interpolates_and_extrapolates_past_the_last_point():
    s = GpuTypeSpec(
        name="x",
        gpu_type="x",
        capacity=2,
        latency_points=((1, 200), (2, 300), (3, 500)),
        price_per_hour=1,
        provisioning_delay_s=0,
        memory_limit_sessions=4,
    )
    assert s.latency_ms(0.5) == 200  # flat below the first point
    assert s.latency_ms(1.5) == 250
    assert s.latency_ms(2.5) == 400
    assert s.latency_ms(4.0) == 700  # last segment's slope continues: past K is slower, not refused


def test_latency_curve_rejects_decreasing_points():
    with pytest.raises(ValueError, match="non-decreasing"):
        GpuTypeSpec("x", "x", 2, ((1, 300), (2, 200)), 1, 0, memory_limit_sessions=2)


def test_kappa_follows_alpha_beta_model():
    s = spec(migration_alpha_ms=5.0, link_gbps=100.0)
    assert s.kappa_ms(int(2 * GB)) == pytest.approx(5.0 + 20.0)
    assert s.kappa_ms(0) == pytest.approx(5.0)


def test_builtin_profiles_match_table4_average_latency_at_070_k():
    table4 = {"h20-1.3b": 1054, "h20-7b": 1201, "b300-1.3b": 917, "b300-7b": 1181}
    for name, ms in table4.items():
        p = BUILTIN_PROFILES[name]
        assert p.latency_ms(0.7 * p.capacity) == pytest.approx(ms, rel=0.01)
        assert 20 <= p.kappa_ms(p.state_bytes) <= 32  # Table 4: 23–30 ms


def test_profile_json_round_trip_and_errors(tmp_path):
    original = BUILTIN_PROFILES["h100-1.3b"]
    path = tmp_path / "p.json"
    path.write_text(json.dumps(original.to_json()))
    loaded = load_profile(str(path))
    assert loaded.latency_points == original.latency_points
    assert (
        loaded.capacity == original.capacity
        and loaded.memory_limit_sessions == original.memory_limit_sessions
    )
    with pytest.raises(ProfileError, match="missing"):
        profile_from_json({"name": "x"})
    with pytest.raises(ProfileError, match="unknown field"):
        profile_from_json({**original.to_json(), "colour": "red"})
    with pytest.raises(ProfileError, match="unknown profile"):
        load_profile("no-such-profile")


def test_gain_is_bottleneck_drop_minus_weighted_kappa():
    assert migration_gain(1000, 800, 900, 20, 0.5) == pytest.approx(1000 - 900 - 10)
    assert migration_gain(1000, 990, 995, 20, 1.0) < 0  # not worth its migration cost


def test_hysteresis_band():
    assert hysteresis(0.85, 0.7, 0.1) == 1
    assert hysteresis(0.55, 0.7, 0.1) == -1
    assert hysteresis(0.75, 0.7, 0.1) == 0
    assert hysteresis(0.65, 0.7, 0.1) == 0


def test_target_budget_is_ceiling_and_clamped():
    assert target_budget(10, 4, 0.5, 1, 100) == 5
    assert target_budget(11, 4, 0.5, 1, 100) == 6
    assert target_budget(0, 4, 0.5, 2, 100) == 2
    assert target_budget(1000, 4, 0.5, 1, 16) == 16


def test_cheapest_type_respects_availability():
    types = {"a": spec("a", k=4, price=4.0, availability=1), "b": spec("b", k=4, price=6.0)}
    assert cheapest_type(types, {}) == "a"
    assert cheapest_type(types, {"a": 1}) == "b"


def test_detector_quantises_std_of_activations_per_bin():
    table = VolatilityTable(
        levels=(
            VolatilityLevel(1, 0.5, 0.2, 0.9),
            VolatilityLevel(2, 2.0, 0.2, 0.7),
            VolatilityLevel(3, math.inf, 0.2, 0.5),
        ),
        bin_s=5.0,
        window_bins=4,
    )
    det = WorkloadDetector(table)
    for t in (0.1, 5.1, 10.1, 15.1):  # one activation per bin: σ = 0
        det.observe(t, "active")
    sigma, level = det.level(16.0)
    assert sigma == 0 and level.level == 1
    for _ in range(6):  # burst in the last bin: counts 1,1,1,7 -> σ = 2.598
        det.observe(17.0, "active")
    sigma, level = det.level(17.0)
    assert sigma == pytest.approx(2.598, abs=1e-3) and level.level == 3 and level.rho_hat == 0.5
    # The window slides: 20 s later only empty bins remain.
    assert det.level(40.0)[0] == 0


def test_detector_state_round_trips_through_json():
    det = WorkloadDetector(load_volatility_table())
    for t, kind in ((0.5, "active"), (3.0, "active"), (7.0, "idle"), (12.0, "active")):
        det.observe(t, kind, was_active=kind == "idle")
    clone = WorkloadDetector(load_volatility_table())
    clone.load_state_dict(json.loads(json.dumps(det.state_dict())))
    assert clone.level(13.0) == det.level(13.0)
    assert clone.expected_net_activations(13.0, 30.0) == det.expected_net_activations(13.0, 30.0)


def test_default_volatility_table_loads_and_is_monotone():
    table = load_volatility_table()
    rhos = [lv.rho_hat for lv in table.levels]
    assert rhos == sorted(rhos, reverse=True)
    assert math.isinf(table.levels[-1].upper)


def test_dotted_path_policy_loading():
    policy = make_policy("tests.scheduling_core.test_policy_units:NoopPolicy")
    assert isinstance(policy, NoopPolicy)
    with pytest.raises(PolicyError, match="not a subclass"):
        resolve_policy_class("tests.scheduling_core.test_policy_units:NotAPolicy")
    with pytest.raises(PolicyError, match="cannot import"):
        resolve_policy_class("no.such.module:X")
    with pytest.raises(PolicyError, match="unknown policy"):
        resolve_policy_class("nonsense")


def _on_two_gpus(sessions: list[SessionView], k: float = 4, mem: int = 8) -> Snapshot:
    """``sessions`` on two ready GPUs g1 and g2 of one type, seen at t = 10 s."""
    return Snapshot.build(
        time=10.0,
        sessions=sessions,
        gpus=[GpuView("g1", "t", "ready"), GpuView("g2", "t", "ready")],
        gpu_types={"t": spec(k=k, mem=mem)},
    )


def _two_gpu_snapshot(loads: tuple[int, int], k: float = 4, mem: int = 8) -> Snapshot:
    sessions = []
    for g, n in zip(("g1", "g2"), loads, strict=True):
        sessions += [SessionView(f"{g}s{i}", 1, "executing", 1.0, g, GB) for i in range(n)]
    return _on_two_gpus(sessions, k=k, mem=mem)


def test_rebalance_moves_off_the_bottleneck_only_while_gain_is_positive():
    work = PlacementWork(_two_gpu_snapshot((6, 0)), eta=0.5)
    moves = work.rebalance()
    assert moves == 3
    assert work.load["g1"] == work.load["g2"] == 3
    # Already balanced: no move can lower the bottleneck.
    assert PlacementWork(_two_gpu_snapshot((3, 3))).rebalance() == 0


def test_rebalance_leaves_sessions_that_just_moved_alone():
    snap = _two_gpu_snapshot((6, 0))
    recent = [
        SessionView(s.id, s.alpha, s.state, s.load, s.gpu, s.state_bytes, since=9.5)
        for s in snap.sessions.values()
    ]
    snap = Snapshot.build(time=10.0, sessions=recent, gpus=list(snap.gpus.values()), gpu_types=snap.gpu_types)
    assert PlacementWork(snap, min_residency_s=2.0).rebalance() == 0
    assert PlacementWork(snap, min_residency_s=0.0).rebalance() == 3


def test_rebalance_respects_migration_cost():
    # One session's worth of imbalance (50 ms) is not worth a 200 ms κ at η = 1.
    snap = _two_gpu_snapshot((3, 1))
    heavy = spec(k=4, mem=8, migration_alpha_ms=200.0)
    snap2 = Snapshot.build(
        time=10.0,
        sessions=list(snap.sessions.values()),
        gpus=list(snap.gpus.values()),
        gpu_types={"t": heavy},
    )
    assert PlacementWork(snap2, eta=1.0).rebalance() == 0
    assert PlacementWork(snap, eta=1.0).rebalance() == 1


def _snapshot(gpu_sessions: dict[str, list[tuple[str, float, float]]], *, k=4.0, mem=8, extra=()) -> Snapshot:
    """GPUs of one type, each with (id, load, since) executing sessions; ``extra`` sessions as given."""
    sessions = [
        SessionView(sid, 1, "executing", load, gid, GB, since=since)
        for gid, rows in gpu_sessions.items()
        for sid, load, since in rows
    ]
    return Snapshot.build(
        time=10.0,
        sessions=[*sessions, *extra],
        gpus=[GpuView(gid, "t", "ready") for gid in gpu_sessions],
        gpu_types={"t": spec(k=k, mem=mem)},
    )


def test_rebalance_swaps_when_no_single_move_fits():
    # g2 is full in session count, so no single move off g1 is possible; exchanging a 2.0 session
    # for a 0.5 one still shifts 1.5 of load and lowers the bottleneck.
    snap = _snapshot(
        {
            "g1": [("a1", 2.0, 0.0), ("a2", 2.0, 0.0), ("a3", 2.0, 0.0)],
            "g2": [("b1", 0.5, 0.0), ("b2", 0.5, 0.0), ("b3", 0.5, 0.0)],
        },
        mem=3,
    )
    work = PlacementWork(snap, eta=0.5)
    assert work.best_move("g1") is None
    assert work.rebalance() == 2  # one swap = two migrations
    assert (work.load["g1"], work.load["g2"]) == (4.5, 3.0)
    assert work.count["g1"] == work.count["g2"] == 3
    migrations, _ = work.migrations()
    assert sorted((m.session, m.src, m.dst) for m in migrations) == [("a1", "g1", "g2"), ("b1", "g2", "g1")]


def test_rebalance_does_not_pay_kappa_when_the_cluster_bottleneck_cannot_drop():
    # g1 and g2 tie at the bottleneck; g2's sessions just arrived (min residency), so relieving g1
    # alone leaves the cluster bottleneck where it was: the move would buy nothing for its κ.
    old = [(f"a{i}", 1.0, 0.0) for i in range(5)]
    recent = [(f"b{i}", 1.0, 9.5) for i in range(5)]
    snap = _snapshot({"g1": old, "g2": recent, "g3": []})
    work = PlacementWork(snap, eta=0.5, min_residency_s=2.0)
    assert work.rebalance() == 0
    assert (work.load["g1"], work.load["g2"], work.load["g3"]) == (5.0, 5.0, 0.0)
    assert work.migrations() == ((), ())
    # Once g2 may be relieved too, both moves lower the bottleneck and are kept.
    work = PlacementWork(snap, eta=0.5, min_residency_s=0.0)
    assert work.rebalance() >= 2
    assert work.bottleneck_ms() < spec().latency_ms(5.0)


def test_unwind_sends_a_migrated_session_home_in_exchange_for_a_fresh_one():
    fresh = SessionView("f", 1, "queued", 1.0, None, GB)
    snap = _snapshot(
        {"g1": [("a0", 1.0, 0.0), ("a1", 1.0, 0.0), ("a2", 1.0, 0.0)], "g2": [("b0", 1.0, 0.0)]},
        extra=(fresh,),
    )
    work = PlacementWork(snap, eta=0.5)
    work.add("f", "g1")
    work.move("a0", "g1", "g2")  # same loads as moving the fresh session, but it costs κ
    assert work.unwind(["a0"]) == 1
    assert work.location["a0"] == "g1" and work.location["f"] == "g2"
    assert (work.load["g1"], work.load["g2"]) == (3.0, 2.0)
    assert work.migrations() == ((), (("f", "g2"),))
    # Going home alone would raise the bottleneck by more than the κ saved: kept.
    work = PlacementWork(snap, eta=0.5)
    work.move("a0", "g1", "g2")
    assert work.unwind(["a0"]) == 0
    assert work.location["a0"] == "g2"


def test_unwind_prefers_sending_a_session_with_less_state_instead():
    # a0 (5 GB) was moved off g1; moving a1 (1 GB, same load) instead gives the same loads for less κ.
    sessions = [
        SessionView("a0", 1, "executing", 1.0, "g1", 5 * GB),
        SessionView("a1", 1, "executing", 1.0, "g1", 1 * GB),
        SessionView("a2", 1, "executing", 1.0, "g1", 5 * GB),
        SessionView("b0", 1, "executing", 1.0, "g2", GB),
    ]
    work = PlacementWork(_on_two_gpus(sessions), eta=0.5)
    work.move("a0", "g1", "g2")
    assert work.unwind(["a0"]) == 1
    migrations, _ = work.migrations()
    assert [(m.session, m.src, m.dst) for m in migrations] == [("a1", "g1", "g2")]


def test_unwind_trials_leave_no_trace_in_the_decision():
    # Neither going home nor exchanging with a1 helps; a1 was only tried, so it is no action at all.
    sessions = [
        SessionView("a0", 1, "executing", 1.0, "g1", 5 * GB),
        SessionView("a1", 1, "executing", 2.0, "g1", 1 * GB),
        SessionView("b0", 1, "executing", 1.0, "g2", GB),
    ]
    work = PlacementWork(_on_two_gpus(sessions), eta=0.5)
    work.move("a0", "g1", "g2")
    assert work.unwind(["a0"]) == 0
    migrations, assigns = work.migrations()
    assert [(m.session, m.src, m.dst) for m in migrations] == [("a0", "g1", "g2")]
    assert assigns == ()


def test_assignment_prefers_room_below_k_then_less_loaded():
    snap = _two_gpu_snapshot((3, 1))
    sessions = [*snap.sessions.values(), SessionView("new", 1, "suspended", 1.0, None, GB)]
    snap = Snapshot.build(
        time=1.0, sessions=sessions, gpus=list(snap.gpus.values()), gpu_types=snap.gpu_types
    )
    assert snap.pending == ("new",)
    assert PlacementWork(snap).best_gpu("new") == "g2"


def test_turboserve_state_dict_is_json_and_restores_decisions():
    snap = _two_gpu_snapshot((5, 1))
    a = TurboServePolicy()
    a.decide(snap, Event(0.5, "active", session="g1s0"))
    state = json.loads(json.dumps(a.state_dict()))
    b = TurboServePolicy()
    b.load_state_dict(state)
    ev = Event(1.0, "tick")
    assert a.decide(snap, ev) == b.decide(snap, ev)


def test_drained_gpu_is_kept_for_the_release_grace_then_released():
    t = spec(k=4, mem=8)
    gpus = [GpuView("g1", "t", "ready"), GpuView("g2", "t", "draining")]
    sessions = [SessionView("a", 1, "executing", 1.0, "g1", GB)]
    policy = TurboServePolicy(rho_hat=0.5, release_grace_s=20.0)
    policy.load_state_dict({"drained_at": {"g2": 100.0}})
    early = Snapshot.build(time=110.0, sessions=sessions, gpus=gpus, gpu_types={"t": t})
    assert "g2" not in policy.decide(early, Event(110.0, "tick")).release
    late = Snapshot.build(time=121.0, sessions=sessions, gpus=gpus, gpu_types={"t": t})
    assert policy.decide(late, Event(121.0, "tick")).release == ("g2",)
    assert TurboServePolicy(rho_hat=0.5, release_grace_s=0.0).decide(early, Event(110.0, "tick")).release == (
        "g2",
    )


def test_scale_out_undrains_a_warm_draining_gpu_before_requesting_a_new_one():
    t = spec(k=2, mem=8)
    gpus = [GpuView("g1", "t", "ready"), GpuView("g2", "t", "draining")]
    sessions = [SessionView(f"s{i}", 1, "executing", 1.0, "g1", GB) for i in range(3)]
    decision = TurboServePolicy(rho_hat=0.5, headroom=False).decide(
        Snapshot.build(time=50.0, sessions=sessions, gpus=gpus, gpu_types={"t": t}, max_gpus=8),
        Event(50.0, "tick"),
    )
    assert decision.undrain == ("g2",)
    assert decision.migrations  # rebalanced onto the un-drained GPU at once


def test_sessions_assigned_in_the_same_decision_move_freely_onto_an_undrained_gpu():
    # Regression (found by hypothesis): five new sessions on two K=2 GPUs and one draining GPU.
    t = spec(k=2, mem=3)
    gpus = [GpuView("g0", "t", "ready"), GpuView("g1", "t", "ready"), GpuView("g2", "t", "draining")]
    sessions = [SessionView(f"s{i}", 1, "suspended", 1.0, None, GB, since=float(i)) for i in range(5)]
    snap = Snapshot.build(time=0.0, sessions=sessions, gpus=gpus, gpu_types={"t": t}, max_gpus=10)
    decision = TurboServePolicy(rho_hat=0.95, headroom=False).decide(snap, Event(0.0, "tick"))
    assert decision.undrain == ("g2",)
    per_gpu: dict[str, int] = {}
    for _, gid in decision.assign:
        per_gpu[gid] = per_gpu.get(gid, 0) + 1
    assert max(per_gpu.values()) <= 2 and not decision.migrations


def test_scale_in_waits_for_the_stabilisation_window():
    # K = 4 on each of two GPUs, ρ̂ = 0.5: four active sessions need both; one needs only one.
    t = spec(k=4, mem=8)
    gpus = [GpuView("g1", "t", "ready"), GpuView("g2", "t", "ready")]
    busy = [SessionView(f"s{i}", 1, "executing", 1.0, f"g{1 + i % 2}", GB) for i in range(4)]

    def decide(policy, time, sessions):
        snap = Snapshot.build(time=time, sessions=sessions, gpus=gpus, gpu_types={"t": t}, max_gpus=4)
        return policy.decide(snap, Event(time, "tick"))

    def policy(**kw):
        return TurboServePolicy(rho_hat=0.5, headroom=False, cooldown_s=0.0, **kw)

    held = policy(scale_in_window_s=None)  # window = the type's provisioning delay (10 s here)
    assert not decide(held, 100.0, busy).drain
    assert not decide(held, 105.0, busy[:1]).drain  # the dip is younger than one provisioning delay
    assert decide(held, 111.0, busy[:1]).drain  # no decision in the last 10 s needed the second GPU
    state = json.loads(json.dumps(held.state_dict()))
    assert len(state["needed_window"]) <= 11

    eager = policy()  # the default: no window
    assert not decide(eager, 100.0, busy).drain
    assert decide(eager, 105.0, busy[:1]).drain
    with pytest.raises(ValueError, match="scale_in_window_s"):
        policy(scale_in_window_s=-1.0)


def test_the_scale_in_window_holds_observed_demand_not_a_forecast_that_did_not_come():
    # K = 4 on each of two GPUs, ρ̂ = 0.5, delay 10 s. One activation at t = 0 makes the detector
    # forecast 2 more within a delay: (1 + 2) / 0.5 = 6 > 4 keeps both GPUs. By t = 5 a quiet bin
    # halves the drift: (1 + 1) / 0.5 = 4 fits on one GPU. The t = 0 forecast never materialised,
    # so the window (which remembers N_req / ρ̂ = 2) must not hold the second GPU for it.
    t = spec(k=4, mem=8)
    gpus = [GpuView("g1", "t", "ready"), GpuView("g2", "t", "ready")]
    one = [SessionView("s0", 1, "executing", 1.0, "g1", GB)]
    policy = TurboServePolicy(
        rho_hat=0.5, headroom=True, headroom_z=0.0, cooldown_s=0.0, scale_in_window_s=None
    )

    def decide(time, event):
        snap = Snapshot.build(time=time, sessions=one, gpus=gpus, gpu_types={"t": t}, max_gpus=4)
        return policy.decide(snap, event)

    first = decide(0.0, Event(0.0, "active", session="s0"))
    assert first.signals.headroom == pytest.approx(2.0)
    assert not first.drain
    later = decide(5.0, Event(5.0, "tick"))
    assert later.signals.headroom == pytest.approx(1.0)
    assert list(later.drain) == ["g2"]
