"""The GPU check's report: sections with a status and a reason, a time budget, targets, JSON and text.

A section is ``ok`` (its figures), ``skipped`` (why: the budget ran out, a prerequisite is missing,
the machine cannot run it — e.g. NCCL needs two GPUs) or ``failed`` (the error). Nothing is left out
silently: every section named in the plan appears in the report with its status.

The report is written after every section (``gpu-check.json`` replaced atomically, and the text
summary), so a run stopped by its caller's time limit still returns what it had measured.
"""

from __future__ import annotations

import json
import math
import os
import time
import traceback
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import numpy as np

REPORT_KIND = "streamserve-gpu-check"
REPORT_VERSION = 1
JSON_NAME = "gpu-check.json"
TEXT_NAME = "gpu-check.txt"
PROFILE_NAME = "gpu-profile.json"

OK, SKIPPED, FAILED = "ok", "skipped", "failed"


class SectionSkipped(Exception):
    """Raised inside a section: it cannot run here (the message says why); not a failure."""


def summarize_ms(values: Iterable[float]) -> dict[str, float | int | None]:
    """count / p50 / p99 / max / mean, as ``contracts.bench.summarize`` writes them (numpy's linear
    percentiles, 3 places); not imported from there because that module needs psutil, which the GPU
    machine does not have."""
    array = np.fromiter(values, dtype=float)
    if array.size == 0:
        return {"count": 0, "p50": None, "p99": None, "max": None, "mean": None}
    p50, p99 = np.percentile(array, [50, 99])
    return {
        "count": int(array.size),
        "p50": round(float(p50), 3),
        "p99": round(float(p99), 3),
        "max": round(float(array.max()), 3),
        "mean": round(float(array.mean()), 3),
    }


@dataclass
class Budget:
    """Wall-clock budget of the whole check, counted from the process start (imports included)."""

    total_s: float
    started: float = field(default_factory=time.monotonic)
    # Seconds already spent before `started` (interpreter start and imports, measured by the caller).
    spent_before_s: float = 0.0

    def elapsed(self) -> float:
        return self.spent_before_s + time.monotonic() - self.started

    def left(self) -> float:
        return self.total_s - self.elapsed()


@dataclass
class Section:
    name: str
    title: str
    status: str = "pending"
    reason: str | None = None
    seconds: float = 0.0
    figures: dict[str, Any] = field(default_factory=dict)

    def as_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"title": self.title, "status": self.status, "seconds": round(self.seconds, 3)}
        if self.reason is not None:
            out["reason"] = self.reason
        out["figures"] = self.figures
        return out


@dataclass
class Target:
    """One of the issue's targets on a GPU: what it asks, what was measured, whether it is met
    (None: not measured here, with the reason in ``note``)."""

    name: str
    wanted: str
    measured: float | None = None
    unit: str = ""
    met: bool | None = None
    note: str = ""

    def as_json(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "wanted": self.wanted,
            "measured": self.measured,
            "unit": self.unit,
            "met": self.met,
            "note": self.note,
        }


class Report:
    """The check's report; `run_section` runs one section under the budget and records its outcome."""

    def __init__(self, out_dir: Path, *, mode: str, budget: Budget) -> None:
        self.out_dir = out_dir
        self.mode = mode
        self.budget = budget
        self.started_at = datetime.now(UTC)
        self.environment: dict[str, Any] = {}
        self.sections: dict[str, Section] = {}
        self.targets: dict[str, Target] = {}
        self.profile: dict[str, Any] | None = None
        self.finished = False

    def plan(self, sections: Iterable[tuple[str, str]]) -> None:
        """Every section the check will try, in order, so the report names them all from the start."""
        for name, title in sections:
            self.sections[name] = Section(name, title)

    def skip(self, name: str, reason: str) -> None:
        section = self.sections[name]
        section.status, section.reason = SKIPPED, reason
        self.write()

    def run_section(
        self,
        name: str,
        body: Callable[[dict[str, Any]], Any],
        *,
        needs_s: float = 0.0,
        requires: Iterable[str] = (),
    ) -> bool:
        """Run ``body(figures)`` unless the budget has less than ``needs_s`` left or a section it
        requires did not succeed; returns whether it succeeded. Exceptions are recorded, not raised."""
        section = self.sections[name]
        for other in requires:
            if self.sections[other].status != OK:
                section.status = SKIPPED
                section.reason = f"needs section {other!r}, which is {self.sections[other].status}"
                self.write()
                return False
        left = self.budget.left()
        if left < needs_s:
            section.status = SKIPPED
            section.reason = f"time budget: {left:.0f} s left of {self.budget.total_s:.0f} s, this section needs ≈ {needs_s:.0f} s"
            self.write()
            return False
        started = time.monotonic()
        try:
            body(section.figures)
        except SectionSkipped as exc:
            section.status, section.reason = SKIPPED, str(exc)
        except Exception as exc:
            section.status = FAILED
            section.reason = f"{type(exc).__name__}: {exc}"
            section.figures["traceback"] = traceback.format_exc(limit=8).splitlines()[-12:]
        else:
            section.status = OK
        section.seconds = time.monotonic() - started
        self.write()
        return section.status == OK

    def target(self, name: str, wanted: str, *, unit: str = "") -> Target:
        target = self.targets.get(name)
        if target is None:
            target = self.targets[name] = Target(name, wanted, unit=unit)
        return target

    # -- output -------------------------------------------------------------------------------

    def as_json(self) -> dict[str, Any]:
        skipped = [
            {"section": s.name, "reason": s.reason} for s in self.sections.values() if s.status == SKIPPED
        ]
        failed = [
            {"section": s.name, "reason": s.reason} for s in self.sections.values() if s.status == FAILED
        ]
        return {
            "kind": REPORT_KIND,
            "version": REPORT_VERSION,
            "mode": self.mode,
            "dry_run": self.mode == "dry",
            "note": (
                "CPU dry run with tiny shapes: exercises the kit, measures nothing about GPUs"
                if self.mode == "dry"
                else "measured on the device named in environment.device"
            ),
            "started_at": self.started_at.isoformat(),
            "finished": self.finished,
            "wall_s": round(self.budget.elapsed(), 3),
            "budget_s": self.budget.total_s,
            "environment": self.environment,
            "targets": [t.as_json() for t in self.targets.values()],
            "sections": {name: s.as_json() for name, s in self.sections.items()},
            "skipped": skipped,
            "failed": failed,
            "profile": self.profile,
        }

    def write(self) -> None:
        self.out_dir.mkdir(parents=True, exist_ok=True)
        data = _finite(self.as_json())
        _replace(self.out_dir / JSON_NAME, json.dumps(data, indent=2, default=str, allow_nan=False) + "\n")
        _replace(self.out_dir / TEXT_NAME, render_text(data))
        if self.profile is not None:
            _replace(self.out_dir / PROFILE_NAME, json.dumps(self.profile, indent=2) + "\n")


def _replace(path: Path, text: str) -> None:
    temporary = path.with_name(f".{path.name}.{os.getpid()}")
    temporary.write_text(text)
    temporary.replace(path)


def _finite(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_finite(v) for v in value]
    return value


# -- the text summary -------------------------------------------------------------------------------


def _fmt(value: Any) -> str:
    if value is None:
        return "—"
    if isinstance(value, float):
        return f"{value:.4g}"
    return str(value)


def render_text(data: dict[str, Any]) -> str:
    """A short summary of the JSON report: the machine, the targets, each section's status and its
    headline figures (``figures["summary"]`` when a section gives one)."""
    env = data.get("environment", {})
    lines = [
        f"StreamServe GPU check ({data['mode']}{', CPU DRY RUN — not GPU figures' if data['dry_run'] else ''})",
        f"device: {env.get('device_name', '?')}  driver: {env.get('driver') or '—'}  "
        f"torch: {env.get('torch', '?')}  cuda: {env.get('cuda') or '—'}  python: {env.get('python', '?')}",
        f"wall: {data['wall_s']:.1f} s of a {data['budget_s']:.0f} s budget"
        f"{'' if data['finished'] else '  (NOT FINISHED: cut short or still running)'}",
        "",
        "targets:",
    ]
    for target in data["targets"]:
        verdict = {True: "met", False: "NOT met", None: "not measured"}[target["met"]]
        if target["met"] is None and target["measured"] is not None:
            verdict = "not judged"
        measured = _fmt(target["measured"]) + (f" {target['unit']}" if target["measured"] is not None else "")
        note = f"  ({target['note']})" if target["note"] else ""
        lines.append(f"  - {target['name']}: {verdict}; wanted {target['wanted']}, measured {measured}{note}")
    lines += ["", "sections:"]
    for name, section in data["sections"].items():
        head = f"  - {name} [{section['status']}] {section['seconds']:.1f} s"
        if section.get("reason"):
            head += f" — {section['reason']}"
        lines.append(head)
        for line in section["figures"].get("summary", []):
            lines.append(f"      {line}")
    return "\n".join(lines) + "\n"
