"""The autoscaler's job demand: the GPUs the open jobs' backlog needs to meet its deadlines.

One rule, applied by the decision pipeline's job step (``scheduling.core.pipeline.add_job_demand``)
for the live loop (the jobs its workers hold, costed by ``JobCosts``) and the simulator
(``scheduling.sim.jobs.cosim.JobSide.demand``): the EDF density
of the backlog, max over jobs i in deadline order of (Σ_{j ≤ i} remaining GPU-seconds at SP 1) /
max(D_i − now, job i's own remaining time) — a job already late counts as one GPU for its remaining
time.
"""

from __future__ import annotations

from collections.abc import Iterable


def backlog_gpus(open_jobs: Iterable[tuple[float, str, float]], now: float) -> float:
    """GPUs the open jobs' backlog needs to meet its deadlines (the autoscaler's job demand): over
    the jobs ``(deadline, id, remaining seconds on one GPU)`` in deadline order, the largest ratio of
    the work due by a deadline to the time left until it (at least the job's own remaining time)."""
    work = 0.0
    demand = 0.0
    for deadline, _id, remaining in sorted(open_jobs):
        work += remaining
        demand = max(demand, work / max(deadline - now, remaining))
    return demand
