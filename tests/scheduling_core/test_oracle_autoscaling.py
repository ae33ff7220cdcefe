"""Table 2 DP oracle and the per-window rho oracle."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from scheduling.sim.oracles.autoscaling import (
    RHO_GRID,
    autoscaling_oracle,
    gpus_needed,
    per_window_rho_oracle,
    schedule_cost,
    slot_demand,
    trace_autoscaling_oracle,
)
from scheduling.sim.traces import parse_trace

# 3600 $/h = 1 $/s keeps the hand arithmetic readable.
PRICE = 3600.0


def test_dp_releases_through_a_dip_when_boot_is_cheap():
    # need [2, 1, 2], 60 s slots, 30 s delay:
    #   keep 2 throughout: 2*60*3 = 360 $
    #   release one for the dip: 2*60 + 1*60 + 2*60 + 30 (boot of the re-added GPU) = 330 $
    result = autoscaling_oracle([2, 1, 2], slot_s=60, delay_s=30, price_per_hour=PRICE)
    assert result.budgets == [2, 1, 2]
    assert result.cost_usd == pytest.approx(330.0)
    assert result.boot_gpu_seconds == pytest.approx(30.0) and result.scale_ups == 1


def test_dp_keeps_gpus_through_a_dip_when_boot_is_dear():
    # with a 90 s delay re-adding costs 300 + 90 = 390 $ > 360 $ for keeping both
    result = autoscaling_oracle([2, 1, 2], slot_s=60, delay_s=90, price_per_hour=PRICE)
    assert result.budgets == [2, 2, 2]
    assert result.cost_usd == pytest.approx(360.0)


def test_dp_pays_boot_for_gpus_beyond_the_initial_pool():
    # start with 1 ready GPU; need 3 in slot 0: two boots of 45 s are paid before t = 0
    result = autoscaling_oracle([3, 3], slot_s=60, delay_s=45, price_per_hour=PRICE, initial_gpus=1)
    assert result.cost_usd == pytest.approx(3 * 120 + 2 * 45)


def test_dp_caps_at_max_gpus():
    result = autoscaling_oracle([1, 5, 2], slot_s=60, delay_s=10, price_per_hour=PRICE, max_gpus=3)
    assert result.budgets[1] == 3 and result.details["capped_slots"] == [1]


@pytest.mark.parametrize("seed", range(12))
def test_dp_is_never_worse_than_any_feasible_schedule(seed):
    rng = np.random.default_rng(seed)
    need = rng.integers(0, 4, size=5).tolist()
    delay = float(rng.choice([0, 20, 45, 90, 150]))
    initial = int(rng.integers(0, 4))
    oracle = autoscaling_oracle(need, slot_s=60, delay_s=delay, price_per_hour=PRICE, initial_gpus=initial)
    assert all(m >= n for m, n in zip(oracle.budgets, need, strict=True))
    costs = []
    for budgets in itertools.product(range(5), repeat=len(need)):
        if all(m >= n for m, n in zip(budgets, need, strict=True)):
            costs.append(
                schedule_cost(budgets, slot_s=60, delay_s=delay, price_per_hour=PRICE, initial_gpus=initial)[
                    0
                ]
            )
    assert oracle.cost_usd == pytest.approx(min(costs))


def test_slot_demand_and_needed_gpus_from_a_trace():
    lines = [
        '{"t": 0, "session": "a", "event": "arrive", "load": 2.0}',
        '{"t": 0, "session": "b", "event": "arrive"}',
        '{"t": 10, "session": "a", "event": "active"}',
        '{"t": 30, "session": "b", "event": "active"}',
        '{"t": 70, "session": "a", "event": "idle"}',
        '{"t": 100, "session": "b", "event": "depart"}',
    ]
    _, events = parse_trace(lines)
    assert slot_demand(events, slot_s=60, duration_s=120) == [3.0, 3.0]
    # slot 0: 2 on [10,30), 3 on [30,60) -> (40 + 90) / 60
    assert slot_demand(events, slot_s=60, duration_s=120, statistic="mean")[0] == pytest.approx(130 / 60)
    assert gpus_needed([3.0, 4.0, 0.0], capacity=5, rho_hat=0.8) == [1, 1, 0]
    assert gpus_needed([4.01], capacity=5, rho_hat=0.8) == [2]
    schedule = trace_autoscaling_oracle(
        events, capacity=2, rho_hat=0.5, delay_s=30, price_per_hour=PRICE, duration_s=120
    )
    assert schedule.need == [3, 3] and schedule.budgets == [3, 3]


def _toy_evaluate(needs, slo=600.0):
    """A stand-in simulator: window w is over the SLO when rho exceeds its safe value; cost falls with rho."""

    def evaluate(rhos):
        cost = sum(n / r for n, r in zip(needs, rhos, strict=True))
        worst = max(400.0 + 300.0 * max(0.0, r - safe) / 0.05 for r, safe in zip(rhos, SAFE, strict=True))
        return cost, worst

    return evaluate


SAFE = (0.70, 0.95, 0.55, 0.80)


def test_rho_oracle_greedy_matches_exhaustive_on_a_separable_toy():
    evaluate = _toy_evaluate([10, 5, 20, 8])
    greedy = per_window_rho_oracle(evaluate, 4, slo_ms=600.0, candidates=RHO_GRID[:10])
    exhaustive = per_window_rho_oracle(evaluate, 4, slo_ms=600.0, method="exhaustive")
    assert greedy.rhos == list(SAFE)
    assert exhaustive.rhos == list(SAFE)
    assert greedy.cost == pytest.approx(exhaustive.cost)
    assert greedy.feasible and greedy.evaluations < exhaustive.evaluations


def test_rho_oracle_reports_infeasible_when_nothing_meets_the_slo():
    result = per_window_rho_oracle(lambda rhos: (1.0, 900.0), 2, slo_ms=600.0)
    assert not result.feasible and result.worst_latency_ms == 900.0


def test_rho_oracle_accounts_for_coupling_between_windows():
    # Packing window 0 densely (rho > 0.6) leaves too few GPUs booted for window 1's burst.
    def evaluate(rhos):
        cost = 10 / rhos[0] + 10 / rhos[1]
        worst = 500.0 + (200.0 if rhos[0] > 0.6 else 0.0) + (200.0 if rhos[1] > 0.8 else 0.0)
        return cost, worst

    result = per_window_rho_oracle(evaluate, 2, slo_ms=600.0)
    exhaustive = per_window_rho_oracle(evaluate, 2, slo_ms=600.0, method="exhaustive")
    assert result.rhos == exhaustive.rhos == [0.6, 0.8]
