"""How the job dispatcher decides (pure Python: no Django, so a round solver can be plugged in).

Contract: ``JobPolicy.plan(job_round)`` gets one ``JobRound`` — every job in flight of the served pools
(queued, running, paused) and every worker that may hold jobs, with the room its resident stream
sessions leave — and returns a ``JobPlan``: jobs to assign (queued → a worker), to pause
(preempted at a step boundary, state kept in that worker's host memory), to resume (on the worker
that holds them) and to move (a paused job's state to another worker). It must be deterministic
and never plan more running jobs on a worker than its room. The dispatcher
(``scheduling.live.jobs``) checks every entry against the rows before it applies it.

Streams come first: a worker's room is its capacity K minus its resident sessions, and a pool whose
streams wait for a GPU gets no new job. The ``JOB_POLICY`` setting names the policy: ``edf``, ``genserve``
(``scheduling.core.jobs.genserve``: GenServe's round solver), ``tridentserve``
(``scheduling.core.jobs.tridentserve``: TridentServe's per-tick integer program over the workers'
stage roles) or a ``package.module:ClassName`` path.
"""

from __future__ import annotations

import pkgutil
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field


@dataclass(frozen=True)
class JobView:
    id: str
    model: str
    state: str  # queued | running | paused
    priority: int
    deadline: float  # unix seconds
    steps: int
    steps_done: int
    worker: str | None = None
    kind: str = "image"  # image | video
    width: int = 64
    height: int = 64
    frames: int = 1
    # A move of its state is under way: neither resumed nor moved again until it lands.
    moving: bool = False


@dataclass(frozen=True)
class WorkerView:
    name: str
    model: str
    # Job slots: capacity K minus resident stream sessions (0 for a draining worker); may go
    # negative when streams arrive on a worker whose slots jobs hold.
    room: int
    # Its stage role (EDC, ED, DC or D: the roles that hold jobs; docs/stages.md).
    role: str = "EDC"


@dataclass(frozen=True)
class JobRound:
    now: float
    jobs: list[JobView]
    workers: list[WorkerView]
    # Active stream sessions waiting for a GPU, per model: their pool takes no new job.
    streams_waiting: dict[str, int] = field(default_factory=dict)


@dataclass
class JobPlan:
    assign: list[tuple[str, str]] = field(default_factory=list)  # (job, worker)
    pause: list[str] = field(default_factory=list)
    resume: list[str] = field(default_factory=list)
    move: list[tuple[str, str]] = field(default_factory=list)  # (paused job, target worker)


class JobPolicy:
    """Base class: see the module's contract. ``job_profiles`` (the ``JOB_PROFILES`` setting): job cost
    profiles, names or JSON paths, for the policies that cost steps (``genserve``)."""

    def __init__(self, *, job_profiles: Sequence[str] = ()) -> None:
        pass

    def plan(self, job_round: JobRound) -> JobPlan:
        raise NotImplementedError


def dispatch_order(job: JobView) -> tuple:
    """Higher priority first, then earliest deadline (EDF), then the id for determinism."""
    return (-job.priority, job.deadline, job.id)


class EdfJobPolicy(JobPolicy):
    """Earliest deadline first within priority, streams first.

    1. A worker over its room (streams arrived) pauses its running jobs with the most slack first
       (latest deadline, lowest priority) until it fits: the stream never waits for a job.
    2. Then paused and queued jobs in dispatch order take the room left: a paused job resumes on its
       worker if it has room, else moves to the worker of its pool with the most room (and resumes
       there next round, once its state has landed); a queued image joins a worker running images of
       its size (`batch_worker`: the worker's engine batches them), any other queued job goes to the
       worker of its pool with the most room — unless that pool's streams are waiting.
    """

    def plan(self, job_round: JobRound) -> JobPlan:
        plan = JobPlan()
        room = {w.name: w.room for w in job_round.workers}
        pools: dict[str, list[str]] = {}
        for w in sorted(job_round.workers, key=lambda w: w.name):
            pools.setdefault(w.model, []).append(w.name)
        running = [j for j in job_round.jobs if j.state == "running" and j.worker in room]
        for job in self._preempted(running, room):
            plan.pause.append(job.id)
            room[job.worker] += 1
        preempted = set(plan.pause)
        batches = image_batches(job_round.jobs, exclude=preempted)
        waiting = [
            j
            for j in job_round.jobs
            if (j.state == "paused" and not j.moving and j.worker in room) or j.state == "queued"
        ]
        for job in sorted(waiting, key=dispatch_order):
            if job.id in preempted:
                continue
            if job.state == "paused" and room[job.worker] >= 1:
                plan.resume.append(job.id)
                room[job.worker] -= 1
                continue
            if job.state == "queued" and job_round.streams_waiting.get(job.model, 0) > 0:
                continue
            target = batch_worker(job, batches, room) if job.state == "queued" else None
            target = target or roomiest(pools.get(job.model, []), room, exclude=job.worker)
            if target is None:
                continue
            room[target] -= 1
            (plan.move if job.state == "paused" else plan.assign).append((job.id, target))
            note_image(job, target, batches)
        return plan

    @staticmethod
    def _preempted(running: list[JobView], room: dict[str, int]) -> list[JobView]:
        out = []
        for worker, deficit in room.items():
            if deficit >= 0:
                continue
            mine = sorted((j for j in running if j.worker == worker), key=dispatch_order, reverse=True)
            out.extend(mine[:-deficit])
        return out


def roomiest(workers: list[str], room: dict[str, int], exclude: str | None) -> str | None:
    """The worker (of ``workers``, sorted by name: ties go to the first) with the most room ≥ 1."""
    best = None
    for worker in workers:
        if worker != exclude and room[worker] >= 1 and (best is None or room[worker] > room[best]):
            best = worker
    return best


ImageShape = tuple[str, int, int]  # (model, width, height): images a worker's engine batches together
# Per image shape, the images each worker runs (or was given this round), workers in name order.
ImageBatches = dict[ImageShape, dict[str, list[JobView]]]


def image_batches(jobs: list[JobView], *, exclude: set[str] = frozenset()) -> ImageBatches:
    """The running images of each shape by worker, the ``exclude``d jobs left out."""
    batches: ImageBatches = {}
    for job in sorted(jobs, key=lambda j: (j.worker or "", j.id)):
        if job.kind == "image" and job.state == "running" and job.worker and job.id not in exclude:
            note_image(job, job.worker, batches)
    return batches


def note_image(job: JobView, worker: str, batches: ImageBatches) -> None:
    if job.kind == "image":
        batches.setdefault((job.model, job.width, job.height), {}).setdefault(worker, []).append(job)


def batch_worker(
    job: JobView,
    batches: ImageBatches,
    room: dict[str, int],
    fits: Callable[[JobView, list[JobView]], bool] | None = None,
) -> str | None:
    """A worker with room that already runs images of ``job``'s model and size, for a queued image
    (``fits(job, members)``, when given, must also accept joining that worker's batch).

    The worker's engine batches the images of one size it holds into one step while the batch still
    meets its earliest member's deadline (``workers.runtime.jobs.plan_job_batch``; GenServe §4), so
    an image there costs a fraction of a step, where on another worker it would take turns with that
    worker's video or images of another size. Without such a worker: the roomiest (``roomiest``).
    """
    if job.kind != "image":
        return None
    for worker, members in batches.get((job.model, job.width, job.height), {}).items():
        if room.get(worker, 0) >= 1 and (fits is None or fits(job, members)):
            return worker
    return None


BUILTIN_JOB_POLICIES = {
    "edf": "scheduling.core.jobs.policy:EdfJobPolicy",
    "genserve": "scheduling.core.jobs.genserve:GenServeJobPolicy",
    "tridentserve": "scheduling.core.jobs.tridentserve:TridentServeJobPolicy",
}


def load_job_policy(name: str, *, job_profiles: Sequence[str] = ()) -> JobPolicy:
    """A built-in name (``edf``, ``genserve``, ``tridentserve``) or a ``package.module:ClassName`` path to a ``JobPolicy`` subclass
    (the syntax of every pluggable part) → an instance; ValueError naming ``JOB_POLICY`` otherwise."""
    path = BUILTIN_JOB_POLICIES.get(name, name)
    if ":" not in path:
        raise ValueError(
            f"JOB_POLICY={name!r}: use one of {', '.join(BUILTIN_JOB_POLICIES)} or package.module:ClassName"
        )
    try:
        policy_class = pkgutil.resolve_name(path)
    except (ImportError, AttributeError, ValueError) as exc:
        raise ValueError(f"JOB_POLICY={name!r} does not resolve: {exc}") from exc
    if not (isinstance(policy_class, type) and issubclass(policy_class, JobPolicy)):
        raise ValueError(f"JOB_POLICY={name!r} is not a JobPolicy subclass")
    try:
        return policy_class(job_profiles=tuple(job_profiles))
    except ValueError as exc:  # a job profile that does not load (JobProfileError)
        raise ValueError(f"JOB_PROFILES={list(job_profiles)!r}: {exc}") from exc
