"""One-shot jobs co-simulated with the streams on the same GPU pool (issue 14).

The stream simulator (``scheduling/sim/simulator.py``) owns the pool and the streams; it calls this
module (:class:`JobSide`) on job events, on its own timers and after every stream decision. Rules:

* **Streams first.** The round solver's plans run on *ready GPUs with no resident session*: GPUs
  the stream policy left empty, including those whose sessions it suspended. A GPU released (or
  failed) under a job loses the step in flight; the job goes back to the queue.
* **Beside the streams** (issue 32, :meth:`JobSide.fill_beside`). When the streams are paced
  (``SimConfig.stream_period_ms``), a GPU with resident sessions is idle between two of its steps;
  a waiting job steps there (SP 1, images of one shape batched) when its step fits the slack the
  streams leave — ``contracts.coserve.stream_slack_s`` of the GPU's stream demands
  (``Simulator.stream_demands``: the next step's start and generation time) and
  ``contracts.coserve.job_step_fits``, the rule the live worker runs. The most urgent job that
  fits goes first (earliest deadline, then arrival), as on the worker (``workers.runtime.jobs``).
  Step times are exact here, so a step beside streams never delays a chunk; a session placed on
  the GPU meanwhile abandons it at its next block boundary (`claim`). One step at a time: after it
  the job is waiting again, for a round or the next gap. A video's decode, which has no block
  boundary (a claim would wait for its end), runs only on a GPU without streams.
* **Abandoning a step for streams** (`JobSide.claim`, as the worker does: docs/jobs.md). A session
  placed on a GPU whose job step is in flight does not wait for the step's end: the step is
  abandoned at its next transformer-block boundary, ``min(remaining, step_time / blocks)`` from
  now, with ``blocks`` from the job's profile (``JobProfile.blocks``: 30 for Wan2.2-5B, 24 for
  SD3.5-Medium; 1 — only the step's end — for a profile that does not say). The session's first
  chunk waits that long (the stall is added to the chunk, so any chunk pushed over its SLO by a job
  is counted); the step's work is lost on every GPU of the allocation (the job redoes the step
  later: it goes back to the queue at the step boundary before), and the allocation's other GPUs
  are busy until the same boundary. With ``JobConfig.abandon_steps`` off, the session waits for
  the step's end instead and the job keeps the step.
* **Steps.** Every job advances one denoising step at a time; a video at SP degree p takes the
  profile's step time at p; an image batch of b takes the batch step time. Pause, resume and SP
  changes take effect at step boundaries (slides Table 7: pause µs, resume < 0.12 % of a step —
  not charged). After its last step a video decodes on one GPU (``decode_fraction``).
* **Rounds.** A policy round (``scheduling.core.jobs.solver``) runs on every job submit or cancel,
  every time an allocation ends (a batch or video finishes, pauses, is evicted), every Δ steps of a
  running video, and after a stream decision that changed the GPUs jobs may use. A plan starts what fits on
  GPUs free now; GPUs a pausing or shrinking video gives back are free at its step end, which
  triggers the next round.
* **Demand for the autoscaler** (:meth:`JobSide.demand`, the decision pipeline's job step
  ``scheduling.core.pipeline.add_job_demand``, the one the live loop runs): the EDF density of the
  backlog, max over jobs i in deadline order of (Σ_{j ≤ i} remaining GPU-seconds at SP 1) /
  max(D_i − now, job i's own remaining time) — the GPUs needed to finish every job by its deadline, a
  job already late counting as one GPU for its remaining time (``scheduling.core.jobs.backlog``).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from contracts.coserve import job_step_fits, stream_slack_s
from scheduling.core.jobs.job_profiles import JobCatalog, JobProfile, load_job_catalog
from scheduling.core.jobs.solver import ImageRequest, RoundInput, RoundSolver, VideoRequest, round_solver
from scheduling.core.pipeline import JobDemand

from ..traces import JobEvent


@dataclass(frozen=True)
class JobConfig:
    solver: RoundSolver
    catalog: JobCatalog = field(default_factory=load_job_catalog)
    round_steps: int = 5  # Δ: a running video triggers a round every Δ of its steps
    abandon_steps: bool = True  # a session's claim abandons the job step in flight (`JobSide.claim`)


def job_config(
    policy: str, profiles: tuple[str, ...] = (), round_steps: int = 5, abandon_steps: bool = True
) -> JobConfig:
    return JobConfig(round_solver(policy), load_job_catalog(profiles), round_steps, abandon_steps)


class _Job:
    __slots__ = (
        "arrival",
        "batch_step",
        "deadline",
        "decode",
        "degree",
        "done_at",
        "frames",
        "height",
        "id",
        "kind",
        "profile",
        "remaining",
        "sp_step",
        "started_at",
        "state",
        "steps",
        "width",
    )

    def __init__(self, event: JobEvent, profile: JobProfile, max_batch: int):
        self.id = event.job
        self.kind = event.kind
        self.profile = profile
        self.width, self.height = event.width or 1, event.height or 1
        self.frames = event.frames or 1
        self.steps = event.steps or 1
        self.remaining = self.steps
        self.arrival = event.t
        self.deadline = event.deadline
        self.state = "waiting"  # waiting | running | done | cancelled
        self.degree = 0
        self.started_at: float | None = None
        self.done_at: float | None = None
        # Step times by SP degree (videos) and by batch size (images), costed once per job.
        shape = (self.width, self.height, self.frames)
        self.sp_step = {d: profile.step_ms(*shape, sp=d) / 1000.0 for d in profile.degrees(*shape)}
        self.batch_step = (
            tuple(profile.step_ms(*shape, batch=b) / 1000.0 for b in range(1, max_batch + 1))
            if self.kind == "image"
            else ()
        )
        self.decode = profile.decode_ms(*shape, self.steps) / 1000.0 if self.kind == "video" else 0.0

    def step_s(self, batch: int = 1, sp: int = 1) -> float:
        return self.batch_step[batch - 1] if batch > 1 else self.sp_step[sp]

    def remaining_s(self, sp: int = 1) -> float:
        return self.remaining * self.sp_step[sp] + self.decode


class _Allocation:
    """GPUs running one video or one image batch; ``epoch`` invalidates timers of a stopped one."""

    __slots__ = (
        "beside",
        "decoding",
        "epoch",
        "gpus",
        "jobs",
        "step_end",
        "step_start",
        "steps_run",
        "target",
    )

    def __init__(self, jobs: list[_Job], gpus: list[str], epoch: int, beside: bool = False):
        self.beside = beside  # one step on a GPU with streams, in the slack they leave
        self.jobs = jobs
        self.gpus = gpus
        self.epoch = epoch
        self.step_start = 0.0
        self.step_end = 0.0
        self.steps_run = 0
        self.target: int | None = None  # a video's degree from the last plan, applied at a step end
        self.decoding = False


def image_request(job: _Job, max_batch: int) -> ImageRequest:
    return ImageRequest(
        job.id,
        (job.profile.model, job.width, job.height, job.remaining),
        job.deadline,
        job.arrival,
        tuple(job.remaining * step for step in job.batch_step[:max_batch]),
    )


def video_request(job: _Job, degree: int, gpus: int) -> VideoRequest:
    return VideoRequest(
        job.id,
        job.deadline,
        job.arrival,
        degree,
        {d: job.remaining_s(d) for d in job.sp_step if d <= max(gpus, 1)},
    )


class JobSide:
    """The job half of a co-simulation; ``host`` is the stream :class:`Simulator`."""

    def __init__(self, host: Any, config: JobConfig, schedule: Callable[[float, tuple], None]):
        self.host = host
        self.cfg = config
        self.solver = config.solver
        self.schedule = schedule  # push a timer (time, payload) into the host's event heap
        self.jobs: dict[str, _Job] = {}
        self.allocations: dict[str, _Allocation] = {}  # key: video id or "batch:<n>"
        self.gpu_owner: dict[str, str] = {}
        self.epoch = 0
        self.batches = 0
        self.usable_signature: frozenset[str] = frozenset()
        self.round_ms: list[float] = []
        self.cancelled = 0
        # A GPU whose abandoned step still runs to its block boundary: busy until then.
        self.busy_until: dict[str, float] = {}
        self.abandoned_steps = 0
        self.abandoned_gpu_s = 0.0  # job work lost to abandoned steps (GPU-seconds)
        self.beside_steps = 0  # steps (decodes included) run beside streams, in their slack
        self.beside_gpu_s = 0.0

    # -- the GPUs jobs may use ----------------------------------------------------------------------
    def _usable(self) -> set[str]:
        return {gid for gid, g in self.host.gpus.items() if g.status == "ready" and not g.members}

    def blocking_ms(self, gid: str) -> float:
        """How long a session placed on ``gid`` now would wait for the job step in flight there
        (for its end: what `claim` waits without abandoning)."""
        now = self.host.now
        busy = max(0.0, self.busy_until.get(gid, now) - now)
        key = self.gpu_owner.get(gid)
        if key is None:
            return busy * 1000.0
        return max(busy, self.allocations[key].step_end - now) * 1000.0

    def claim(self, gid: str) -> float:
        """A session is placed on ``gid`` now: the milliseconds its first chunk waits for the GPU.
        A job step in flight there is abandoned at its next block boundary (module docstring);
        without ``abandon_steps`` the session waits for the step's end."""
        key = self.gpu_owner.get(gid)
        alloc = self.allocations.get(key) if key is not None else None
        if alloc is None or alloc.decoding or not self.cfg.abandon_steps:
            return self.blocking_ms(gid)
        now = self.host.now
        duration = alloc.step_end - alloc.step_start
        if now < alloc.step_start:  # the step waits for an earlier abandoned one: nothing to lose
            free_at = max(now, self.busy_until.get(gid, now))
        else:
            block = duration / max(1, alloc.jobs[0].profile.blocks)
            free_at = min(alloc.step_end, now + block)
            self.abandoned_steps += 1
            self.abandoned_gpu_s += (free_at - alloc.step_start) * len(alloc.gpus)
        for other in alloc.gpus:
            self.busy_until[other] = max(self.busy_until.get(other, now), free_at)
        self._requeue(key)  # the jobs stay at the step boundary before: the step is redone
        return max(0.0, free_at - now) * 1000.0

    # -- events from the host ---------------------------------------------------------------------
    def on_trace(self, event: JobEvent) -> None:
        if event.event == "submit":
            profile = self.cfg.catalog.profile(event.kind or "", event.model)
            self.jobs[event.job] = _Job(event, profile, self.solver.max_batch)
        else:
            job = self.jobs.get(event.job)
            if job is None or job.state in ("done", "cancelled"):
                return
            for key, alloc in list(self.allocations.items()):
                if job in alloc.jobs:
                    alloc.jobs.remove(job)
                    if not alloc.jobs:
                        self._stop(key)
            job.state = "cancelled"
            self.cancelled += 1
        self._round()

    def after_decision(self) -> None:
        """The stream policy acted: drop allocations on GPUs that are gone; re-plan if the usable
        set changed (a GPU freed by the streams, or taken by them)."""
        lost = [k for k, a in self.allocations.items() if any(g not in self.host.gpus for g in a.gpus)]
        for key in lost:
            self._requeue(key)
        usable = frozenset(self._usable())
        if lost or usable != self.usable_signature:
            self.usable_signature = usable
            self._round()
        else:
            self._fill_all()

    def on_timer(self, payload: tuple) -> None:
        _, key, epoch = payload
        alloc = self.allocations.get(key)
        if alloc is None or alloc.epoch != epoch:
            return  # a stopped allocation's step
        now = self.host.now
        if alloc.decoding:
            self._finish(key, now)  # its round fills this GPU's gap too when it was beside streams
            return
        if alloc.beside:
            self._end_beside(key, alloc)
            return
        for job in alloc.jobs:
            job.remaining -= 1
        alloc.steps_run += 1
        lead = alloc.jobs[0]
        if lead.remaining == 0:
            if lead.decode > 0:
                self._release_gpus(alloc, keep=1)
                alloc.decoding = True
                alloc.step_end = now + lead.decode
                self.schedule(alloc.step_end, ("job", key, alloc.epoch))
                self._round()
            else:
                self._finish(key, now)
            return
        usable = self._usable()
        if any(g not in usable for g in alloc.gpus):
            self._requeue(key)  # a session took one of its GPUs: stop at this boundary
            self._round()
            return
        if lead.kind == "video" and alloc.target is not None and alloc.target < lead.degree:
            self._resize(key, alloc, alloc.target)  # pause or downgrade: give the GPUs back now
            self._round()
            return
        if lead.kind == "video" and alloc.target is not None:
            # Upgrade: re-plan first so that waiting work starts on the free GPUs before this video
            # grows into what is left (the round refreshes its target).
            self._round()
            if self.allocations.get(key) is alloc:
                self._resize(key, alloc, lead.degree if alloc.target is None else alloc.target)
                if key not in self.allocations:
                    self._round()
            return
        self._start_step(key, alloc)
        if lead.kind == "video" and alloc.steps_run % self.cfg.round_steps == 0:
            self._round()

    # -- beside the streams ---------------------------------------------------------------------
    def fill_beside(self, gid: str) -> bool:
        """``gid`` has resident sessions and is between two of their steps: start the most urgent
        waiting job's step there if it fits the slack the streams leave (``contracts.coserve``, as
        on the worker). Returns whether a step started."""
        g = self.host.gpus.get(gid)
        now = self.host.now
        if (
            g is None
            or not g.members
            or g.busy
            or g.status not in ("ready", "draining")
            or gid in self.gpu_owner
            or self.busy_until.get(gid, now) > now
        ):
            return False
        slack_s = stream_slack_s(self.host.stream_demands(gid), now=now)
        waiting = sorted(
            (j for j in self.jobs.values() if j.state == "waiting"),
            key=lambda j: (j.deadline, j.arrival, j.id),
        )
        for lead in waiting:
            # A decode has no block boundary to stop at: a session claiming the GPU would wait for
            # its end, so it runs only on a GPU without streams (a round's plan).
            if lead.remaining == 0 or not job_step_fits(lead.step_s(), slack_s):
                continue
            batch = [lead]
            if lead.kind == "image":
                for other in waiting:
                    if len(batch) >= self.solver.max_batch:
                        break
                    if other is lead or (other.profile, other.width, other.height) != (
                        lead.profile,
                        lead.width,
                        lead.height,
                    ):
                        continue
                    if not job_step_fits(lead.step_s(batch=len(batch) + 1), slack_s):
                        break
                    batch.append(other)
            self.batches += 1
            self._open(f"beside:{self.batches}", batch, [gid], beside=True)
            alloc = self.allocations[f"beside:{self.batches}"]
            self.beside_steps += 1
            self.beside_gpu_s += alloc.step_end - alloc.step_start
            return True
        return False

    def beside_on(self, gid: str) -> bool:
        """Whether a job step runs beside the streams of ``gid`` now."""
        key = self.gpu_owner.get(gid)
        return key is not None and self.allocations[key].beside

    def _fill_all(self) -> None:
        for gid in sorted(self.host.gpus):
            self.fill_beside(gid)

    def _end_beside(self, key: str, alloc: _Allocation) -> None:
        """A step beside streams ended: the jobs advance and wait again (for a round, or the next
        gap: this GPU's first, right now)."""
        for job in alloc.jobs:
            job.remaining -= 1
        lead = alloc.jobs[0]
        gid = alloc.gpus[0]
        if lead.remaining == 0 and lead.decode == 0:
            self._finish(key, self.host.now)
        else:
            self._requeue(key)
            if self._free(self._usable()):
                self._round()
        self.fill_beside(gid)

    # -- allocations ------------------------------------------------------------------------------
    def _start_step(self, key: str, alloc: _Allocation) -> None:
        lead = alloc.jobs[0]
        if lead.kind == "video" and lead.remaining == 0:
            # A finished video put back in the queue before its decode (beside streams, or its
            # GPU lost): the decode is what is left.
            alloc.decoding = True
            duration = lead.decode
        else:
            duration = (
                lead.step_s(sp=len(alloc.gpus))
                if lead.kind == "video"
                else lead.step_s(batch=len(alloc.jobs))
            )
        now = self.host.now
        # A GPU still finishing an abandoned step's block starts this step after it.
        alloc.step_start = max([now] + [self.busy_until.get(g, now) for g in alloc.gpus])
        alloc.step_end = alloc.step_start + duration
        self.schedule(alloc.step_end, ("job", key, alloc.epoch))

    def _open(self, key: str, jobs: list[_Job], gpus: list[str], beside: bool = False) -> None:
        self.epoch += 1
        alloc = _Allocation(jobs, gpus, self.epoch, beside)
        self.allocations[key] = alloc
        for gid in gpus:
            self.gpu_owner[gid] = key
        for job in jobs:
            job.state = "running"
            job.degree = len(gpus) if job.kind == "video" else 1
            if job.started_at is None:
                job.started_at = self.host.now
        self._start_step(key, alloc)

    def _release_gpus(self, alloc: _Allocation, keep: int = 0) -> None:
        for gid in alloc.gpus[keep:]:
            self.gpu_owner.pop(gid, None)
        alloc.gpus = alloc.gpus[:keep]

    def _stop(self, key: str) -> _Allocation:
        alloc = self.allocations.pop(key)
        gpus = list(alloc.gpus)
        self._release_gpus(alloc)
        for job in alloc.jobs:
            job.degree = 0
        if alloc.beside:
            for gid in gpus:
                self.host.beside_ended(gid)  # a stream step it delayed (within their lead) starts
        return alloc

    def _requeue(self, key: str) -> None:
        for job in self._stop(key).jobs:
            job.state = "waiting"

    def _finish(self, key: str, now: float) -> None:
        for job in self._stop(key).jobs:
            job.state = "done"
            job.done_at = now
        self._round()

    def _resize(self, key: str, alloc: _Allocation, target: int) -> None:
        """At a step boundary: pause (target 0) or change the SP degree, within the GPUs free now."""
        lead = alloc.jobs[0]
        if target == 0:
            self._requeue(key)
            return
        free = self._free(self._usable())
        room = len(alloc.gpus) + len(free)
        degree = max(d for d in lead.sp_step if d <= min(target, room))
        if degree < len(alloc.gpus):
            self._release_gpus(alloc, keep=degree)
        else:
            for gid in free[: degree - len(alloc.gpus)]:
                alloc.gpus.append(gid)
                self.gpu_owner[gid] = key
        lead.degree = degree
        alloc.target = None
        self._start_step(key, alloc)

    def _free(self, usable: set[str]) -> list[str]:
        return sorted(g for g in usable if g not in self.gpu_owner)

    # -- rounds -----------------------------------------------------------------------------------
    def _round(self) -> None:
        """A policy round on the GPUs without streams, then what it left waiting beside them."""
        self._plan()
        self._fill_all()

    def _plan(self) -> None:
        waiting_images = [j for j in self.jobs.values() if j.kind == "image" and j.state == "waiting"]
        videos = [j for j in self.jobs.values() if j.kind == "video" and j.state in ("waiting", "running")]
        if not waiting_images and not videos:
            return
        usable = self._usable()
        # A video decoding, or evicted from a GPU a session took, is not re-planned this round.
        running_video = {
            j.id
            for j in videos
            if j.state == "running"
            and j.id in self.allocations  # not a step beside streams (keyed "beside:<n>")
            and not self.allocations[j.id].decoding
            and all(g in usable for g in self.allocations[j.id].gpus)
        }
        held = {g for g, key in self.gpu_owner.items() if key not in running_video}
        gpus = len(usable - held)
        step = max(
            (self.allocations[v].jobs[0].step_s(sp=self.jobs[v].degree) for v in running_video), default=0.0
        )
        round_s = self.cfg.round_steps * (step or 0.25)
        now = self.host.now
        inp = RoundInput(
            now=now,
            gpus=gpus,
            round_s=round_s,
            images=tuple(image_request(j, self.solver.max_batch) for j in waiting_images),
            videos=tuple(
                video_request(j, j.degree if j.id in running_video else 0, gpus)
                for j in videos
                if j.id in running_video or j.state == "waiting"
            ),
        )
        if not inp.images and not inp.videos:
            return
        t0 = time.perf_counter()
        plan = self.solver.plan(inp)
        self.round_ms.append((time.perf_counter() - t0) * 1000.0)
        # Running videos: record the target; it applies at their next step boundary.
        for vid in running_video:
            target = plan.degrees.get(vid, self.jobs[vid].degree)
            self.allocations[vid].target = None if target == self.jobs[vid].degree else target
        free = self._free(usable)
        for batch in plan.batches:
            if not free:
                break
            self.batches += 1
            self._open(f"batch:{self.batches}", [self.jobs[i] for i in batch.ids], [free.pop(0)])
        for vid, degree in plan.degrees.items():
            if vid in running_video or degree == 0:
                continue
            job = self.jobs[vid]
            offered = [d for d in job.sp_step if d <= min(degree, len(free))]
            if offered:
                take = offered[-1]
                self._open(vid, [job], free[:take])
                del free[:take]

    # -- autoscaler input and results --------------------------------------------------------------
    def demand(self) -> JobDemand:
        """The open jobs as the decision pipeline's job step takes them (``pipeline.add_job_demand``,
        the live loop's rule): all in the one region, and a job takes whole GPUs (one job a GPU)."""
        open_jobs = [
            (j.deadline, j.id, j.remaining_s(1))
            for j in self.jobs.values()
            if j.state in ("waiting", "running")
        ]
        # A GPU whose streams lend a job their slack is the streams' GPU, not one the jobs hold.
        holders = tuple(g for g, key in self.gpu_owner.items() if not self.allocations[key].beside)
        return JobDemand(open_jobs={None: open_jobs}, holders=holders, slots_per_gpu=1.0)

    def result(self, end: float) -> dict[str, Any]:
        jobs = [j for j in self.jobs.values() if j.arrival <= end and j.state != "cancelled"]

        def met(j: _Job) -> bool:
            return j.done_at is not None and j.done_at <= j.deadline + 1e-9

        def attainment(kind: str | None) -> float | None:
            chosen = [j for j in jobs if kind is None or j.kind == kind]
            return round(sum(met(j) for j in chosen) / len(chosen), 6) if chosen else None

        waits = [j.started_at - j.arrival for j in jobs if j.kind == "image" and j.started_at is not None]
        latencies = [j.done_at - j.arrival for j in jobs if j.done_at is not None]
        rounds = np.asarray(self.round_ms, dtype=float)
        return {
            "policy": self.solver.name,
            "submitted": len(jobs) + self.cancelled,
            "cancelled": self.cancelled,
            "completed": sum(j.done_at is not None for j in jobs),
            "slo_attainment": attainment(None),
            "image_slo_attainment": attainment("image"),
            "video_slo_attainment": attainment("video"),
            "image_wait_p50_s": round(float(np.percentile(waits, 50)), 4) if waits else None,
            "image_wait_mean_s": round(float(np.mean(waits)), 4) if waits else None,
            "latency_p99_s": round(float(np.percentile(latencies, 99)), 4) if latencies else None,
            "rounds": int(rounds.size),
            "round_ms_p50": round(float(np.percentile(rounds, 50)), 4) if rounds.size else None,
            "round_ms_p99": round(float(np.percentile(rounds, 99)), 4) if rounds.size else None,
            "unfinished": sum(j.done_at is None for j in jobs),
            "met": sum(met(j) for j in jobs),
            "abandoned_steps": self.abandoned_steps,
            "abandoned_gpu_s": round(self.abandoned_gpu_s, 3),
            "beside_steps": self.beside_steps,
            "beside_gpu_s": round(self.beside_gpu_s, 3),
        }
