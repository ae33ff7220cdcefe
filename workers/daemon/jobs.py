"""One-shot jobs on a worker (issue 14, docs/jobs.md): admission, step-level preemption, results.

The worker daemon owns one `JobRunner` and hands it the job commands (``job_run``, ``job_pause``,
``job_resume``, ``job_cancel``) and the time its streams leave: after the daemon has run every due
chunk, `run_step` plans one batched denoising step that ends before the next chunk must start
(``workers.runtime.jobs``) and runs it on the shared engine. A step is the unit of preemption: a
paused job's state region goes to host memory (the engine's offload path, like a parked session) and
a paused job can leave for another worker through the daemon's migration commands.

A video job runs with the sequence-parallel degree its ``job_run`` (or ``job_resume``) names,
``sp_degree``, at most the worker's job devices (`job_devices`: every CUDA device of the host when
the engine is on CUDA and there are several; the daemon reports how many in its heartbeat): each
step splits the video's tokens across that many devices (``StreamingVideoModel.sequence_parallel``).

A finished job is decoded on the hot loop (one small call) and encoded (PNG or MP4) on a thread
beside it; the result goes to the control plane through the ``Reporter``'s job methods. Every report
carries the job's epoch: the control plane ignores one from a worker that lost the job.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import torch

from workers.ports import Reporter
from workers.runtime.encoding import encode_mp4, encode_png
from workers.runtime.engine import ChunkEngine, HostStateRecord
from workers.runtime.jobs import JobTicket, StepTimes, plan_job_batch
from workers.runtime.models.base import JobSpecError, OneShotUnsupported

logger = logging.getLogger("workers.jobs")

PROGRESS_EVERY_S = 0.25  # docs/jobs.md: at most ~4 progress reports a second per running job
RUNNING, PAUSED = "running", "paused"


@dataclass
class AbandonedStep:
    """A job step stopped part-way for a stream: its jobs, and the milliseconds of work lost."""

    jobs: list[str]
    lost_ms: float

    def as_result(self) -> dict[str, Any]:
        return {"jobs": self.jobs, "lost_ms": round(self.lost_ms, 3)}


class JobRefused(Exception):
    """The worker does not apply this job command; the reason goes back to the control plane."""


@dataclass
class OwnedJob:
    """What the worker knows about a job it holds (running, paused, or arrived paused)."""

    job_id: str
    epoch: int
    kind: str
    steps: int
    step: int
    ticket: JobTicket
    deadline_unix: float
    fps: float
    parked: HostStateRecord | None = None
    run_s: float = 0.0  # seconds of denoising steps spent on it so far, on every worker it visited
    sp_degree: int = 1  # devices a step of this video is split across (elastic SP)
    last_progress: float = -math.inf

    @property
    def state(self) -> str:
        return PAUSED if self.parked is not None else RUNNING

    def travel_meta(self) -> dict[str, Any]:
        """What the control-plane fields of the job are on the target of a migration."""
        return {
            "deadline": self.deadline_unix,
            "priority": self.ticket.priority,
            "run_s": self.run_s,
        }


_JOB_FIELDS: dict[str, tuple[type, ...]] = {
    "job": (str,),
    "epoch": (int,),
    "job_kind": (str,),
    "model": (str,),
    "prompt": (str,),
    "width": (int,),
    "height": (int,),
    "frames": (int,),
    "steps": (int,),
    "seed": (int,),
    "deadline": (int, float),
    "priority": (int,),
}


def job_run_fields(command: dict[str, Any]) -> None:
    """Refuse a ``job_run`` with a missing or mistyped field, naming it."""
    for name, types in _JOB_FIELDS.items():
        value = command.get(name)
        if value is None or isinstance(value, bool) or not isinstance(value, types):
            raise JobRefused(f"job_run field {name!r} is missing or not {types[0].__name__}")
    sp_degree_field(command)


def sp_degree_field(command: dict[str, Any]) -> int | None:
    """The optional ``sp_degree`` of a ``job_run``/``job_resume`` (None when absent)."""
    value = command.get("sp_degree")
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise JobRefused(f"{command.get('kind', 'job_run')} field 'sp_degree' is not an int >= 1")
    return value


def job_devices(device: torch.device | str) -> list[torch.device]:
    """The devices this worker's video steps may be split across: with the engine on CUDA and several
    CUDA devices, all of them (the engine's first); otherwise the engine's device alone."""
    device = torch.device(device)
    if device.type != "cuda" or torch.cuda.device_count() < 2:
        return [device]
    own = device.index if device.index is not None else torch.cuda.current_device()
    return [torch.device("cuda", own)] + [
        torch.device("cuda", i) for i in range(torch.cuda.device_count()) if i != own
    ]


class JobRunner:
    def __init__(
        self,
        *,
        engine: ChunkEngine,
        reporter: Reporter,
        worker_name: str,
        capacity: int,
        clock: Callable[[], float],
        wall_clock: Callable[[], float] = time.time,
        devices: Sequence[torch.device | str] | None = None,
    ) -> None:
        """``devices``: what video steps may be split across (`job_devices` of the engine's device
        when None); a list that repeats ``"cpu"`` runs the split for real on one CPU."""
        self.engine = engine
        self.reporter = reporter
        self.worker_name = worker_name
        self.capacity = capacity
        self.clock = clock
        self.wall_clock = wall_clock
        self.jobs: dict[str, OwnedJob] = {}
        self.devices = [torch.device(d) for d in devices] if devices else job_devices(engine.device)
        self.times = StepTimes()
        self.abandoned: AbandonedStep | None = None  # the last abandoned step, until taken
        self.abandoned_steps = 0
        self.abandoned_s = 0.0  # job work lost to abandoned steps, in all
        self._admitted = 0
        # Encoding an MP4 takes longer than a step: it runs beside the hot loop, one job at a time.
        self._encoder = ThreadPoolExecutor(max_workers=1, thread_name_prefix="job-encode")

    def close(self) -> None:
        self._encoder.shutdown(wait=True)

    # --- commands --------------------------------------------------------------------------------

    def run(self, command: dict[str, Any]) -> dict[str, Any]:
        """``job_run``: admit the job at step 0 (or acknowledge a repeat of the same or newer epoch)."""
        job_run_fields(command)
        job_id, epoch = command["job"], command["epoch"]
        existing = self.jobs.get(job_id)
        if existing is not None:
            if epoch < existing.epoch:
                raise JobRefused(f"stale epoch {epoch} < {existing.epoch} for job {job_id}")
            existing.epoch = epoch
            return {"admitted": True, "already": True}
        model = self.engine.model
        if command["model"] != model.preset:
            raise JobRefused(f"job model {command['model']!r}: this worker runs {model.preset!r}")
        try:
            self.engine.add_job(
                job_id,
                kind=command["job_kind"],
                prompt=command["prompt"],
                seed=command["seed"],
                width=command["width"],
                height=command["height"],
                frames=command["frames"],
                steps=command["steps"],
            )
        except (JobSpecError, OneShotUnsupported) as exc:
            raise JobRefused(str(exc)) from exc
        owned = self._own(
            job_id,
            epoch,
            shape=self.engine.job_shape(job_id),
            step=0,
            steps=command["steps"],
            travel={"deadline": float(command["deadline"]), "priority": command["priority"]},
        )
        owned.sp_degree = self._degree(owned, sp_degree_field(command))
        self._report(owned, force=True)
        return {"admitted": True} | ({"sp_degree": owned.sp_degree} if owned.sp_degree > 1 else {})

    def pause(self, command: dict[str, Any]) -> dict[str, Any]:
        """``job_pause``: the daemon applies commands between steps, so this is a step boundary."""
        owned = self.owned(command)
        if owned.parked is not None:
            return {"step": owned.step, "already": True}
        record = self.engine.suspend(owned.job_id)
        owned.parked = record
        self._report(owned, force=True)
        return {"step": owned.step, "bytes": record.nbytes, "copy_ms": round(record.copy_ms, 3)}

    def resume(self, command: dict[str, Any]) -> dict[str, Any]:
        owned = self.owned(command)
        asked = sp_degree_field(command)
        if asked is not None:  # a resume after a move: the degree for this worker's devices
            owned.sp_degree = self._degree(owned, asked)
        if owned.parked is None:
            return {"step": owned.step, "already": True}
        report = self.engine.resume(owned.job_id, owned.parked)
        owned.parked = None
        self._report(owned, force=True)
        return {"step": owned.step, "copy_ms": round(report.copy_ms, 3)}

    def cancel(self, command: dict[str, Any]) -> dict[str, Any]:
        job_id = command.get("job")
        if job_id not in self.jobs:
            return {"already": True}
        self.owned(command)  # refuses an older epoch
        self.forget(job_id)
        return {}

    def owned(self, command: dict[str, Any]) -> OwnedJob:
        """The job a command names, refusing an unknown job or an epoch older than ours."""
        job_id = command.get("job")
        owned = self.jobs.get(job_id)  # type: ignore[arg-type]
        if owned is None:
            raise JobRefused(f"job {job_id} is not on worker {self.worker_name}")
        epoch = command.get("epoch")
        if not isinstance(epoch, int) or isinstance(epoch, bool):
            raise JobRefused(f"{command.get('kind')} field 'epoch' is missing or not int")
        if epoch < owned.epoch:
            raise JobRefused(f"stale epoch {epoch} < {owned.epoch} for job {job_id}")
        owned.epoch = epoch  # a newer epoch: the control plane reassigned the job to us again
        return owned

    def forget(self, job_id: str) -> None:
        self.jobs.pop(job_id, None)
        if job_id in self.engine.sessions():
            self.engine.remove(job_id)

    # --- migration (the daemon's migrate_out / migrate_in with "job") -----------------------------

    def region_for_migration(self, owned: OwnedJob) -> tuple[dict[str, Any], dict[str, Any]]:
        """(manifest, tensors): the parked record's, or the live region frozen at this step boundary
        (the daemon thaws it if the transfer fails)."""
        if owned.parked is not None:
            manifest, tensors = owned.parked.manifest, owned.parked.tensors
        else:
            manifest, tensors = self.engine.export_state(owned.job_id)
        manifest.setdefault("meta", {})["job_travel"] = owned.travel_meta()
        return manifest, tensors

    def arrived(self, job_id: str, epoch: int, manifest: dict[str, Any], tensors: dict[str, Any]) -> None:
        """A migrated job's region landed here: it is paused (docs/jobs.md) until a ``job_resume``."""
        meta = manifest["meta"]
        host = {name: t.to("cpu") for name, t in tensors.items()}
        nbytes = sum(t.numel() * t.element_size() for t in host.values())
        owned = self._own(
            job_id,
            epoch,
            shape=self.engine.model.job_shape(meta),
            step=int(meta["step"]),
            steps=int(meta["steps"]),
            travel=meta.get("job_travel", {}),
        )
        owned.parked = HostStateRecord(job_id, manifest, host, nbytes, 0.0, pinned=False)
        self._report(owned, force=True)

    # --- the steps ---------------------------------------------------------------------------------

    def runnable(self) -> list[OwnedJob]:
        return [o for o in self.jobs.values() if o.parked is None and not self.engine.is_frozen(o.job_id)]

    def run_step(
        self,
        *,
        now: float,
        free_s: float,
        probe_s: float,
        abandon: threading.Event | None = None,
        probe: bool = False,
    ) -> bool:
        """Run one batched job step that fits in `free_s`; returns whether one ran.

        Once ``abandon`` is set (a stream claims the device: the daemon's `StreamClaimWatch`) the
        step stops at its next block boundary and its work is lost: the jobs stay at the step
        boundary before it, runnable, and the step runs again later (`abandoned`)."""
        self.abandoned = None  # the commands applied since the last step have been answered
        tickets = [o.ticket for o in self.runnable()]
        if not tickets:
            return False
        chosen = plan_job_batch(
            tickets,
            now=now,
            free_s=free_s,
            times=self.times,
            max_batch=self.capacity,
            probe_s=probe_s,
            probe=probe,
        )
        if not chosen:
            return False
        lead = self.jobs[chosen[0]]
        try:
            # A video runs alone (``plan_job_batch``), split across its degree's devices.
            with self.engine.model.sequence_parallel(self.devices[: lead.sp_degree]):
                report = self.engine.job_step(chosen, abandon=abandon)
        except Exception as exc:
            logger.exception("job step failed worker=%s jobs=%s", self.worker_name, chosen)
            for job_id in chosen:
                self._fail(self.jobs[job_id], f"{type(exc).__name__}: {exc}")
            return True
        if report.abandoned:
            # Not a measurement of the step (it stopped part-way) but a lower bound of it: a step
            # that overran its estimate (abandoned when the streams' slack was spent) moves the
            # estimate towards that bound instead of being abandoned again and again. An abandoned
            # probe records nothing: one slow first step must not set an estimate no slack fits.
            shape, lost_s = self.jobs[chosen[0]].ticket.shape, report.step_ms / 1000.0
            estimate = self.times.estimate(shape, len(chosen))
            if estimate is not None and lost_s > estimate:
                self.times.record(shape, len(chosen), lost_s)
            self.abandoned = AbandonedStep(jobs=list(chosen), lost_ms=report.step_ms)
            self.abandoned_steps += 1
            self.abandoned_s += report.step_ms / 1000.0
            logger.info(
                "job step abandoned for streams worker=%s jobs=%s lost_ms=%.1f",
                self.worker_name,
                chosen,
                report.step_ms,
            )
            return True
        step_s = report.step_ms / 1000.0
        self.times.record(self.jobs[chosen[0]].ticket.shape, len(chosen), step_s, replace=probe)
        for job_id, done in report.steps_done.items():
            owned = self.jobs[job_id]
            owned.step, owned.run_s = done, owned.run_s + step_s
            owned.ticket.steps_left = owned.steps - done
            if job_id in report.finished:
                self._finish(owned)
            else:
                self._report(owned)
        return True

    def _finish(self, owned: OwnedJob) -> None:
        try:
            frames = self.engine.job_frames(owned.job_id).numpy()
        except Exception as exc:
            logger.exception("job decode failed worker=%s job=%s", self.worker_name, owned.job_id)
            self._fail(owned, f"{type(exc).__name__}: {exc}")
            return
        self.forget(owned.job_id)
        self._encoder.submit(self._deliver, owned, frames)

    def _deliver(self, owned: OwnedJob, frames: Any) -> None:
        """On the encoder thread: PNG or MP4, then the result to the control plane."""
        try:
            if owned.kind == "image":
                content, content_type, extension = encode_png(frames[0]), "image/png", "png"
            else:
                content, content_type, extension = encode_mp4(frames, owned.fps), "video/mp4", "mp4"
        except Exception as exc:
            logger.exception("job encode failed worker=%s job=%s", self.worker_name, owned.job_id)
            self.reporter.job_failed(owned.job_id, owned.epoch, self.worker_name, reason=f"encoding: {exc}")
            return
        self.reporter.job_completed(
            owned.job_id,
            owned.epoch,
            self.worker_name,
            content=content,
            content_type=content_type,
            extension=extension,
            run_s=owned.run_s,
        )

    def _fail(self, owned: OwnedJob, reason: str) -> None:
        self.forget(owned.job_id)
        self.reporter.job_failed(owned.job_id, owned.epoch, self.worker_name, reason=reason)

    # --- internals ---------------------------------------------------------------------------------

    def _degree(self, owned: OwnedJob, asked: int | None) -> int:
        """A video's SP degree: what the control plane asked, at most this worker's devices; an image
        (batched with others of its shape) or a model without SP runs on one device."""
        if asked is None or owned.kind != "video" or not self.engine.model.SEQUENCE_PARALLEL:
            return 1
        return min(asked, len(self.devices))

    def _own(
        self,
        job_id: str,
        epoch: int,
        *,
        shape: tuple[str, int, int, int],
        step: int,
        steps: int,
        travel: dict[str, Any],
    ) -> OwnedJob:
        deadline_unix = float(travel.get("deadline", math.inf))
        self._admitted += 1
        ticket = JobTicket(
            job_id=job_id,
            shape=shape,
            # Deadlines arrive as unix seconds; the planner compares them with the daemon's clock.
            deadline=self.clock() + (deadline_unix - self.wall_clock()),
            priority=int(travel.get("priority", 0)),
            steps_left=steps - step,
            order=self._admitted,
        )
        owned = OwnedJob(
            job_id=job_id,
            epoch=epoch,
            kind=shape[0],
            steps=steps,
            step=step,
            ticket=ticket,
            deadline_unix=deadline_unix,
            fps=float(self.engine.model.fps),
            run_s=float(travel.get("run_s", 0.0)),
        )
        self.jobs[job_id] = owned
        return owned

    def _report(self, owned: OwnedJob, *, force: bool = False) -> None:
        now = self.clock()
        if not force and now - owned.last_progress < PROGRESS_EVERY_S:
            return
        owned.last_progress = now
        self.reporter.job_progress(
            owned.job_id, owned.epoch, self.worker_name, state=owned.state, step=owned.step, steps=owned.steps
        )
