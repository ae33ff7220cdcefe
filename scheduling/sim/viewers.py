"""The platform's viewer rule (``sessions/viewers.py``, docs/architecture.md "Sessions nobody
watches") applied to a trace, so simulated costs include it: the same pure rule
(``contracts.viewer_rule.unwatched_deadline``), driven by the trace's viewer marks.

A trace marks a session's last viewer leaving (``viewer_leave``) and one coming back
(``viewer_return``); a session is watched from its arrival until its first ``viewer_leave``. With
the rule on, the marks become the events the live platform would record:

- active and unwatched for ``grace_s`` (measured from the later of the leave and its last
  activation) → ``idle`` at that moment;
- idle and unwatched for ``timeout_s`` (from the later of the leave and the moment it went idle)
  → ``depart`` at that moment, and the session's later events are dropped;
- a return to a session the rule made idle, while its user is active → ``active`` again; a user's
  own ``active`` while unwatched also activates it (as an API ``resume``) and restarts the grace.

A return strictly inside the grace changes nothing. ``None`` for a setting turns its rule off;
with both off the marks are only dropped (the trace's own activity, as before the rule).
"""

from __future__ import annotations

import math
from collections import defaultdict
from dataclasses import dataclass, field

from contracts.viewer_rule import IDLE, unwatched_deadline
from scheduling.sim.traces import VIEWER_EVENT_KINDS, TraceEvent


@dataclass
class ViewerRuleReport:
    """What the rule did to a trace: sessions it made idle (counted per idling) and ended."""

    idled: int = 0
    ended: int = 0
    resumed: int = 0
    ended_sessions: list[str] = field(default_factory=list)

    def to_json(self) -> dict:
        return {"idled": self.idled, "ended": self.ended, "resumed": self.resumed}


@dataclass
class _Session:
    user_active: bool = False
    active: bool = False  # what the scheduler sees
    rule_idle: bool = False
    watched: bool = True
    since: float = 0.0  # its last activation, or the moment it went idle
    gone_since: float = 0.0
    departed: bool = False


def viewer_rule(
    events: list[TraceEvent], *, grace_s: float | None, timeout_s: float | None
) -> tuple[list[TraceEvent], ViewerRuleReport]:
    """``events`` (file order, viewer marks included) with the rule applied and the marks removed."""
    report = ViewerRuleReport()
    if not grace_s and not timeout_s:
        return [e for e in events if e.event not in VIEWER_EVENT_KINDS], report
    end = max((e.t for e in events), default=0.0)
    by_session: dict[str, list[tuple[int, TraceEvent]]] = defaultdict(list)
    for order, event in enumerate(events):
        by_session[event.session].append((order, event))
    out: list[tuple[float, int, TraceEvent]] = []
    for session_events in by_session.values():
        out.extend(_one_session(session_events, grace_s or 0.0, timeout_s or 0.0, end, report))
    out.sort(key=lambda item: (item[0], item[1]))
    return [event for _, _, event in out], report


def _one_session(
    events: list[tuple[int, TraceEvent]],
    grace_s: float,
    timeout_s: float,
    end: float,
    report: ViewerRuleReport,
) -> list[tuple[float, int, TraceEvent]]:
    out: list[tuple[float, int, TraceEvent]] = []
    s = _Session()
    name = events[0][1].session

    def fire_until(t: float, order: int) -> None:
        """The rule's own events due strictly before ``t`` (a return exactly at the deadline wins)."""
        while not s.watched and not s.departed:
            due = unwatched_deadline(
                active=s.active, since=s.since, last_seen=s.gone_since, grace_s=grace_s, timeout_s=timeout_s
            )
            if due is None or due[1] >= t:
                return
            verdict, at = due
            if verdict == IDLE:
                out.append((at, order, TraceEvent(at, name, "idle")))
                s.active, s.rule_idle, s.since = False, True, at
                report.idled += 1
            else:
                out.append((at, order, TraceEvent(at, name, "depart")))
                s.departed = True
                report.ended += 1
                report.ended_sessions.append(name)

    for order, event in events:
        fire_until(event.t, order)
        if s.departed:
            break
        kind = event.event
        if kind == "arrive":
            s.since = event.t
            out.append((event.t, order, event))
        elif kind == "active":
            s.user_active, s.rule_idle = True, False
            if not s.active:
                s.active, s.since = True, event.t
                out.append((event.t, order, event))
        elif kind == "idle":
            s.user_active, s.rule_idle = False, False
            if s.active:
                s.active, s.since = False, event.t
                out.append((event.t, order, event))
        elif kind == "viewer_leave":
            if s.watched:
                s.watched, s.gone_since = False, event.t
        elif kind == "viewer_return":
            s.watched = True
            if s.rule_idle and s.user_active:
                s.rule_idle, s.active, s.since = False, True, event.t
                out.append((event.t, order, TraceEvent(event.t, name, "active")))
                report.resumed += 1
        else:  # depart
            s.departed = True
            out.append((event.t, order, event))
    # The rule keeps running to the trace's end for a session it has not seen depart.
    fire_until(math.nextafter(end, math.inf), events[-1][0])
    return out
