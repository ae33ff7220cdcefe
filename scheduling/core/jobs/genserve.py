"""``JOB_POLICY=genserve``: GenServe's round solver (Alg. 1, ``scheduling.core.jobs.solver``) behind
the live dispatcher's policy contract (``scheduling.core.jobs.policy``). Pure Python, like the contract.

Each dispatch is one round, solved per pool (the workers serving one model):

1. *Streams first.* A worker over its room (streams arrived) pauses its running jobs with the most
   slack first until it fits — slack = deadline − now − remaining steps × step time (GenServe §4.2:
   preempt the video with the most slack), where EDF would pause the latest deadline.
2. *Alg. 1 on the pool.* The pool's job slots (the room left on its workers plus the slots its
   running videos hold; running images are not counted: an image runs to its end) are the solver's
   GPUs. Videos — running (degree 1), paused or queued (degree 0) — get a run and a pause option;
   queued images form EDF batches; the grouped knapsack by DP picks which videos run and which
   images start, so a running video with enough slack is paused for images that would otherwise miss
   their deadline, and a paused one resumes when its slack tightens or slots free up.
3. *Placement.* A video to run resumes on its worker if that worker has room, else moves to the
   pool's worker with the most room (resumed there once its state has landed, as with ``edf``); a
   queued image joins a worker running images of its size (``batch_worker``) when the batch's step
   time from the profile still meets every member's deadline, any other queued job goes to the
   worker with the most room. Never more running jobs than a worker's room.

What the live platform cannot do is left out of the solver's input: every option is SP degree 1 (one
job per slot, no sequence parallelism across workers) and image batches have one member (the
worker's engine batches the images it holds by resolution on its own). A pool whose streams wait for
a GPU starts no new job. Priorities are not part of GenServe's objective: this policy orders by
deadlines and slack alone (use ``edf`` where priorities must win).

Step costs come from the job profiles the simulator uses (``scheduling.core.jobs.job_profiles``: the
built-in SD3.5 and Wan2.2 profiles, plus the ``JOB_PROFILES`` setting's names or JSON paths — e.g.
what ``profile_model --one-shot`` wrote). A job whose model has a profile of its kind is costed by
it; any other (the platform's own presets) by its kind's default profile, at its own resolution and
frames (the profile's nearest-shape rule). The round length Δ is ``ROUND_STEPS`` steps of the
longest video step in the round.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from scheduling.core.jobs.job_profiles import JobCatalog, JobProfile, load_job_catalog
from scheduling.core.jobs.policy import (
    JobPlan,
    JobPolicy,
    JobRound,
    JobView,
    batch_worker,
    image_batches,
    note_image,
    roomiest,
)
from scheduling.core.jobs.solver import ImageRequest, RoundInput, VideoRequest, round_solver

# Δ: a round covers this many denoising steps (the simulator's default ``round_steps``).
ROUND_STEPS = 5


class JobCosts:
    """Job step costs from the simulator's job profiles plus ``job_profiles`` (module docstring);
    also the live autoscaler's (``scheduling.live.jobs.jobs_backlog``)."""

    def __init__(self, job_profiles: Sequence[str] = ()) -> None:
        self.catalog: JobCatalog = load_job_catalog(job_profiles)

    def profile(self, job: JobView) -> JobProfile:
        own = self.catalog.profiles.get(job.model)
        return own if own is not None and own.kind == job.kind else self.catalog.profile(job.kind, None)

    def step_s(self, job: JobView) -> float:
        return self.profile(job).step_ms(job.width, job.height, job.frames) / 1000.0

    def remaining_s(self, job: JobView) -> float:
        """Time to finish on one slot: the steps left plus the decode (the profile's fraction)."""
        profile = self.profile(job)
        decode = profile.decode_ms(job.width, job.height, job.frames, job.steps) / 1000.0
        return (job.steps - job.steps_done) * self.step_s(job) + decode


class GenServeJobPolicy(JobPolicy):
    """See the module docstring."""

    def __init__(self, *, job_profiles: Sequence[str] = ()) -> None:
        self.costs = JobCosts(job_profiles)
        self.solver = round_solver("genserve")

    def slack(self, job: JobView, now: float) -> float:
        return job.deadline - now - self.costs.remaining_s(job)

    def batch_meets(self, now: float) -> Callable[[JobView, list[JobView]], bool]:
        """Whether ``job`` joining a worker's images ``members`` of its size keeps the batch within
        every member's deadline: the most steps left × the profile's step at the batch's size (+
        decode), by the earliest deadline — the worker engine's batching rule, costed here."""

        def meets(job: JobView, members: list[JobView]) -> bool:
            batch = [*members, job]
            profile = self.costs.profile(job)
            step = profile.step_ms(job.width, job.height, 1, batch=len(batch)) / 1000.0
            steps_left = max(j.steps - j.steps_done for j in batch)
            decode = profile.decode_ms(job.width, job.height, 1, job.steps) / 1000.0
            return now + steps_left * step + decode <= min(j.deadline for j in batch)

        return meets

    def plan(self, job_round: JobRound) -> JobPlan:
        plan = JobPlan()
        room = {w.name: w.room for w in job_round.workers}
        running = [j for j in job_round.jobs if j.state == "running" and j.worker in room]
        for worker, deficit in list(room.items()):
            if deficit >= 0:
                continue
            mine = sorted(
                (j for j in running if j.worker == worker),
                key=lambda j: (-self.slack(j, job_round.now), j.id),
            )
            for job in mine[:-deficit]:
                plan.pause.append(job.id)
                room[worker] += 1
        pools: dict[str, list[str]] = {}
        for w in sorted(job_round.workers, key=lambda w: w.name):
            pools.setdefault(w.model, []).append(w.name)
        for model, workers in pools.items():
            jobs = [j for j in job_round.jobs if j.model == model and j.id not in plan.pause]
            self._pool(job_round, jobs, workers, room, plan)
        return plan

    def _pool(
        self,
        job_round: JobRound,
        jobs: list[JobView],
        workers: list[str],
        room: dict[str, int],
        plan: JobPlan,
    ) -> None:
        now = job_round.now
        starts = job_round.streams_waiting.get(jobs[0].model, 0) == 0 if jobs else False
        videos = [
            j
            for j in jobs
            if j.kind == "video"
            and (
                (j.state == "running" and j.worker in room)
                or (j.state == "paused" and not j.moving and j.worker in room)
                or (j.state == "queued" and starts)
            )
        ]
        images = [j for j in jobs if j.kind == "image" and j.state == "queued" and starts]
        paused_images = [j for j in jobs if j.kind == "image" and j.state == "paused" and not j.moving]
        held = sum(1 for v in videos if v.state == "running")
        gpus = held + sum(max(room[w], 0) for w in workers)
        if gpus == 0 or not (videos or images or paused_images):
            return
        longest = max((self.costs.step_s(v) for v in videos), default=0.0)
        round_input = RoundInput(
            now=now,
            gpus=gpus,
            round_s=ROUND_STEPS * longest,
            images=tuple(
                ImageRequest(j.id, (j.id,), j.deadline, j.deadline, (self.costs.remaining_s(j),))
                for j in images
            ),
            videos=tuple(
                VideoRequest(
                    v.id,
                    v.deadline,
                    v.deadline,
                    1 if v.state == "running" else 0,
                    {1: self.costs.remaining_s(v)},
                )
                for v in videos
            ),
        )
        solution = self.solver.plan(round_input)
        by_id = {j.id: j for j in jobs}
        for video in videos:  # the solver pauses these: their slots go to the images it starts
            if video.state == "running" and solution.degrees[video.id] == 0:
                plan.pause.append(video.id)
                room[video.worker] += 1
        # Paused images resume first (an image is never paused by this solver, only by streams).
        to_run = sorted(paused_images, key=lambda j: (j.deadline, j.id))
        to_run += sorted(
            (v for v in videos if v.state != "running" and solution.degrees[v.id] > 0),
            key=lambda j: (self.slack(j, now), j.id),
        )
        to_run += [by_id[i] for batch in solution.batches for i in batch.ids]
        batches = image_batches(jobs, exclude=set(plan.pause))
        for job in to_run:
            if job.state == "paused" and room.get(job.worker, 0) >= 1:
                plan.resume.append(job.id)
                room[job.worker] -= 1
                continue
            target = (
                batch_worker(job, batches, room, self.batch_meets(now)) if job.state == "queued" else None
            )
            target = target or roomiest(workers, room, exclude=job.worker)
            if target is None:
                continue
            room[target] -= 1
            (plan.move if job.state == "paused" else plan.assign).append((job.id, target))
            note_image(job, target, batches)
