"""The stage dispatcher's integer program: HiGHS against brute force, machine packing, reward shape."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from scheduling.core.stages.dispatch import (
    ON_TIME_REWARD,
    Candidate,
    assign_machines,
    block_capacity,
    completion_reward,
    solve_dispatch,
)
from scheduling.core.stages.stage_profiles import DEGREES


def _random_instance(rng: np.random.Generator):
    pools = ["V0", "V1"]
    idle = {p: [int(x) for x in rng.integers(0, 9, size=int(rng.integers(1, 3)))] for p in pools}
    size = {p: sum(idle[p]) + int(rng.integers(0, 8)) for p in pools}
    candidates = []
    for request in range(int(rng.integers(1, 5))):
        deadline = float(rng.uniform(10, 60))
        for _ in range(int(rng.integers(1, 4))):
            degree = int(rng.choice(DEGREES))
            run = float(rng.uniform(5, 80)) / degree
            candidates.append(
                Candidate(
                    request,
                    str(rng.choice(pools)),
                    degree,
                    run,
                    deadline,
                    10.0,
                    run,
                    now=bool(rng.random() < 0.7),
                )
            )
    return candidates, idle, size


def _feasible(chosen, candidates, idle, size) -> bool:
    if len({candidates[i].request for i in chosen}) < len(chosen):
        return False
    for pool in idle:
        runs = [candidates[i] for i in chosen if candidates[i].pool == pool]
        if sum(c.degree for c in runs) > size[pool]:
            return False
        now = [c.degree for c in runs if c.now]
        if any(sum(k for k in now if k >= j) > block_capacity(idle[pool], j) for j in DEGREES):
            return False
    return True


def _brute_force(candidates, idle, size) -> float:
    best = 0.0
    for count in range(len(candidates) + 1):
        for chosen in itertools.combinations(range(len(candidates)), count):
            if _feasible(chosen, candidates, idle, size):
                best = max(best, sum(candidates[i].weight for i in chosen))
    return best


@pytest.mark.parametrize("seed", range(25))
def test_highs_matches_brute_force_on_tiny_instances(seed):
    candidates, idle, size = _random_instance(np.random.default_rng(seed))
    picked = solve_dispatch(candidates, idle, size)
    assert _feasible(picked, candidates, idle, size)
    # The program also chooses waiting options (not returned); its now-part is what the brute force
    # must not beat by more than the solver's gap when waits are added back optimally.
    best = _brute_force(candidates, idle, size)
    waits = [i for i, c in enumerate(candidates) if not c.now]
    completed = max(
        (
            sum(candidates[i].weight for i in picked + list(extra))
            for n in range(len(waits) + 1)
            for extra in itertools.combinations(waits, n)
            if _feasible(picked + list(extra), candidates, idle, size)
        ),
        default=0.0,
    )
    assert completed >= best * (1 - 0.005) - 1e-6


def test_runs_passing_the_block_rows_always_fit_the_machines():
    rng = np.random.default_rng(7)
    for _ in range(300):
        idle = {m: int(rng.integers(0, 9)) for m in range(int(rng.integers(1, 5)))}
        degrees = []
        for k in rng.permutation(np.repeat(DEGREES, 4)):
            trial = [*degrees, int(k)]
            if all(
                sum(d for d in trial if d >= j) <= block_capacity(list(idle.values()), j) for j in DEGREES
            ):
                degrees = trial
        machines = assign_machines(degrees, idle)
        for m, free in idle.items():
            assert sum(k for k, mm in zip(degrees, machines, strict=True) if mm == m) <= free


def test_block_rows_reject_a_run_no_single_machine_can_host():
    # 8 idle GPUs spread 4 + 4: a degree-8 run must wait although 8 are idle in total.
    candidates = [Candidate(0, "V0", 8, 5.0, 10.0, 5.0, 5.0), Candidate(1, "V0", 4, 9.0, 10.0, 5.0, 9.0)]
    assert solve_dispatch(candidates, {"V0": [4, 4]}, {"V0": 8}) == [1]
    assert solve_dispatch(candidates, {"V0": [8]}, {"V0": 8}) in ([0], [1])


def test_waiting_for_an_on_time_slot_beats_a_late_run_now():
    # Request 0 can run now at degree 2 (late) or wait 3 s for 8 GPUs (on time): it waits, and the
    # two idle GPUs go to request 1 instead.
    candidates = [
        Candidate(0, "V0", 2, 70.0, 50.0, 17.0, 70.0),
        Candidate(0, "V0", 8, 20.0, 50.0, 17.0, 17.0, now=False),
        Candidate(1, "V0", 2, 30.0, 40.0, 17.0, 30.0),
    ]
    assert solve_dispatch(candidates, {"V0": [2]}, {"V0": 10}) == [2]


def test_completion_reward_prefers_on_time_and_ages_late_requests_up_to_the_cap():
    on_time = completion_reward(10.0, 20.0, 5.0, 10.0)
    late = [completion_reward(20.0 + d, 20.0, 5.0, 10.0) for d in (1.0, 10.0, 100.0)]
    assert on_time >= ON_TIME_REWARD > late[0]
    assert late[0] < late[1] < late[2] == ON_TIME_REWARD
