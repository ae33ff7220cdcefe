"""Which one-shot job steps fill the time a worker's streams leave (issue 14, GenServe on one worker).

Streams come first: a chunk is never preempted, and a job step starts only when its estimated
duration fits the slack the streams' next chunks leave (`free_s`, ``contracts.coserve``: the same
rule the simulator measures). Within that slack:

- the job to run is the most urgent one that fits: highest priority, then earliest deadline
  (EDF), then admission order;
- images of one resolution are batched (GenServe §4: image batches by resolution against their
  deadlines): more images of that shape join, in the same order, while the batch's step still fits
  the window and the batch still finishes its earliest-deadline member in time (remaining steps ×
  the batch's step time). Videos run one at a time: a step is their unit of preemption.

Step times come from measurements (`StepTimes.record`, an exponential moving average per
(shape, batch size)); an unmeasured batch size is scaled linearly from the nearest measured one of
its shape, an unmeasured shape from any measured shape by its pixel count × frames. With nothing
measured yet the estimate is unknown: such a step runs only in a window of at least `probe_s`
(the daemon passes its streams' last chunk generation time: a chunk is several denoising passes
over a chunk's frames, and a step of a job at a stream's size is one pass), so the first
measurement does not land in a tight gap. That prior is a heuristic, not a bound: a job far larger
than a chunk can overrun its first window once; from then on its own measurement decides.

Pure and clock-agnostic: times are whatever clock the caller uses (the daemon's monotonic clock,
a test's fake clock). No torch, no Django.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

from contracts.coserve import job_step_fits

Shape = tuple[str, int, int, int]  # (kind, width, height, frames), as the model's `job_shape`


@dataclass
class JobTicket:
    """What the planner knows of a runnable job."""

    job_id: str
    shape: Shape
    deadline: float
    priority: int
    steps_left: int
    order: int = 0

    @property
    def kind(self) -> str:
        return self.shape[0]

    def urgency(self) -> tuple[int, float, int]:
        return (-self.priority, self.deadline, self.order)


def shape_work(shape: Shape) -> int:
    """Pixels × frames: the unit by which an unmeasured shape's step time is scaled."""
    _kind, width, height, frames = shape
    return width * height * frames


@dataclass
class StepTimes:
    """Measured seconds per job step, by (shape, batch size)."""

    smoothing: float = 0.3
    _seconds: dict[tuple[Shape, int], float] = field(default_factory=dict)

    def record(self, shape: Shape, batch: int, seconds: float, *, replace: bool = False) -> None:
        """Fold a measurement into the average, or (`replace`: a probe's, taken because the average
        was not to be trusted) start it again from this one."""
        key = (shape, batch)
        previous = None if replace else self._seconds.get(key)
        self._seconds[key] = seconds if previous is None else previous + self.smoothing * (seconds - previous)

    def estimate(self, shape: Shape, batch: int) -> float | None:
        exact = self._seconds.get((shape, batch))
        if exact is not None:
            return exact
        same_shape = [(b, s) for (sh, b), s in self._seconds.items() if sh == shape]
        if same_shape:
            nearest, seconds = min(same_shape, key=lambda item: abs(item[0] - batch))
            return seconds * batch / nearest
        if self._seconds:
            (other, other_batch), seconds = max(self._seconds.items(), key=lambda item: item[1])
            return seconds * (shape_work(shape) * batch) / (shape_work(other) * other_batch)
        return None

    def as_points(self) -> list[dict[str, object]]:
        return [
            {"kind": sh[0], "width": sh[1], "height": sh[2], "frames": sh[3], "batch": b, "step_s": s}
            for (sh, b), s in sorted(self._seconds.items())
        ]


def _fits(estimate: float | None, free_s: float, probe_s: float) -> bool:
    return job_step_fits(estimate, free_s, probe_s=probe_s)  # the rule the simulator measures too


def _meets(earliest: JobTicket, estimate: float | None, now: float) -> bool:
    """Whether a batch stepping at `estimate` s finishes its earliest-deadline member in time."""
    return estimate is not None and now + earliest.steps_left * estimate <= earliest.deadline


def plan_job_batch(
    tickets: Iterable[JobTicket],
    *,
    now: float,
    free_s: float,
    times: StepTimes,
    max_batch: int,
    probe_s: float = 0.0,
    probe: bool = False,
) -> list[str]:
    """The job ids of the next batched step (empty when no step fits in `free_s` seconds).

    `free_s` is the slack the streams leave (``contracts.coserve.stream_slack_s``; infinite with none).
    With `probe`, the most urgent job's step runs alone as if it had never been measured (in a
    slack of at least `probe_s`; the caller abandons it at the slack's end): the daemon's
    starvation guard, for an estimate no slack fits — an unmeasured shape's, scaled from another
    shape by pixels × frames, can be ten times a tiny video's real step.
    """
    ordered = sorted(tickets, key=JobTicket.urgency)
    lead = next(
        (
            t
            for t in ordered
            if t.steps_left > 0 and _fits(None if probe else times.estimate(t.shape, 1), free_s, probe_s)
        ),
        None,
    )
    if lead is None:
        return []
    batch = [lead]
    if lead.kind == "image" and not probe:
        for candidate in ordered:
            if len(batch) >= max_batch:
                break
            if candidate is lead or candidate.shape != lead.shape or candidate.steps_left <= 0:
                continue
            estimate = times.estimate(lead.shape, len(batch) + 1)
            earliest = min([*batch, candidate], key=lambda t: t.deadline)
            if not _fits(estimate, free_s, probe_s) or not _meets(earliest, estimate, now):
                break
            batch.append(candidate)
    return [t.job_id for t in batch]


__all__ = ["JobTicket", "Shape", "StepTimes", "plan_job_batch", "shape_work"]
