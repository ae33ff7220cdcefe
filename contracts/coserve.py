"""When a one-shot job step may run beside streams on one device (issue 32): the rule the worker
daemon runs and the simulator measures.

Streams come first, but they do not need the device all the time: each stream's next chunk has a
time by which it must be finished (`StreamDemand.finish_by`: for the worker, a reserved part of
its look-ahead before the chunk is due to play, ``workers.daemon.streams.Streams.demands``) and an
expected generation time. Served earliest deadline first after the job step, the k-th chunk ends at
``now + step + Σ_{j ≤ k} generation_j``; the step may therefore take as long as the smallest

    slack_k = finish_by_k − now − Σ_{j ≤ k} generation_j

(EDF feasibility on one machine: Liu & Layland's demand criterion for a single non-preemptive
insertion). A step of estimated duration d runs when ``d ≤ slack``; the caller arms an abandon flag
at ``now + slack`` so a step that overruns its estimate stops at its next block boundary (the same
mechanism as a stream's claim) and the streams keep their deadlines even when the estimate was wrong.

Unlike the window this replaces (the time until the earliest chunk's look-ahead horizon, which
coalescing and staggered stream phases kept near zero), the slack is what the streams actually
leave: with streams using a fraction u of the device, jobs get about 1 − u of it.

Pure and clock-agnostic: times are whatever clock the caller uses. No Django, no torch.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass


@dataclass(frozen=True)
class StreamDemand:
    """One stream's next chunk: when it must be finished, and how long it is expected to take."""

    finish_by: float
    generation_s: float


def stream_slack_s(streams: Iterable[StreamDemand], *, now: float) -> float:
    """Seconds a job step starting now may take without any stream's next chunk ending after its
    ``finish_by`` (chunks then served earliest deadline first); infinite with no stream, 0 when a
    chunk is already short of time."""
    slack, queued = math.inf, 0.0
    for demand in sorted(streams, key=lambda d: d.finish_by):
        queued += demand.generation_s
        slack = min(slack, demand.finish_by - now - queued)
    return max(0.0, slack)


def job_step_fits(step_s: float | None, slack_s: float, *, probe_s: float = 0.0) -> bool:
    """Whether a job step expected to take ``step_s`` may start with ``slack_s`` left. An unmeasured
    step (None) starts only with at least ``probe_s`` of slack, its first measurement guarded by
    the abandon flag at the slack's end."""
    if step_s is None:
        return slack_s >= probe_s and slack_s > 0.0
    return step_s <= slack_s


__all__ = ["StreamDemand", "job_step_fits", "stream_slack_s"]
