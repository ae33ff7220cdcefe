"""The resource-aware dispatcher's integer program (TridentServe §6.2, App. C.2), solved with HiGHS.

Per tick, for the pending requests ``r``, the primary types ``p`` and the diffuse degrees ``k``
(only those passing C0: efficient degree, memory-feasible type)::

    max  Σ x[r,p,k,s] · β^s · (w[r,p,k,s] − γ·comm[r,p] + k)
    s.t. Σ x[r,·] ≤ 1                                          (C1: one assignment per request)
         Σ_{r, k ≥ j} k · x[r,p,k,now] ≤ j · Σ_m ⌊idle[p,m] / j⌋   for j in 1, 2, 4, 8   (C2)
         Σ_{r,k,s} k · x[r,p,k,s] ≤ size[p]                     (what waiting options may reserve)

``s`` is *now* or *wait*: a wait option starts when ``k`` primaries of one machine free up and is
discounted by β = 0.9; only *now* options are dispatched, and the program re-runs next tick. A late
*now* option is only offered once no degree can still make the deadline.

Departures from the printed program, each for a reason we could check:

* C2 per machine, aggregated. A run needs its ``k`` GPUs on one machine (§6.2); the paper's C2 only
  counts idle replicas per type, which lets the program pick degree-8 runs no machine can host while
  scattered idle GPUs wait. Because the degrees divide each other, the runs fit the machines exactly
  when, for every ``j``, the runs of degree ≥ ``j`` fit in the idle GPUs counted in whole blocks of
  ``j`` per machine (bin packing with divisible sizes: largest first, any machine with room, never
  fails then). That is four rows per type instead of a variable per machine, which keeps the
  relaxation tight and the program small (a per-machine copy of every option made HiGHS spend
  ~100 ms in root cuts at 128 GPUs).
* Wait options (our reading of the authors' single-machine program in Hetu-DiT, which schedules
  into future windows at the busy GPUs' release times) and no late start while an on-time one is
  still possible: without them a myopic program fills idle GPUs with late degree-2 runs of requests
  that a degree-8 run a few seconds later would have served on time (in the simulator: a third of
  the small requests missed their SLO that way).
* The on-time indicator ``y`` and its big-M link (C3a/C3b) are folded into the coefficient: an
  option's finish time is a constant of the tick, so ``y = x`` exactly when it finishes in time.

The reward follows the authors' code (``multi_machine_efficient_ilp``): 1000 on time, else
``100·(1 + lateness / T_best)`` capped at 1000 — a request that is already late gains weight as it
waits (aging, no starvation). On-time options gain up to 5 % for running closer to the best
latency (our addition: a tie-break towards lower latency). ``+k`` is their slack penalty on idle
GPUs; ``γ·comm`` (App. C.2 Eq. 3) is orders of magnitude below any reward and only breaks ties
towards less inter-stage traffic.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass

import numpy as np
from scipy.optimize import Bounds, LinearConstraint, milp
from scipy.sparse import coo_matrix

from .stage_profiles import DEGREES

ON_TIME_REWARD = 1000.0
LATE_BASE = 100.0
SPEED_BONUS = 50.0
WAIT_DISCOUNT = 0.9
IDLE_GPU_PENALTY = 1.0
COMM_PENALTY_PER_GB = 1.0
# Stop branch-and-bound within 0.5 % of the optimum: an on-time request is worth 1000, so with up to
# ~100 dispatches a tick the gap is below one of them. (No time limit: it would make the plans, and
# so the simulations, depend on the machine's speed.)
MIP_REL_GAP = 0.005


@dataclass(frozen=True)
class Candidate:
    """One variable: a request on ``pool`` (type, machine) at ``degree``, now or waiting for GPUs."""

    request: int
    pool: Hashable
    degree: int
    finish: float
    deadline: float
    best_run_s: float
    run_s: float
    transfer_bytes: float = 0.0
    now: bool = True

    @property
    def weight(self) -> float:
        return candidate_weight(self)


def completion_reward(finish: float, deadline: float, best_run_s: float, run_s: float) -> float:
    """App. C.2 Eq. 2 with the authors' constants, plus the speed bonus for on-time options."""
    if finish <= deadline:
        return ON_TIME_REWARD + SPEED_BONUS * min(1.0, best_run_s / max(run_s, 1e-9))
    lateness = (finish - deadline) / max(best_run_s, 1e-9)
    return min(ON_TIME_REWARD, LATE_BASE * (1 + lateness))


def candidate_weight(c: Candidate) -> float:
    reward = completion_reward(c.finish, c.deadline, c.best_run_s, c.run_s)
    value = reward - COMM_PENALTY_PER_GB * c.transfer_bytes / 1e9 + IDLE_GPU_PENALTY * c.degree
    return value if c.now else WAIT_DISCOUNT * value


def block_capacity(idle_per_machine: Sequence[int], degree: int) -> int:
    """GPUs usable by runs of degree >= ``degree``: each machine's idle count in whole blocks."""
    return degree * sum(count // degree for count in idle_per_machine)


def solve_dispatch(
    candidates: Sequence[Candidate], idle: dict[Hashable, Sequence[int]], size: dict[Hashable, int]
) -> list[int]:
    """Indices of the chosen *now* candidates (one option per request, within the pools' capacity).

    ``idle[pool]`` lists the idle primaries of that type per machine (C2); ``size[pool]`` bounds
    what now and waiting options reserve together."""
    blocks = {(pool, j): block_capacity(counts, j) for pool, counts in idle.items() for j in DEGREES}
    usable = [
        i
        for i, c in enumerate(candidates)
        if c.degree <= (blocks.get((c.pool, c.degree), 0) if c.now else size.get(c.pool, 0))
    ]
    if not usable:
        return []
    requests = sorted({candidates[i].request for i in usable})
    pools = sorted({candidates[i].pool for i in usable}, key=repr)
    request_row = {r: n for n, r in enumerate(requests)}
    block_row = {(p, j): len(requests) + n for n, (p, j) in enumerate((p, j) for p in pools for j in DEGREES)}
    size_row = {p: len(requests) + len(block_row) + n for n, p in enumerate(pools)}
    rows, cols, values = [], [], []
    for col, i in enumerate(usable):
        c = candidates[i]
        rows += [request_row[c.request], size_row[c.pool]]
        cols += [col, col]
        values += [1.0, float(c.degree)]
        if c.now:
            for j in DEGREES:
                if j <= c.degree:
                    rows.append(block_row[(c.pool, j)])
                    cols.append(col)
                    values.append(float(c.degree))
    shape = (len(requests) + len(block_row) + len(size_row), len(usable))
    matrix = coo_matrix((values, (rows, cols)), shape=shape).tocsr()
    upper = np.array(
        [1.0] * len(requests)
        + [float(blocks.get(key, 0)) for key in block_row]
        + [float(size.get(p, 0)) for p in pools]
    )
    objective = -np.array([candidates[i].weight for i in usable])
    result = milp(
        objective,
        constraints=LinearConstraint(matrix, -np.inf, upper),
        integrality=np.ones(len(usable)),
        bounds=Bounds(0, 1),
        options={"mip_rel_gap": MIP_REL_GAP},
    )
    if result.x is None:
        raise RuntimeError(f"HiGHS found no dispatch plan: {result.message}")
    return [usable[col] for col, value in enumerate(result.x) if value > 0.5 and candidates[usable[col]].now]


def assign_machines(degrees: Sequence[int], idle_per_machine: dict[int, int]) -> list[int]:
    """Machines for runs of the given degrees, largest first, each on the fullest machine with room
    (never fails when C2 holds; see the module docstring). Returns one machine per run, in order."""
    remaining = dict(idle_per_machine)
    placed: dict[int, int] = {}
    for index in sorted(range(len(degrees)), key=lambda i: -degrees[i]):
        fitting = [m for m, free in remaining.items() if free >= degrees[index]]
        if not fitting:
            raise ValueError(
                f"no machine has {degrees[index]} idle GPUs left: the capacity rows were violated"
            )
        machine = min(fitting, key=lambda m: (remaining[m], m))
        remaining[machine] -= degrees[index]
        placed[index] = machine
    return [placed[i] for i in range(len(degrees))]
