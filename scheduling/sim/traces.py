"""Session traces: the JSON Lines contract shared by generators, the simulator and the live replayer.

One event per line, sorted by ``t`` (seconds from the start of the trace)::

    {"meta": {"name": "T1", "seed": 0}}                       # optional, first line only
    {"t": 0.0, "session": "s1", "event": "arrive", "load": 1.0, "model": "wan-1.3b"}
    {"t": 1.5, "session": "s1", "event": "active"}
    {"t": 9.0, "session": "s1", "event": "idle"}
    {"t": 30.0, "session": "s1", "event": "depart"}

A session arrives idle; ``active`` means the user is interacting and the session must execute;
``idle`` means it may be suspended; ``depart`` ends it. ``viewer_leave`` / ``viewer_return`` mark
its last viewer closing its stream and one coming back (issue 31): readers drop them unless asked
(``viewer_events=True``), and ``scheduling.sim.viewers.viewer_rule`` turns them into the idle,
active and depart events the platform's viewer rule would record. Only ``arrive`` may carry ``load`` (relative
per-chunk cost, finite and > 0, default 1.0), ``model``, ``resolution`` and ``tenant`` (the team the
session is charged to, issue 29: the simulator's fair share; default: the default tenant). The full description is in
``docs/traces.md``.

A *mixed* trace also carries one-shot jobs (issue 14, GenServe)::

    {"t": 2.0, "job": "j1", "event": "submit", "kind": "image", "resolution": "768x768", "steps": 28, "slo_s": 4.0}
    {"t": 3.0, "job": "j2", "event": "submit", "kind": "video", "model": "wan2.2-5b",
     "resolution": "480x480", "frames": 81, "steps": 50, "slo_s": 60.0}
    {"t": 9.0, "job": "j2", "event": "cancel"}

:func:`parse_mixed_trace` reads both kinds; :func:`parse_trace` (the session-only contract every
existing tool relies on) rejects a job line with its number and points to the mixed reader, so a
session-only consumer never silently drops jobs.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

from scheduling.core.types import TRACE_EVENT_KINDS

EVENT_KINDS = tuple(kind.value for kind in TRACE_EVENT_KINDS)
# Marks in the trace, not scheduler events: what the viewer rule reads (scheduling.sim.viewers).
VIEWER_EVENT_KINDS = ("viewer_leave", "viewer_return")
_BASE_FIELDS = frozenset({"t", "session", "event"})
_ARRIVE_FIELDS = frozenset({"load", "model", "resolution", "tenant"})
JOB_EVENT_KINDS = ("submit", "cancel")
JOB_KINDS = ("image", "video")
_JOB_BASE_FIELDS = frozenset({"t", "job", "event"})
_SUBMIT_REQUIRED = frozenset({"kind", "resolution", "steps", "slo_s"})
_SUBMIT_OPTIONAL = frozenset({"model", "frames"})


@dataclass(frozen=True)
class TraceEvent:
    t: float
    session: str
    event: str
    load: float = 1.0
    model: str | None = None
    resolution: str | None = None
    tenant: str | None = None

    def to_json(self) -> dict[str, Any]:
        record: dict[str, Any] = {"t": self.t, "session": self.session, "event": self.event}
        if self.event == "arrive":
            if self.load != 1.0:
                record["load"] = self.load
            if self.model is not None:
                record["model"] = self.model
            if self.resolution is not None:
                record["resolution"] = self.resolution
            if self.tenant is not None:
                record["tenant"] = self.tenant
        return record


@dataclass(frozen=True)
class JobEvent:
    """A one-shot job's submit or cancel. Only ``submit`` carries the job's shape and SLO."""

    t: float
    job: str
    event: str  # "submit" | "cancel"
    kind: str | None = None  # "image" | "video"
    model: str | None = None  # None: the cost profile's default model for the kind
    width: int | None = None
    height: int | None = None
    frames: int | None = None  # videos only; an image is one frame
    steps: int | None = None
    slo_s: float | None = None

    @property
    def deadline(self) -> float:
        assert self.slo_s is not None, "only a submit has a deadline"
        return self.t + self.slo_s

    def to_json(self) -> dict[str, Any]:
        record: dict[str, Any] = {"t": self.t, "job": self.job, "event": self.event}
        if self.event == "submit":
            record["kind"] = self.kind
            if self.model is not None:
                record["model"] = self.model
            record["resolution"] = f"{self.width}x{self.height}"
            if self.frames is not None:
                record["frames"] = self.frames
            record["steps"] = self.steps
            record["slo_s"] = self.slo_s
        return record


class TraceError(ValueError):
    """A malformed trace; ``line`` is the 1-based line number of the offending line."""

    def __init__(self, line: int, message: str):
        super().__init__(f"line {line}: {message}")
        self.line = line
        self.message = message


def _check_t(record: dict[str, Any], line: int) -> float:
    t = record["t"]
    if isinstance(t, bool) or not isinstance(t, int | float) or not math.isfinite(t) or t < 0:
        raise TraceError(line, f"'t' must be a finite number >= 0, got {t!r}")
    return float(t)


def _parse_event(record: dict[str, Any], line: int) -> TraceEvent:
    missing = _BASE_FIELDS - record.keys()
    if missing:
        raise TraceError(line, f"missing field(s) {sorted(missing)}")
    kind = record["event"]
    if kind not in EVENT_KINDS + VIEWER_EVENT_KINDS:
        raise TraceError(
            line, f"unknown event kind {kind!r} (expected one of {list(EVENT_KINDS + VIEWER_EVENT_KINDS)})"
        )
    allowed = _BASE_FIELDS | _ARRIVE_FIELDS if kind == "arrive" else _BASE_FIELDS
    unknown = record.keys() - allowed
    if unknown:
        raise TraceError(line, f"unknown field(s) {sorted(unknown)} for a {kind!r} event")
    t = _check_t(record, line)
    session = record["session"]
    if not isinstance(session, str) or not session:
        raise TraceError(line, f"'session' must be a non-empty string, got {session!r}")
    load = record.get("load", 1.0)
    if isinstance(load, bool) or not isinstance(load, int | float) or not math.isfinite(load) or load <= 0:
        raise TraceError(line, f"'load' must be a finite number > 0, got {load!r}")
    model = record.get("model")
    resolution = record.get("resolution")
    tenant = record.get("tenant")
    for name, value in (("model", model), ("resolution", resolution)):
        if value is not None and not isinstance(value, str):
            raise TraceError(line, f"{name!r} must be a string, got {value!r}")
    if tenant is not None and (not isinstance(tenant, str) or not tenant):
        raise TraceError(line, f"'tenant' must be a non-empty string, got {tenant!r}")
    return TraceEvent(t, session, kind, float(load), model, resolution, tenant)


def parse_resolution(text: Any) -> tuple[int, int]:
    """``"WxH"`` (positive integers) → ``(W, H)``; ``ValueError`` otherwise."""
    if not isinstance(text, str):
        raise ValueError(f"must be a string 'WxH', got {text!r}")
    parts = text.lower().split("x")
    if len(parts) != 2 or not all(p.isdigit() for p in parts) or not all(int(p) > 0 for p in parts):
        raise ValueError(f"must be 'WxH' with positive integers, got {text!r}")
    return int(parts[0]), int(parts[1])


def _positive_int(record: dict[str, Any], name: str, line: int) -> int:
    value = record[name]
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise TraceError(line, f"{name!r} must be an integer >= 1, got {value!r}")
    return value


def _parse_job_event(record: dict[str, Any], line: int) -> JobEvent:
    missing = _JOB_BASE_FIELDS - record.keys()
    if missing:
        raise TraceError(line, f"missing field(s) {sorted(missing)}")
    kind = record["event"]
    if kind not in JOB_EVENT_KINDS:
        raise TraceError(line, f"unknown job event {kind!r} (expected one of {list(JOB_EVENT_KINDS)})")
    t = _check_t(record, line)
    job = record["job"]
    if not isinstance(job, str) or not job:
        raise TraceError(line, f"'job' must be a non-empty string, got {job!r}")
    if kind == "cancel":
        unknown = record.keys() - _JOB_BASE_FIELDS
        if unknown:
            raise TraceError(line, f"unknown field(s) {sorted(unknown)} for a 'cancel' event")
        return JobEvent(t, job, kind)
    missing = _SUBMIT_REQUIRED - record.keys()
    if missing:
        raise TraceError(line, f"missing field(s) {sorted(missing)} for a 'submit' event")
    unknown = record.keys() - _JOB_BASE_FIELDS - _SUBMIT_REQUIRED - _SUBMIT_OPTIONAL
    if unknown:
        raise TraceError(line, f"unknown field(s) {sorted(unknown)} for a 'submit' event")
    job_kind = record["kind"]
    if job_kind not in JOB_KINDS:
        raise TraceError(line, f"'kind' must be one of {list(JOB_KINDS)}, got {job_kind!r}")
    model = record.get("model")
    if model is not None and (not isinstance(model, str) or not model):
        raise TraceError(line, f"'model' must be a non-empty string, got {model!r}")
    try:
        width, height = parse_resolution(record["resolution"])
    except ValueError as exc:
        raise TraceError(line, f"'resolution' {exc}") from None
    frames: int | None = None
    if job_kind == "video":
        if "frames" not in record:
            raise TraceError(line, "a video 'submit' needs 'frames'")
        frames = _positive_int(record, "frames", line)
    elif "frames" in record:
        raise TraceError(line, "'frames' is for videos only (an image is one frame)")
    steps = _positive_int(record, "steps", line)
    slo_s = record["slo_s"]
    if (
        isinstance(slo_s, bool)
        or not isinstance(slo_s, int | float)
        or not math.isfinite(slo_s)
        or slo_s <= 0
    ):
        raise TraceError(line, f"'slo_s' must be a finite number > 0, got {slo_s!r}")
    return JobEvent(t, job, kind, job_kind, model, width, height, frames, steps, float(slo_s))


def parse_trace(lines: Iterable[str], *, viewer_events: bool = False) -> tuple[dict, list[TraceEvent]]:
    """Parse and validate a session trace; raise :class:`TraceError` naming the first bad line.

    Blank lines are skipped (they still count for line numbers). A job line is an error that names
    :func:`parse_mixed_trace`: a session-only consumer must not drop jobs silently. Viewer marks
    are kept only with ``viewer_events`` (every other consumer sees the scheduler's vocabulary).
    """
    meta, events, _ = _parse_lines(lines, jobs_allowed=False, viewer_events=viewer_events)
    return meta, events


def parse_mixed_trace(
    lines: Iterable[str], *, viewer_events: bool = False
) -> tuple[dict, list[TraceEvent], list[JobEvent]]:
    """Parse a trace that may mix session and job events; each list keeps file order (sorted by ``t``)."""
    return _parse_lines(lines, jobs_allowed=True, viewer_events=viewer_events)


def _parse_lines(
    lines: Iterable[str], *, jobs_allowed: bool, viewer_events: bool = False
) -> tuple[dict, list[TraceEvent], list[JobEvent]]:
    meta: dict = {}
    events: list[TraceEvent] = []
    job_events: list[JobEvent] = []
    jobs: dict[str, str] = {}  # job -> "submitted" | "cancelled"
    state: dict[str, str] = {}  # session -> "idle" | "active" | "departed"
    last_t = -math.inf
    seen_content = False
    for number, raw in enumerate(lines, start=1):
        text = raw.strip()
        if not text:
            continue
        try:
            record = json.loads(text)
        except json.JSONDecodeError as exc:
            raise TraceError(number, f"bad JSON: {exc.msg}") from None
        if not isinstance(record, dict):
            raise TraceError(number, "each line must be a JSON object")
        if "meta" in record:
            if seen_content:
                raise TraceError(number, "'meta' is allowed only on the first line")
            if set(record) != {"meta"} or not isinstance(record["meta"], dict):
                raise TraceError(number, 'a meta line must be exactly {"meta": {...}}')
            meta = record["meta"]
            seen_content = True
            continue
        seen_content = True
        if "job" in record:
            if "session" in record:
                raise TraceError(number, "a line is either a session event or a job event, not both")
            if not jobs_allowed:
                raise TraceError(
                    number,
                    "job events need the mixed-trace reader (scheduling.sim.traces.parse_mixed_trace / "
                    "read_mixed_trace); this reader takes session events only",
                )
            job_event = _parse_job_event(record, number)
            if job_event.t < last_t:
                raise TraceError(number, f"time goes back ({job_event.t} after {last_t})")
            last_t = job_event.t
            _check_job_lifecycle(jobs, job_event, number)
            job_events.append(job_event)
            continue
        event = _parse_event(record, number)
        if event.t < last_t:
            raise TraceError(number, f"time goes back ({event.t} after {last_t})")
        last_t = event.t
        current = state.get(event.session)
        if event.event == "arrive":
            if current is not None:
                raise TraceError(number, f"duplicate arrive for session {event.session!r}")
            state[event.session] = "idle"
        elif current is None:
            raise TraceError(number, f"{event.event!r} for unknown session {event.session!r}")
        elif current == "departed":
            raise TraceError(number, f"{event.event!r} for departed session {event.session!r}")
        elif event.event == "depart":
            state[event.session] = "departed"
        elif event.event in VIEWER_EVENT_KINDS:
            if not viewer_events:
                continue
        else:
            state[event.session] = event.event
        events.append(event)
    return meta, events, job_events


def _check_job_lifecycle(jobs: dict[str, str], event: JobEvent, line: int) -> None:
    current = jobs.get(event.job)
    if event.event == "submit":
        if current is not None:
            raise TraceError(line, f"duplicate submit for job {event.job!r}")
        jobs[event.job] = "submitted"
    elif current is None:
        raise TraceError(line, f"cancel for unknown job {event.job!r}")
    elif current == "cancelled":
        raise TraceError(line, f"job {event.job!r} is already cancelled")
    else:
        jobs[event.job] = "cancelled"


def read_trace(path: str | Path, *, viewer_events: bool = False) -> tuple[dict, list[TraceEvent]]:
    with open(path, encoding="utf-8") as handle:
        return parse_trace(handle, viewer_events=viewer_events)


def read_mixed_trace(
    path: str | Path, *, viewer_events: bool = False
) -> tuple[dict, list[TraceEvent], list[JobEvent]]:
    with open(path, encoding="utf-8") as handle:
        return parse_mixed_trace(handle, viewer_events=viewer_events)


def _trace_lines(events: Iterable[TraceEvent | JobEvent], meta: dict | None) -> Iterator[str]:
    if meta is not None:
        yield json.dumps({"meta": meta}, sort_keys=True)
    for event in events:
        yield json.dumps(event.to_json())


def _write_lines(path_or_file: str | Path | IO[str], lines: list[str]) -> None:
    payload = "".join(line + "\n" for line in lines)
    if isinstance(path_or_file, str | Path):
        Path(path_or_file).write_text(payload, encoding="utf-8")
    else:
        path_or_file.write(payload)


def write_trace(
    path_or_file: str | Path | IO[str], events: Iterable[TraceEvent], meta: dict | None = None
) -> None:
    """Write a trace as JSON Lines. The events are validated first, so a written trace always reads back."""
    lines = list(_trace_lines(list(events), meta))
    parse_trace(lines)
    _write_lines(path_or_file, lines)


def merge_by_time(
    session_events: Iterable[TraceEvent], job_events: Iterable[JobEvent]
) -> list[TraceEvent | JobEvent]:
    """Both kinds in one time order, sessions first at equal times (the streams come first)."""
    keyed: list[tuple[float, int, int, TraceEvent | JobEvent]] = [
        (e.t, 0, i, e) for i, e in enumerate(session_events)
    ]
    keyed += [(e.t, 1, i, e) for i, e in enumerate(job_events)]
    return [e for *_, e in sorted(keyed, key=lambda k: k[:3])]


def write_mixed_trace(
    path_or_file: str | Path | IO[str],
    session_events: Iterable[TraceEvent],
    job_events: Iterable[JobEvent],
    meta: dict | None = None,
) -> None:
    """Write session and job events merged by ``t`` (at equal times sessions first: a stream's event
    is applied before a job's, as the streams come first); validated like :func:`write_trace`."""
    lines = list(_trace_lines(merge_by_time(session_events, job_events), meta))
    parse_mixed_trace(lines)
    _write_lines(path_or_file, lines)


# --------------------------------------------------------------------------------------------------
# Statistics (Table 11/12 style spans, Table 7 windows, Table 5 volatility).


def active_count_steps(events: Sequence[TraceEvent]) -> list[tuple[float, int]]:
    """The active-session count as a step function: ``[(t, count from t on), ...]``."""
    active: set[str] = set()
    steps: list[tuple[float, int]] = [(0.0, 0)]
    for event in events:
        if event.event == "active":
            active.add(event.session)
        elif event.event in ("idle", "depart"):
            active.discard(event.session)
        else:
            continue
        if steps[-1][0] == event.t:
            steps[-1] = (event.t, len(active))
        else:
            steps.append((event.t, len(active)))
    return steps


def active_load_steps(events: Sequence[TraceEvent]) -> list[tuple[float, float]]:
    """Like :func:`active_count_steps`, summing the sessions' ``load`` instead of counting them."""
    loads: dict[str, float] = {}
    active: dict[str, float] = {}
    steps: list[tuple[float, float]] = [(0.0, 0.0)]
    for event in events:
        if event.event == "arrive":
            loads[event.session] = event.load
            continue
        if event.event == "active":
            active[event.session] = loads[event.session]
        else:
            active.pop(event.session, None)
        total = float(sum(active.values()))
        if steps[-1][0] == event.t:
            steps[-1] = (event.t, total)
        else:
            steps.append((event.t, total))
    return steps


def _span_mean_max(steps: Sequence[tuple[float, float]], start: float, end: float) -> tuple[float, float]:
    """Time-average and maximum of a right-continuous step function over [start, end)."""
    area = 0.0
    peak = 0.0
    for index, (t, value) in enumerate(steps):
        t_next = steps[index + 1][0] if index + 1 < len(steps) else math.inf
        lo, hi = max(t, start), min(t_next, end)
        if hi > lo:
            area += value * (hi - lo)
            peak = max(peak, value)
    return area / (end - start), peak


def trace_duration(events: Sequence[TraceEvent], meta: dict | None = None) -> float:
    if meta and "duration_s" in meta:
        return float(meta["duration_s"])
    return events[-1].t if events else 0.0


def span_stats(events: Sequence[TraceEvent], span_s: float, duration_s: float) -> list[dict[str, float]]:
    """Per-span arrivals, departures, average and maximum active sessions.

    The last span is closed on the right (Table 11 reports ``[8, 10]``), so an event exactly at
    ``duration_s`` counts in it.
    """
    n_spans = max(1, math.ceil(duration_s / span_s - 1e-9))
    rows = [
        {"start_s": i * span_s, "end_s": min((i + 1) * span_s, duration_s), "arrivals": 0, "departures": 0}
        for i in range(n_spans)
    ]
    for event in events:
        if event.event not in ("arrive", "depart"):
            continue
        index = min(int(event.t // span_s), n_spans - 1)
        rows[index]["arrivals" if event.event == "arrive" else "departures"] += 1
    steps = active_count_steps(events)
    for row in rows:
        mean, peak = _span_mean_max(steps, row["start_s"], row["end_s"])
        row["avg_active"] = mean
        row["max_active"] = peak
    return rows


def activation_counts(events: Sequence[TraceEvent], bin_s: float, duration_s: float) -> list[int]:
    """Number of ``active`` events (new activations, first or re-activation) per ``bin_s`` bin."""
    n_bins = max(1, math.ceil(duration_s / bin_s - 1e-9))
    counts = [0] * n_bins
    for event in events:
        if event.event == "active":
            counts[min(int(event.t // bin_s), n_bins - 1)] += 1
    return counts


def activation_volatility(
    events: Sequence[TraceEvent], bin_s: float = 5.0, duration_s: float | None = None
) -> float:
    """TurboServe Table 5: std (population) of newly activated sessions per ``bin_s`` bin."""
    if duration_s is None:
        duration_s = trace_duration(events)
    counts = activation_counts(events, bin_s, duration_s)
    mean = sum(counts) / len(counts)
    return math.sqrt(sum((c - mean) ** 2 for c in counts) / len(counts))


def trace_stats(
    events: Sequence[TraceEvent], span_s: float = 60.0, duration_s: float | None = None, bin_s: float = 5.0
) -> dict[str, Any]:
    """Summary used by docs and reports: totals, peaks, activation volatility (std of activations per
    ``bin_s`` bin, TurboServe Table 5) and per-span rows (arrivals, departures, avg/max active,
    volatility within the span)."""
    if duration_s is None:
        duration_s = trace_duration(events)
    spans = span_stats(events, span_s, duration_s)
    counts = activation_counts(events, bin_s, duration_s)
    for row in spans:
        inside = [c for b, c in enumerate(counts) if row["start_s"] <= b * bin_s < row["end_s"]]
        if inside:
            mean = sum(inside) / len(inside)
            row["volatility"] = math.sqrt(sum((c - mean) ** 2 for c in inside) / len(inside))
        else:
            row["volatility"] = 0.0
    steps = active_count_steps(events)
    load_steps = active_load_steps(events)
    mean_active, peak_active = _span_mean_max(steps, 0.0, duration_s) if duration_s > 0 else (0.0, 0.0)
    _, peak_load = _span_mean_max(load_steps, 0.0, duration_s) if duration_s > 0 else (0.0, 0.0)
    return {
        "duration_s": duration_s,
        "sessions": sum(1 for e in events if e.event == "arrive"),
        "arrivals": sum(1 for e in events if e.event == "arrive"),
        "departures": sum(1 for e in events if e.event == "depart"),
        "activations": sum(1 for e in events if e.event == "active"),
        "mean_active": mean_active,
        "peak_active": peak_active,
        "peak_active_load": peak_load,
        "peak_to_mean": (peak_active / mean_active) if mean_active else 0.0,
        "volatility": activation_volatility(events, bin_s, duration_s),
        "volatility_bin_s": bin_s,
        "spans": spans,
    }
