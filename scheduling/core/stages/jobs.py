"""Mixed traces: session lines (``scheduling.core.traces``) and one-shot job lines in one JSON Lines file.

A job line::

    {"t": 3.0, "job": "j1", "event": "submit", "kind": "video", "model": "wan-t2v",
     "width": 832, "height": 480, "frames": 81, "steps": 6, "slo_s": 150.0}
    {"t": 9.0, "job": "j1", "event": "cancel"}

This is a minimal reader of the co-serving issue's format behind the interface its own reader will
have (``JobEvent``, ``parse_mixed_trace``, ``read_mixed_trace`` in ``scheduling.core.traces``), so the
stage simulator switches to that one by changing its import. Session lines are handed to
``parse_trace`` unchanged, with job lines blanked so its error messages keep the file's line numbers.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from scheduling.core.traces import TraceError, TraceEvent, parse_trace

JOB_EVENTS = ("submit", "cancel")
JOB_KINDS = ("image", "video")
_SUBMIT_FIELDS = frozenset(
    {"t", "job", "event", "kind", "model", "width", "height", "frames", "steps", "slo_s"}
)
_CANCEL_FIELDS = frozenset({"t", "job", "event"})


@dataclass(frozen=True)
class JobEvent:
    t: float
    job: str
    event: str
    kind: str = "image"
    model: str = ""
    width: int = 0
    height: int = 0
    frames: int = 1
    steps: int = 1
    slo_s: float | None = None

    def to_json(self) -> dict[str, Any]:
        record: dict[str, Any] = {"t": self.t, "job": self.job, "event": self.event}
        if self.event == "submit":
            record.update(
                kind=self.kind,
                model=self.model,
                width=self.width,
                height=self.height,
                frames=self.frames,
                steps=self.steps,
            )
            if self.slo_s is not None:
                record["slo_s"] = self.slo_s
        return record


def _positive_int(record: dict[str, Any], name: str, line: int) -> int:
    value = record.get(name)
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise TraceError(line, f"{name!r} must be an integer >= 1, got {value!r}")
    return value


def _parse_job(record: dict[str, Any], line: int) -> JobEvent:
    event = record.get("event")
    if event not in JOB_EVENTS:
        raise TraceError(line, f"unknown job event {event!r} (expected one of {list(JOB_EVENTS)})")
    allowed = _SUBMIT_FIELDS if event == "submit" else _CANCEL_FIELDS
    unknown = record.keys() - allowed
    if unknown:
        raise TraceError(line, f"unknown field(s) {sorted(unknown)} for a job {event!r}")
    t = record.get("t")
    if isinstance(t, bool) or not isinstance(t, int | float) or not math.isfinite(t) or t < 0:
        raise TraceError(line, f"'t' must be a finite number >= 0, got {t!r}")
    job = record["job"]
    if not isinstance(job, str) or not job:
        raise TraceError(line, f"'job' must be a non-empty string, got {job!r}")
    if event == "cancel":
        return JobEvent(float(t), job, event)
    kind = record.get("kind")
    if kind not in JOB_KINDS:
        raise TraceError(line, f"'kind' must be one of {list(JOB_KINDS)}, got {kind!r}")
    model = record.get("model")
    if not isinstance(model, str) or not model:
        raise TraceError(line, f"'model' must be a non-empty string, got {model!r}")
    width, height, frames, steps = (
        _positive_int(record, name, line) for name in ("width", "height", "frames", "steps")
    )
    if kind == "image" and frames != 1:
        raise TraceError(line, f"an image job has frames = 1, got {frames}")
    slo_s = record.get("slo_s")
    if slo_s is not None and (
        isinstance(slo_s, bool)
        or not isinstance(slo_s, int | float)
        or not math.isfinite(slo_s)
        or slo_s <= 0
    ):
        raise TraceError(line, f"'slo_s' must be a finite number > 0, got {slo_s!r}")
    return JobEvent(
        float(t),
        job,
        event,
        kind,
        model,
        width,
        height,
        frames,
        steps,
        None if slo_s is None else float(slo_s),
    )


def parse_mixed_trace(lines: Iterable[str]) -> tuple[dict, list[TraceEvent], list[JobEvent]]:
    """Split and validate a mixed trace: ``(meta, session_events, job_events)``; errors name the line."""
    session_lines: list[str] = []
    jobs: list[JobEvent] = []
    state: dict[str, str] = {}
    last_t = -math.inf
    for number, raw in enumerate(lines, start=1):
        text = raw.strip()
        record = None
        if text:
            try:
                record = json.loads(text)
            except json.JSONDecodeError as exc:
                raise TraceError(number, f"bad JSON: {exc.msg}") from None
        if not isinstance(record, dict) or "job" not in record:
            session_lines.append(raw)
            continue
        session_lines.append("")
        job = _parse_job(record, number)
        if job.t < last_t:
            raise TraceError(number, f"time goes back ({job.t} after {last_t})")
        last_t = job.t
        current = state.get(job.job)
        if job.event == "submit" and current is not None:
            raise TraceError(number, f"duplicate submit for job {job.job!r}")
        if job.event == "cancel" and current != "submitted":
            raise TraceError(number, f"cancel for a job that is not pending: {job.job!r}")
        state[job.job] = "submitted" if job.event == "submit" else "cancelled"
        jobs.append(job)
    meta, sessions = parse_trace(session_lines)
    return meta, sessions, jobs


def read_mixed_trace(path: str | Path) -> tuple[dict, list[TraceEvent], list[JobEvent]]:
    with open(path, encoding="utf-8") as handle:
        return parse_mixed_trace(handle)


def write_mixed_trace(
    path: str | Path, jobs: Iterable[JobEvent], sessions: Iterable[TraceEvent] = (), meta: dict | None = None
) -> None:
    """Write jobs and sessions merged by time; the result reads back with :func:`read_mixed_trace`."""
    records = [(e.t, 0, e.to_json()) for e in sessions] + [(j.t, 1, j.to_json()) for j in jobs]
    records.sort(key=lambda item: (item[0], item[1]))
    lines = [] if meta is None else [json.dumps({"meta": meta}, sort_keys=True)]
    lines += [json.dumps(record) for _, _, record in records]
    parse_mixed_trace(lines)
    Path(path).write_text("".join(line + "\n" for line in lines), encoding="utf-8")
