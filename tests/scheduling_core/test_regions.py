"""Regions (TORTA): topologies, the OT plan, smoothing, the Eq. 6 floor, forecasts, the simulator."""

from __future__ import annotations

import copy
import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from scheduling.core.regions.forecast import (
    EtsForecaster,
    SeasonalNaiveForecaster,
    prediction_accuracy,
    predictive_floor,
)
from scheduling.core.regions.transport import (
    TransportPlan,
    routing_probabilities,
    smooth_plan,
    solve_plan,
)
from scheduling.sim.regions.demand import DemandShape, generate_demand, parse_region_trace
from scheduling.sim.regions.policies import POLICIES, make_region_policy
from scheduling.sim.regions.simulator import RegionSimConfig, RegionSimulator
from scheduling.sim.regions.topology import (
    BUILTIN_SHAPES,
    TopologyError,
    builtin_topology,
    parse_topology,
)
from scheduling.sim.traces import TraceError

SMALL = {
    "name": "three",
    "rtt_budget_ms": 40,
    "regions": [
        {"name": "east", "price_multiplier": 1.4, "gpus": {"H100": 3, "T4": 2}},
        {"name": "central", "price_multiplier": 0.7, "gpus": {"A100": 3}},
        {"name": "west", "price_multiplier": 1.0, "gpus": {"4090": 4}},
    ],
    "origins": [
        {"name": "nyc", "weight": 2.0, "utc_offset_h": -5},
        {"name": "chi", "weight": 1.0, "utc_offset_h": -6},
        {"name": "sfo", "weight": 1.5, "utc_offset_h": -8},
    ],
    # sfo cannot reach east within 40 ms, nyc cannot reach west.
    "rtt_ms": [[2, 20, 70], [20, 2, 35], [70, 35, 2]],
}


# -- topologies -------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", sorted(BUILTIN_SHAPES))
def test_builtin_topologies_follow_table_1a_and_are_seeded(name):
    nodes, scale_ms, *_ = BUILTIN_SHAPES[name]
    topology = builtin_topology(name)
    assert len(topology.regions) == len(topology.origins) == nodes
    off_diagonal = topology.rtt_ms[~np.eye(nodes, dtype=bool)]
    assert off_diagonal.mean() == pytest.approx(scale_ms)
    assert (np.diag(topology.rtt_ms) == 2.0).all()
    assert topology.allowed().any(axis=1).all()
    # Mixed GPU types across the topology, two per region.
    assert all(len(r.gpus) == 2 for r in topology.regions)
    assert len({k for r in topology.regions for k in r.gpus}) >= 3
    again = builtin_topology(name)
    assert np.array_equal(again.rtt_ms, topology.rtt_ms) and again.regions == topology.regions
    assert not np.array_equal(builtin_topology(name, seed=1).rtt_ms, topology.rtt_ms)


def test_topology_json_round_trips():
    topology = builtin_topology("gabriel")
    again = parse_topology(topology.to_json())
    assert again.regions == topology.regions and again.origins == topology.origins
    assert np.allclose(again.rtt_ms, topology.rtt_ms, atol=1e-3)
    small = parse_topology(SMALL)
    assert small.allowed().tolist() == [[True, True, False], [True, True, True], [False, True, True]]
    assert small.max_capacity().tolist() == [3 * 4 + 2 * 1, 3 * 3, 4 * 2]


def _broken(path, value):
    doc = copy.deepcopy(SMALL)
    target = doc
    for key in path[:-1]:
        target = target[key]
    if value is KeyError:
        del target[path[-1]]
    else:
        target[path[-1]] = value
    return doc


@pytest.mark.parametrize(
    ("path", "value", "field"),
    [
        (("rtt_budget_ms",), KeyError, "rtt_budget_ms"),
        (("rtt_budget_ms",), 0, "rtt_budget_ms"),
        (("rtt_budget_ms",), 1, "rtt_budget_ms"),  # no origin reaches any region
        (("regions", 1, "gpus", "A100"), -1, "regions[1].gpus.A100"),
        (("regions", 1, "gpus", "A100"), 2.5, "regions[1].gpus.A100"),
        (("regions", 2, "gpus"), {"B300": 2}, "regions[2].gpus.B300"),
        (("regions", 2, "gpus"), {"T4": 0}, "regions[2].gpus"),
        (("regions", 0, "price_multiplier"), 0, "regions[0].price_multiplier"),
        (("regions", 2, "name"), "east", "regions[2].name"),
        (("regions", 0, "zone"), "x", "regions[0].zone"),
        (("origins", 1, "weight"), "heavy", "origins[1].weight"),
        (("rtt_ms", 1), [20, 2], "rtt_ms[1]"),
        (("rtt_ms", 2, 0), float("nan"), "rtt_ms[2][0]"),
        (("rtt_ms",), [[2, 20, 70]], "rtt_ms"),
        (("regions",), [], "regions"),
    ],
)
def test_topology_validation_errors_name_the_field(path, value, field):
    with pytest.raises(TopologyError) as info:
        parse_topology(_broken(path, value))
    assert info.value.field == field
    assert str(info.value).startswith(f"{field}: ")


# -- demand and traces ------------------------------------------------------------------------------


def test_generated_demand_is_seeded_diurnal_and_carries_origins():
    topology = parse_topology(SMALL)
    shape = DemandShape(duration_s=3600, day_s=1800, bursts=0)
    trace = generate_demand(topology, shape, seed=3)
    assert trace.events == generate_demand(topology, shape, seed=3).events
    arrivals = [e for e in trace.events if e.event == "arrive"]
    assert len(arrivals) > 100 and {e.session for e in arrivals} == set(trace.origin_of)
    assert set(trace.origin_of.values()) == {"nyc", "chi", "sfo"}
    nyc = sum(1 for o in trace.origin_of.values() if o == "nyc")
    chi = sum(1 for o in trace.origin_of.values() if o == "chi")
    assert nyc > chi  # weights 2 : 1


def test_region_trace_round_trips_and_rejects_bad_origins(tmp_path):
    from scheduling.sim.regions.demand import read_region_trace, write_region_trace

    topology = parse_topology(SMALL)
    trace = generate_demand(topology, DemandShape(duration_s=600, day_s=600, bursts=0), seed=0)
    path = tmp_path / "t.jsonl"
    write_region_trace(path, trace)
    again = read_region_trace(path, topology)
    assert again.events == trace.events and again.origin_of == trace.origin_of
    good = '{"t": 0, "session": "a", "event": "arrive", "origin": "nyc"}'
    with pytest.raises(TraceError, match="line 1: 'origin' is required"):
        parse_region_trace(['{"t": 0, "session": "a", "event": "arrive"}'], topology)
    with pytest.raises(TraceError, match="line 1: 'origin' 'mars'"):
        parse_region_trace(['{"t": 0, "session": "a", "event": "arrive", "origin": "mars"}'], topology)
    with pytest.raises(TraceError, match="line 2: 'origin' is allowed only on arrive"):
        parse_region_trace([good, '{"t": 1, "session": "a", "event": "active", "origin": "nyc"}'], topology)
    # The shared trace rules still apply underneath.
    with pytest.raises(TraceError, match="line 2: time goes back"):
        parse_region_trace(
            [
                '{"t": 5, "session": "a", "event": "arrive", "origin": "nyc"}',
                '{"t": 1, "session": "a", "event": "active"}',
            ],
            topology,
        )


# -- the OT plan ------------------------------------------------------------------------------------


@st.composite
def transport_instances(draw):
    n_o = draw(st.integers(1, 6))
    n_r = draw(st.integers(1, 6))
    values = st.floats(0, 50, allow_nan=False)
    demand = np.array(draw(st.lists(values, min_size=n_o, max_size=n_o)))
    capacity = np.array(draw(st.lists(values, min_size=n_r, max_size=n_r)))
    cost = np.array(draw(st.lists(st.floats(0, 500), min_size=n_o * n_r, max_size=n_o * n_r))).reshape(
        n_o, n_r
    )
    allowed = np.array(draw(st.lists(st.booleans(), min_size=n_o * n_r, max_size=n_o * n_r))).reshape(
        n_o, n_r
    )
    for o in range(n_o):
        allowed[o, draw(st.integers(0, n_r - 1))] = True
    return demand, capacity, cost, allowed


@settings(max_examples=150, deadline=None)
@given(transport_instances())
def test_emd_plan_conserves_demand_respects_capacity_and_budget(instance):
    demand, capacity, cost, allowed = instance
    plan = solve_plan(demand, capacity, cost, allowed, method="emd")
    tol = 1e-6 * (1 + demand.sum() + capacity.sum())
    assert (plan.flow >= -tol).all() and (plan.overflow >= -tol).all()
    assert np.allclose(plan.flow.sum(axis=1) + plan.overflow, demand, atol=tol)
    assert (plan.flow.sum(axis=0) <= capacity + tol).all()
    assert (plan.flow[~allowed] <= tol).all()
    # Overflow only where every region the origin may use is full (absolute overload is kept).
    used = plan.flow.sum(axis=0)
    for o in np.flatnonzero(plan.overflow > tol):
        assert np.allclose(used[allowed[o]], capacity[allowed[o]], atol=tol)


def test_emd_plan_prefers_cheap_routes_and_reports_overload():
    cost = np.array([[1.0, 10.0], [10.0, 1.0]])
    allowed = np.ones((2, 2), dtype=bool)
    plan = solve_plan(np.array([3.0, 1.0]), np.array([2.0, 5.0]), cost, allowed)
    assert plan.flow.tolist() == [[2.0, 1.0], [0.0, 1.0]]
    overloaded = solve_plan(np.array([30.0, 10.0]), np.array([2.0, 5.0]), cost, allowed)
    assert overloaded.overflow.sum() == pytest.approx(33.0)  # not normalised away


def test_unbalanced_sinkhorn_keeps_demand_and_the_budget():
    cost = np.array([[1.0, 10.0, 5.0], [10.0, 1.0, 5.0]])
    allowed = np.array([[True, True, False], [True, True, True]])
    plan = solve_plan(np.array([4.0, 2.0]), np.array([3.0, 3.0, 3.0]), cost, allowed, method="sinkhorn")
    assert plan.flow[0, 2] == 0.0
    assert np.allclose(plan.flow.sum(axis=1) + plan.overflow, [4.0, 2.0], rtol=1e-3)


@settings(max_examples=100, deadline=None)
@given(transport_instances(), st.floats(0.01, 1.0), st.integers(0, 2**16))
def test_routing_probabilities_and_smoothing_stay_stochastic_within_budget_and_bounded(instance, beta, seed):
    demand, capacity, cost, allowed = instance
    plan = solve_plan(demand, capacity, cost, allowed)
    probabilities = routing_probabilities(plan, allowed, capacity + 1.0)
    assert np.allclose(probabilities.sum(axis=1), 1.0)
    assert (probabilities[~allowed] == 0).all()
    rng = np.random.default_rng(seed)
    previous = rng.uniform(size=allowed.shape) * allowed
    previous = previous / previous.sum(axis=1, keepdims=True)
    smoothed = smooth_plan(previous, probabilities, beta)
    assert np.allclose(smoothed.sum(axis=1), 1.0)
    assert (smoothed[~allowed] == 0).all()
    step = np.linalg.norm(smoothed - previous)
    assert step <= beta * np.linalg.norm(probabilities - previous) + 1e-9
    assert np.abs(smoothed - previous).max() <= beta + 1e-12


def test_smoothing_rejects_a_step_outside_0_1():
    with pytest.raises(ValueError, match="beta"):
        smooth_plan(None, np.eye(2), 0.0)
    plan = TransportPlan(np.zeros((1, 2)), np.zeros(1))
    assert routing_probabilities(plan, np.array([[True, False]]), np.ones(2)).tolist() == [[1.0, 0.0]]


# -- Eq. 6 and the forecasters ----------------------------------------------------------------------


def test_predictive_floor_is_torta_eq_6():
    # ⌈(2 + 16 + 1·4) / 4⌉ = ⌈5.5⌉ = 6
    assert predictive_floor(2, 16, 4, sigma=1.0) == 6
    assert predictive_floor(2, 16, 4, sigma=1.0, max_gpus=5) == 5  # min(S, ·)
    assert predictive_floor(0, 0, 4) == 0
    assert predictive_floor(0, 16, 4, sigma=0.0) == 4  # exactly full, no spurious extra GPU
    with pytest.raises(ValueError):
        predictive_floor(0, 1, 0)


@given(
    st.floats(0, 100),
    st.floats(0, 500),
    st.floats(0.5, 8),
    st.floats(0, 3),
)
def test_predictive_floor_covers_the_target_with_at_most_one_spare_gpu(queue, forecast, capacity, sigma):
    n = predictive_floor(queue, forecast, capacity, sigma=sigma)
    target = queue + forecast + sigma * math.sqrt(forecast)
    assert n * capacity >= target - 1e-6
    assert (n - 1) * capacity < target + 1e-6 or n == 0


def test_seasonal_naive_repeats_the_last_season():
    forecaster = SeasonalNaiveForecaster(1, season=4)
    for value in [1, 2, 3, 4, 5, 6]:
        forecaster.observe(np.array([value]))
    # t = 5 (value 6); ŷ(t+1) = y(t+1−4) = y(2) = 3, ŷ(t+2) = y(3) = 4.
    assert forecaster.forecast(2).tolist() == [[3.0, 4.0]]
    early = SeasonalNaiveForecaster(1, season=10)
    early.observe(np.array([7.0]))
    assert early.forecast(1).tolist() == [[7.0]]  # last value until a season is known


def test_ets_follows_a_ramp_and_refits_only_every_k_observations():
    forecaster = EtsForecaster(2, refit_every=10, min_history=12)
    rng = np.random.default_rng(0)
    for t in range(40):
        forecaster.observe(np.array([2.0 * t + rng.normal(0, 0.1), 5.0]))
    assert forecaster.fits == 3  # at 12, 22 and 32 observations
    ahead = forecaster.forecast(3)
    assert ahead[0, 0] == pytest.approx(80.0, abs=3.0)
    assert ahead[0, 2] > ahead[0, 0]
    assert ahead[1].tolist() == pytest.approx([5.0, 5.0, 5.0])
    assert forecaster.fit_seconds > 0


def test_prediction_accuracy_is_torta_eq_12():
    assert prediction_accuracy(np.array([10.0, 20.0]), np.array([10.0, 20.0])) == 1.0
    assert prediction_accuracy(np.array([0.0]), np.array([9.0]), epsilon=1.0) == pytest.approx(math.exp(-0.9))


# -- the simulator ----------------------------------------------------------------------------------


def _short_run(policy, seed=0, duration_s=1800.0, **config):
    topology = parse_topology(SMALL)
    shape = DemandShape(duration_s=duration_s, day_s=duration_s, mean_utilisation=0.55, bursts=2, burst_s=300)
    trace = generate_demand(topology, shape, seed)
    trace.meta["day_s"] = shape.day_s
    sim = RegionSimulator(topology, trace, policy, RegionSimConfig(warmup_s=300, **config))
    return sim


@settings(max_examples=6, deadline=None)
@given(st.sampled_from(sorted(POLICIES)), st.integers(0, 1000))
def test_no_policy_routes_or_moves_beyond_the_rtt_budget_or_exceeds_gpu_limits(name, seed):
    sim = _short_run(
        make_region_policy(name, **({"forecast": "last-value"} if name == "torta" else {})), seed
    )
    checked = {"ticks": 0}
    tick = sim._tick

    def checking_tick(now, slot_boundary):
        tick(now, slot_boundary)
        held = sim.ready.copy()
        for _, r, k in sim.pending:
            held[r, k] += 1
        assert (held <= sim.limits).all()
        for session in sim.sessions.values():
            assert sim.rtt[session.origin, session.region] <= sim.topology.rtt_budget_ms
        checked["ticks"] += 1

    sim._tick = checking_tick
    result = sim.run()
    assert checked["ticks"] > 100
    assert result["chunks"] > 0 and 0 < result["slo_pass_rate"] <= 1
    assert result["worst_chunk_latency_ms"] >= result["mean_response_ms"] > 0


def test_simulation_is_deterministic_and_reports_the_documented_keys():
    first = _short_run(make_region_policy("torta", forecast="last-value")).run()
    second = _short_run(make_region_policy("torta", forecast="last-value")).run()
    for key in ("mean_response_ms", "worst_chunk_latency_ms", "gpu_cost_usd", "cross_region_moves"):
        assert first[key] == second[key]
    assert first["macro_solve_ms_p99"] > 0 and first["forecast"] == "last-value"
    assert _short_run(make_region_policy("nearest")).run()["macro_solve_ms_p99"] is None


def test_nearest_keeps_sessions_home_and_round_robin_spreads_them():
    nearest = _short_run(make_region_policy("nearest")).run()
    spread = _short_run(make_region_policy("round-robin")).run()
    assert nearest["remote_share"] == 0.0 and nearest["cross_region_moves"] == 0
    assert spread["remote_share"] > 0.3


def test_torta_moves_a_session_only_when_the_saving_beats_its_stall():
    # A slow boot keeps regions overloaded long enough for moves to pay; an enormous penalty forbids them.
    eager = _short_run(
        make_region_policy("torta", forecast="none", switch_penalty=0.0), provisioning_delay_s=240.0
    ).run()
    never = _short_run(
        make_region_policy("torta", forecast="none", switch_penalty=1e12), provisioning_delay_s=240.0
    ).run()
    assert eager["cross_region_moves"] > 0
    assert never["cross_region_moves"] == 0


def test_torta_never_moves_a_session_again_within_its_cooldown():
    # Eager moves (no penalty, a slow boot) with and without hysteresis; every move is recorded.
    def run(cooldown_s):
        sim = _short_run(
            make_region_policy("torta", forecast="none", switch_penalty=0.0, move_cooldown_s=cooldown_s),
            provisioning_delay_s=240.0,
        )
        moved: list[tuple[float, str]] = []
        move = sim.move

        def recording_move(sid, region):
            moved.append((sim.now, sid))
            move(sid, region)

        sim.move = recording_move
        return sim.run(), moved

    def soon_again(moves):
        last: dict[str, float] = {}
        count = 0
        for at, sid in moves:
            count += sid in last and at - last[sid] < 900.0
            last[sid] = at
        return count

    held, held_moves = run(900.0)
    free, free_moves = run(0.0)
    # without hysteresis some session moves again within 900 s (seed 0); with it, none does
    assert soon_again(free_moves) > 0
    assert soon_again(held_moves) == 0
    assert 0 < held["cross_region_moves"] < free["cross_region_moves"]


def test_the_predictive_floor_provisions_ahead_of_demand():
    with_floor = _short_run(make_region_policy("torta", forecast="last-value", sigma=1.0)).run()
    without = _short_run(make_region_policy("torta", forecast="none")).run()
    assert with_floor["gpu_hours"] > without["gpu_hours"]
    assert with_floor["slo_pass_rate"] >= without["slo_pass_rate"]


def test_policy_options_are_checked():
    with pytest.raises(ValueError, match="beta"):
        make_region_policy("torta", beta=0)
    with pytest.raises(ValueError, match="move_cooldown_s"):
        make_region_policy("torta", move_cooldown_s=-1)
    with pytest.raises(ValueError, match="unknown policy"):
        make_region_policy("random")
    with pytest.raises(ValueError, match="nearest"):
        make_region_policy("nearest", sigma=1)


def test_the_oracle_forecaster_knows_what_the_simulator_will_observe():
    from scheduling.core.regions.forecast import OracleForecaster
    from scheduling.sim.regions.demand import origin_load_by_slot

    sim = _short_run(make_region_policy("torta", forecast="oracle"))
    result = sim.run()
    truth = origin_load_by_slot(sim.trace, sim.topology, sim.config.tick_s, sim.config.slot_s)
    observed = np.array(sim.origin_load_history)
    assert np.allclose(observed, truth[: len(observed)])
    assert result["forecast_accuracy"] == pytest.approx(1.0)
    blurred = OracleForecaster(truth, noise=0.5, seed=1)
    blurred.observe(truth[0])
    ahead = blurred.forecast(2)
    assert ahead.shape == (truth.shape[1], 2) and not np.allclose(ahead[:, 0], truth[1])
    noisy = _short_run(make_region_policy("torta", forecast="oracle", oracle_noise=1.0)).run()
    assert noisy["forecast_accuracy"] < 0.9
