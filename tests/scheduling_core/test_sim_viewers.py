"""The viewer rule in the lab (scheduling.sim.viewers): a trace's viewer marks become the idle,
active and depart events the platform's rule records, and `simulate --viewer-grace-s` costs them."""

from __future__ import annotations

import io
import json

import pytest
from django.core.management import call_command
from django.core.management.base import CommandError

from scheduling.sim.traces import TraceError, TraceEvent, parse_trace, write_trace
from scheduling.sim.viewers import viewer_rule


def ev(t, kind, session="s1"):
    return TraceEvent(float(t), session, kind)


def summary(events):
    return [(e.t, e.session, e.event) for e in events]


WATCHED_THEN_GONE = [ev(0, "arrive"), ev(1, "active"), ev(10, "viewer_leave"), ev(500, "depart")]


def test_without_the_rule_the_marks_are_dropped_and_nothing_else_changes():
    events, report = viewer_rule(WATCHED_THEN_GONE, grace_s=None, timeout_s=None)
    assert summary(events) == [(0, "s1", "arrive"), (1, "s1", "active"), (500, "s1", "depart")]
    assert report.to_json() == {"idled": 0, "ended": 0, "resumed": 0}


def test_a_viewer_gone_idles_the_session_after_the_grace_and_ends_it_after_the_timeout():
    events, report = viewer_rule(WATCHED_THEN_GONE, grace_s=30, timeout_s=100)
    assert summary(events) == [
        (0, "s1", "arrive"),
        (1, "s1", "active"),
        (40, "s1", "idle"),
        (140, "s1", "depart"),
    ]
    assert report.to_json() == {"idled": 1, "ended": 1, "resumed": 0}


def test_a_return_inside_the_grace_changes_nothing():
    trace = [
        ev(0, "arrive"),
        ev(1, "active"),
        ev(10, "viewer_leave"),
        ev(39, "viewer_return"),
        ev(90, "depart"),
    ]
    events, report = viewer_rule(trace, grace_s=30, timeout_s=100)
    assert summary(events) == [(0, "s1", "arrive"), (1, "s1", "active"), (90, "s1", "depart")]
    assert report.idled == 0


def test_a_return_after_the_grace_resumes_the_session_and_the_grace_restarts():
    trace = [
        ev(0, "arrive"),
        ev(1, "active"),
        ev(10, "viewer_leave"),
        ev(60, "viewer_return"),
        ev(70, "viewer_leave"),
        ev(300, "depart"),
    ]
    events, report = viewer_rule(trace, grace_s=30, timeout_s=None)
    assert summary(events) == [
        (0, "s1", "arrive"),
        (1, "s1", "active"),
        (40, "s1", "idle"),
        (60, "s1", "active"),
        (100, "s1", "idle"),
        (300, "s1", "depart"),
    ]
    assert report.to_json() == {"idled": 2, "ended": 0, "resumed": 1}


def test_a_session_its_user_paused_is_not_resumed_by_a_viewer_but_times_out():
    trace = [ev(0, "arrive"), ev(1, "active"), ev(5, "idle"), ev(10, "viewer_leave"), ev(20, "viewer_return")]
    trace += [ev(30, "viewer_leave"), ev(400, "depart")]
    events, report = viewer_rule(trace, grace_s=30, timeout_s=100)
    assert summary(events) == [
        (0, "s1", "arrive"),
        (1, "s1", "active"),
        (5, "s1", "idle"),
        (130, "s1", "depart"),
    ]
    assert report.to_json() == {"idled": 0, "ended": 1, "resumed": 0}


def test_sessions_are_independent_and_the_output_stays_sorted():
    trace = [ev(0, "arrive", "a"), ev(0, "arrive", "b"), ev(1, "active", "a"), ev(1, "active", "b")]
    trace += [ev(2, "viewer_leave", "a"), ev(50, "depart", "a"), ev(50, "depart", "b")]
    events, _ = viewer_rule(trace, grace_s=10, timeout_s=None)
    assert summary(events) == [
        (0, "a", "arrive"),
        (0, "b", "arrive"),
        (1, "a", "active"),
        (1, "b", "active"),
        (12, "a", "idle"),
        (50, "a", "depart"),
        (50, "b", "depart"),
    ]


def test_readers_drop_the_marks_unless_asked_and_check_their_session():
    lines = [
        '{"t": 0, "session": "s1", "event": "arrive"}',
        '{"t": 1, "session": "s1", "event": "viewer_leave"}',
    ]
    assert [e.event for e in parse_trace(lines)[1]] == ["arrive"]
    assert [e.event for e in parse_trace(lines, viewer_events=True)[1]] == ["arrive", "viewer_leave"]
    with pytest.raises(TraceError, match="unknown session"):
        parse_trace(['{"t": 0, "session": "s9", "event": "viewer_return"}'])


def test_simulate_with_the_rule_costs_less_when_viewers_leave(tmp_path):
    events = [ev(0, "arrive", f"s{i}") for i in range(4)] + [ev(1, "active", f"s{i}") for i in range(4)]
    events += [ev(5, "viewer_leave", f"s{i}") for i in range(4)]
    events += [ev(600, "depart", f"s{i}") for i in range(4)]
    trace = tmp_path / "viewers.jsonl"
    write_trace(trace, events, meta={"name": "viewers", "duration_s": 600.0})

    def run(**rule):
        out = io.StringIO()
        call_command(
            "simulate", trace=str(trace), profile="h100-1.3b", max_gpus=4, json=True, stdout=out, **rule
        )
        return json.loads(out.getvalue())

    plain, ruled = run(), run(viewer_grace_s=30.0, idle_timeout_s=120.0)
    assert "viewer_rule" not in plain
    assert ruled["viewer_rule"] == {
        "grace_s": 30.0,
        "idle_timeout_s": 120.0,
        "idled": 4,
        "ended": 4,
        "resumed": 0,
    }
    assert ruled["gpu_seconds"] < plain["gpu_seconds"]
    with pytest.raises(CommandError, match="viewer-grace-s"):
        run(viewer_grace_s=-1.0)
