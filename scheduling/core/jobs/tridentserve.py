"""``JOB_POLICY=tridentserve``: TridentServe's per-tick dispatch (§6.2, App. C.2) behind the live
dispatcher's policy contract (``scheduling.core.jobs.policy``). Pure Python, like the contract.

Each dispatch round:

1. *Streams first*, as ``edf``: a worker over its room pauses its running jobs with the most slack
   (latest deadline, lowest priority) until it fits; then paused jobs resume on their worker when it
   has room (else move to the roomiest worker of their pool, as ``edf``).
2. *The integer program* (``scheduling.core.stages.dispatch.solve_dispatch``, HiGHS ``milp``) over the
   queued jobs × the pool's worker roles: a pool is one (model, role) — EDC, ED, DC or D, the roles
   that hold jobs — with the workers' room as its idle slots (one "machine" per worker), every option
   at degree 1 (the live platform runs a job on one worker) and *now* (no wait options: the program
   re-runs every round). An option's finish time is now + the job's remaining time from the job
   profiles (``JobCosts``, as ``genserve``); its reward is the simulator's: on-time completion, the
   aging reward of a late job, and the inter-stage hand-offs of its role (``γ·comm``: a role without
   E receives the prompt's embeddings, one without C sends the final latents) as the tie-break
   towards the fewest hand-offs. A pool whose streams wait for a GPU starts no new job.
3. *Placement* within the chosen pool: a queued image joins a worker of that role running images of
   its size (``batch_worker``), anything else goes to the pool's roomiest worker. The dispatcher
   sends the assignment through its usual path (``job_run`` with the worker's ``encoder`` /
   ``decoder``).

Priorities are not part of TridentServe's objective: this policy orders by deadlines alone.
"""

from __future__ import annotations

from collections.abc import Sequence

from scheduling.core.jobs.genserve import JobCosts
from scheduling.core.jobs.policy import (
    EdfJobPolicy,
    JobPlan,
    JobRound,
    JobView,
    batch_worker,
    image_batches,
    note_image,
    roomiest,
)
from scheduling.core.stages.dispatch import Candidate, solve_dispatch

# The stage roles a job can run on (docs/stages.md, "Live placement").
JOB_ROLES = ("EDC", "ED", "DC", "D")
# Bytes per latent element handed between stages (fp32) and latent channels: the comm term's scale.
LATENT_BYTES = 16 * 4
# Prompt embeddings a role without E receives: text length × hidden size × bf16 (UMT5-XXL).
EMBEDDING_BYTES = 512 * 4096 * 2


def handoff_bytes(job: JobView, role: str) -> float:
    """The inter-stage traffic of ``job`` on ``role`` (Table 3 "Comm."): the embeddings when the role
    lacks E, the final latents (8× spatial, 4× temporal compression) when it lacks C."""
    latents = (job.width // 8) * (job.height // 8) * ((job.frames - 1) // 4 + 1) * LATENT_BYTES
    return (EMBEDDING_BYTES if "E" not in role else 0.0) + (latents if "C" not in role else 0.0)


class TridentServeJobPolicy(EdfJobPolicy):
    """See the module docstring."""

    def __init__(self, *, job_profiles: Sequence[str] = ()) -> None:
        self.costs = JobCosts(job_profiles)

    def plan(self, job_round: JobRound) -> JobPlan:
        # Streams first, then paused jobs: ``edf``'s round with no queued job in it.
        held = [j for j in job_round.jobs if j.state != "queued"]
        plan = super().plan(JobRound(job_round.now, held, job_round.workers, job_round.streams_waiting))
        room = {w.name: w.room for w in job_round.workers}
        for job_id in plan.pause:
            worker = next(j.worker for j in held if j.id == job_id)
            room[worker] += 1
        by_id = {j.id: j for j in held}
        for job_id in plan.resume:
            room[by_id[job_id].worker] -= 1
        for _, target in plan.move:
            room[target] -= 1
        queued = [
            j
            for j in job_round.jobs
            if j.state == "queued" and job_round.streams_waiting.get(j.model, 0) == 0
        ]
        chosen = self.solve(job_round.now, queued, job_round, room)
        batches = image_batches(job_round.jobs, exclude=set(plan.pause))
        pools: dict[tuple[str, str], list[str]] = {}
        for w in sorted(job_round.workers, key=lambda w: w.name):
            pools.setdefault((w.model, w.role), []).append(w.name)
        for job, pool in chosen:
            members = pools[pool]
            pool_room = {name: room[name] for name in members}
            target = batch_worker(job, batches, pool_room) or roomiest(members, room, exclude=None)
            if target is None:
                continue
            room[target] -= 1
            plan.assign.append((job.id, target))
            note_image(job, target, batches)
        return plan

    def solve(
        self, now: float, queued: list[JobView], job_round: JobRound, room: dict[str, int]
    ) -> list[tuple[JobView, tuple[str, str]]]:
        """The integer program's choice: (job, (model, role)) for every queued job it starts now, in
        deadline order."""
        idle: dict[tuple[str, str], list[int]] = {}
        for w in job_round.workers:
            if w.role in JOB_ROLES and room[w.name] > 0:
                idle.setdefault((w.model, w.role), []).append(room[w.name])
        if not queued or not idle:
            return []
        candidates: list[Candidate] = []
        jobs: list[JobView] = []
        for index, job in enumerate(sorted(queued, key=lambda j: (j.deadline, j.id))):
            jobs.append(job)
            run_s = self.costs.remaining_s(job)
            for pool in sorted(idle):
                if pool[0] != job.model:
                    continue
                candidates.append(
                    Candidate(
                        request=index,
                        pool=pool,
                        degree=1,
                        finish=now + run_s,
                        deadline=job.deadline,
                        best_run_s=run_s,
                        run_s=run_s,
                        transfer_bytes=handoff_bytes(job, pool[1]),
                    )
                )
        size = {pool: sum(counts) for pool, counts in idle.items()}
        picked = solve_dispatch(candidates, idle, size)
        return sorted(
            ((jobs[candidates[i].request], candidates[i].pool) for i in picked),
            key=lambda item: (item[0].deadline, item[0].id),
        )
