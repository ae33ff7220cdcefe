"""The viewer rule as one pure function (issue 31), shared by the live check (``sessions.viewers``)
and the simulator (``scheduling.sim.viewers``), so both apply the same rule rather than two copies.

A session nobody watches: active and unwatched for ``grace_s`` → idle; idle and unwatched for
``timeout_s`` → ended. "Unwatched for" counts from the later of the last viewer seen and ``since``:
the moment the session last became active, or, when idle, the later of that and the moment it went
idle. A setting of 0 (or None) turns its rule off. Times are seconds on one clock (epoch seconds
live, trace seconds in the simulator).
"""

from __future__ import annotations

from typing import Literal

Verdict = Literal["idle", "end"]
IDLE: Verdict = "idle"
END: Verdict = "end"


def unwatched_deadline(
    *, active: bool, since: float, last_seen: float | None, grace_s: float | None, timeout_s: float | None
) -> tuple[Verdict, float] | None:
    """What the rule does to an unwatched session, and from when: ``(verdict, at)``; None when the
    rule that would apply is off. The caller applies it once ``at`` has passed, if nobody watched
    in between."""
    start = since if last_seen is None else max(since, last_seen)
    if active:
        return (IDLE, start + grace_s) if grace_s else None
    return (END, start + timeout_s) if timeout_s else None
