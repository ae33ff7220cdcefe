"""Exact placement oracle: the MILP equals exhaustive search; the gap harness is honest."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pytest

from scheduling.sim.oracles.gap import placement_gap, random_instance, turboserve_heuristic
from scheduling.sim.oracles.placement import (
    InfeasibleInstance,
    OracleGpu,
    OracleSession,
    alpha_beta_kappa,
    evaluate_placement,
    solve_placement,
    solve_placement_exhaustive,
    solve_placement_milp,
    spec_kappa,
)


@dataclass(frozen=True)
class QuadSpec:
    """Minimal protocol object (no latency_points): ℓ = base + a·w + b·w²."""

    base: float
    a: float
    b: float
    capacity: float = 4.0
    memory_limit_sessions: int | None = None

    def latency_ms(self, load: float) -> float:
        return self.base + self.a * load + self.b * load * load


KAPPA = alpha_beta_kappa(alpha_ms=5.0, link_gbps=20.0)  # 1 GB -> 55 ms


def _random_tiny(rng, curvature):
    m = int(rng.integers(2, 4))
    n = int(rng.integers(2, 7))
    specs = [
        QuadSpec(
            float(rng.uniform(300, 400)),
            float(rng.uniform(60, 100)),
            float(curvature),
            memory_limit_sessions=int(rng.integers(2, 6)),
        )
        for _ in range(2)
    ]
    gpus = [OracleGpu(f"g{j}", specs[int(rng.integers(2))]) for j in range(m)]
    sessions = [
        OracleSession(
            f"s{i}",
            float(rng.choice([0.5, 1.0, 1.5, 2.0])),
            None if rng.uniform() < 0.3 else f"g{int(rng.integers(m))}",
            int(rng.integers(1, 8)) * 10**9,
        )
        for i in range(n)
    ]
    return sessions, gpus


@pytest.mark.parametrize("curvature", [0.0, 6.0, -3.0])  # linear, convex, concave (segment binaries)
@pytest.mark.parametrize("seed", range(6))
def test_milp_equals_exhaustive_on_tiny_instances(seed, curvature):
    rng = np.random.default_rng([seed, int(curvature) + 10])
    sessions, gpus = _random_tiny(rng, curvature)
    try:
        exhaustive = solve_placement_exhaustive(sessions, gpus, KAPPA, eta=0.5)
    except InfeasibleInstance:
        with pytest.raises(InfeasibleInstance):
            solve_placement_milp(sessions, gpus, KAPPA, eta=0.5)
        return
    for formulation in ("auto", "segments"):
        milp = solve_placement_milp(sessions, gpus, KAPPA, eta=0.5, formulation=formulation)
        assert milp.optimal
        assert milp.objective == pytest.approx(exhaustive.objective, abs=1e-6)
        # the reported objective is recomputed with the true curves
        check = evaluate_placement(sessions, gpus, milp.placement, KAPPA, 0.5)
        assert check.objective == pytest.approx(milp.objective)
        # the water-filling cut is a valid lower bound on the bottleneck
        assert milp.details["lower_bound_cut"] <= exhaustive.bottleneck_ms + 1e-9
    # a tight upper-bound cut (the optimum itself) keeps the optimum feasible
    tight = solve_placement_milp(sessions, gpus, KAPPA, eta=0.5, upper_bound=exhaustive.objective)
    assert tight.objective == pytest.approx(exhaustive.objective, abs=1e-6)


def test_milp_matches_exhaustive_with_piecewise_linear_specs_and_float_loads():
    rng = np.random.default_rng(3)
    instance_sessions, instance_gpus = random_instance(3, rng)
    sessions = [
        OracleSession(s.id, s.load * float(rng.uniform(0.9, 1.1)), s.gpu, s.state_bytes)
        for s in instance_sessions[:7]
    ]
    exhaustive = solve_placement_exhaustive(sessions, instance_gpus, spec_kappa, eta=0.5)
    milp = solve_placement_milp(sessions, instance_gpus, spec_kappa, eta=0.5)
    assert milp.details["exact_curves"] and milp.optimal
    assert milp.objective == pytest.approx(exhaustive.objective, abs=1e-6)


def test_hand_example_balances_and_weighs_migration():
    spec = QuadSpec(100.0, 100.0, 0.0, memory_limit_sessions=4)
    gpus = [OracleGpu("a", spec), OracleGpu("b", spec)]
    sessions = [OracleSession(f"s{i}", 1.0, "a", 10**9) for i in range(4)]  # all on a: L = 500
    kappa = alpha_beta_kappa(alpha_ms=0.0, link_gbps=1.0)  # 1 GB -> 1000 ms
    # cheap migration: move two, L = 300, objective 300 + 0.01 * 2000 = 320
    cheap = solve_placement_milp(sessions, gpus, kappa, eta=0.01)
    assert cheap.bottleneck_ms == pytest.approx(300.0) and len(cheap.moved) == 2
    assert cheap.objective == pytest.approx(320.0)
    # dear migration: each move gains 100 ms but costs 0.2 * 1000 = 200: stay put
    dear = solve_placement_milp(sessions, gpus, kappa, eta=0.2)
    assert dear.moved == [] and dear.objective == pytest.approx(500.0)


def test_memory_limit_is_hard():
    spec = QuadSpec(100.0, 10.0, 0.0, memory_limit_sessions=1)
    gpus = [OracleGpu("a", spec), OracleGpu("b", spec)]
    sessions = [OracleSession(f"s{i}", 1.0) for i in range(3)]
    with pytest.raises(InfeasibleInstance):
        solve_placement_milp(sessions, gpus, KAPPA)
    with pytest.raises(InfeasibleInstance):
        solve_placement_exhaustive(sessions, gpus, KAPPA)


def test_solve_placement_dispatches_by_size():
    spec = QuadSpec(100.0, 10.0, 0.0)
    gpus = [OracleGpu("a", spec), OracleGpu("b", spec)]
    sessions = [OracleSession(f"s{i}", 1.0) for i in range(3)]
    assert solve_placement(sessions, gpus, KAPPA).method == "exhaustive"
    assert solve_placement(sessions, gpus, KAPPA, exhaustive_limit=1).method == "milp"


def test_oracle_is_never_worse_than_the_heuristic():
    rng = np.random.default_rng(11)
    for m in (3, 4):
        sessions, gpus = random_instance(m, rng)
        heuristic = evaluate_placement(sessions, gpus, turboserve_heuristic(sessions, gpus), spec_kappa, 0.5)
        oracle = solve_placement_milp(sessions, gpus, spec_kappa, eta=0.5)
        assert oracle.optimal
        assert oracle.objective <= heuristic.objective + 1e-6


def test_placement_gap_report_shape_and_bounds():
    report = placement_gap(turboserve_heuristic, n_instances=2, gpu_counts=(3, 4), seed=5)
    assert set(report["by_gpus"]) == {"3", "4"}
    overall = report["overall"]
    assert overall["instances"] == 4
    assert 0.0 <= overall["mean_gap_pct"] <= overall["max_gap_pct"]
    assert all(row["gap"] >= 0.0 for row in report["rows"])


def test_placement_gap_is_zero_for_the_oracle_itself():
    def oracle_heuristic(sessions, gpus, kappa, eta=0.5):
        return solve_placement_milp(sessions, gpus, kappa, eta=eta).placement

    report = placement_gap(oracle_heuristic, n_instances=2, gpu_counts=(3,), seed=2)
    assert report["overall"]["max_gap_pct"] == pytest.approx(0.0, abs=1e-6)


def test_a_bad_heuristic_shows_a_gap():
    def everything_on_first_gpu_that_fits(sessions, gpus, kappa):
        placement, count = {}, {}
        for s in sessions:
            for g in gpus:
                if count.get(g.id, 0) < g.spec.memory_limit_sessions:
                    placement[s.id] = g.id
                    count[g.id] = count.get(g.id, 0) + 1
                    break
        return placement

    report = placement_gap(everything_on_first_gpu_that_fits, n_instances=2, gpu_counts=(4,), seed=1)
    assert report["overall"]["mean_gap_pct"] > 10.0


def test_the_heuristic_adapter_lets_earlier_placements_move():
    # An earlier placement piled six sessions on g0; g1 is empty. The instance's placed sessions
    # are not "just placed", so the controller rebalances them (moving three pays for κ many times).
    from scheduling.core.types import GB, GpuTypeSpec

    spec = GpuTypeSpec(
        name="t",
        gpu_type="t",
        capacity=4.0,
        latency_points=((0.0, 300.0), (8.0, 1100.0)),
        price_per_hour=1.0,
        provisioning_delay_s=30.0,
        memory_limit_sessions=8,
        state_bytes=1 * GB,
    )
    gpus = [OracleGpu("g0", spec), OracleGpu("g1", spec)]
    sessions = [OracleSession(f"s{i}", 1.0, "g0", 1 * GB) for i in range(6)]
    placement = turboserve_heuristic(sessions, gpus, spec_kappa)
    assert sorted(placement.values()).count("g1") == 3
