"""The trace contract: every rejection names its line; write/read round-trips."""

from __future__ import annotations

import io
import json

import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from scheduling.sim.traces import (
    TraceError,
    TraceEvent,
    activation_volatility,
    parse_trace,
    read_trace,
    span_stats,
    trace_stats,
    write_trace,
)

GOOD = [
    '{"meta": {"name": "tiny"}}',
    '{"t": 0.0, "session": "a", "event": "arrive", "load": 2.0, "model": "wan-1.3b", "resolution": "832x480"}',
    '{"t": 1.0, "session": "a", "event": "active"}',
    '{"t": 1.0, "session": "b", "event": "arrive"}',
    '{"t": 2.5, "session": "b", "event": "active"}',
    '{"t": 4.0, "session": "a", "event": "idle"}',
    '{"t": 6.0, "session": "a", "event": "depart"}',
]


def test_parse_good_trace():
    meta, events = parse_trace(GOOD)
    assert meta == {"name": "tiny"}
    assert events[0] == TraceEvent(0.0, "a", "arrive", 2.0, "wan-1.3b", "832x480")
    assert events[2] == TraceEvent(1.0, "b", "arrive")  # default load 1.0
    assert [e.event for e in events] == ["arrive", "active", "arrive", "active", "idle", "depart"]


def _bad(line: str, before: list[str] | None = None) -> list[str]:
    head = before if before is not None else GOOD[:3]
    return [*head, line]


@pytest.mark.parametrize(
    ("lines", "line_no", "fragment"),
    [
        (_bad("{not json"), 4, "bad JSON"),
        (_bad("[1, 2]"), 4, "JSON object"),
        (_bad('{"t": 2, "session": "a"}'), 4, "missing field"),
        (_bad('{"t": 2, "session": "a", "event": "pause"}'), 4, "unknown event kind"),
        (_bad('{"t": 2, "session": "a", "event": "idle", "colour": 1}'), 4, "unknown field"),
        (_bad('{"t": 2, "session": "a", "event": "idle", "load": 2}'), 4, "unknown field"),
        (_bad('{"t": 0.5, "session": "a", "event": "idle"}'), 4, "time goes back"),
        (_bad('{"t": 2, "session": "zz", "event": "active"}'), 4, "unknown session"),
        (_bad('{"t": 2, "session": "a", "event": "arrive"}'), 4, "duplicate arrive"),
        (_bad('{"t": 2, "session": "c", "event": "arrive", "load": 0}'), 4, "'load'"),
        (_bad('{"t": 2, "session": "c", "event": "arrive", "load": -1.5}'), 4, "'load'"),
        (_bad('{"t": 2, "session": "c", "event": "arrive", "load": "heavy"}'), 4, "'load'"),
        (_bad('{"t": 2, "session": "c", "event": "arrive", "load": true}'), 4, "'load'"),
        (_bad('{"t": 2, "session": "c", "event": "arrive", "load": NaN}'), 4, "'load'"),
        (_bad('{"t": 2, "session": "c", "event": "arrive", "load": Infinity}'), 4, "'load'"),
        (_bad('{"t": "2", "session": "c", "event": "arrive"}'), 4, "'t'"),
        (_bad('{"t": -1, "session": "c", "event": "arrive"}', before=[]), 1, "'t'"),
        (_bad('{"t": 2, "session": "", "event": "arrive"}'), 4, "'session'"),
        (_bad('{"t": 2, "session": "c", "event": "arrive", "model": 7}'), 4, "'model'"),
        (_bad('{"meta": {"x": 1}}'), 4, "first line"),
        (_bad('{"meta": {"x": 1}, "t": 0}', before=[]), 1, "meta line"),
        ([*GOOD, '{"t": 7, "session": "a", "event": "active"}'], 8, "departed session"),
        ([*GOOD, '{"t": 7, "session": "a", "event": "depart"}'], 8, "departed session"),
    ],
)
def test_rejections_name_the_line(lines, line_no, fragment):
    with pytest.raises(TraceError) as info:
        parse_trace(lines)
    assert info.value.line == line_no
    assert fragment in info.value.message
    assert str(info.value).startswith(f"line {line_no}:")


def test_blank_lines_count_and_meta_may_follow_them():
    meta, events = parse_trace(["", '{"meta": {"k": 1}}', "", GOOD[1]])
    assert meta == {"k": 1} and len(events) == 1
    with pytest.raises(TraceError) as info:
        parse_trace(["", GOOD[1], "", "{oops"])
    assert info.value.line == 4


def test_trace_error_is_a_value_error():
    assert issubclass(TraceError, ValueError)


def test_round_trip_through_a_file(tmp_path):
    meta, events = parse_trace(GOOD)
    path = tmp_path / "t.jsonl"
    write_trace(path, events, meta)
    assert read_trace(path) == (meta, events)
    first = json.loads(path.read_text().splitlines()[0])
    assert first == {"meta": {"name": "tiny"}}


def test_round_trip_through_a_stream_without_meta():
    _, events = parse_trace(GOOD)
    buffer = io.StringIO()
    write_trace(buffer, events)
    assert parse_trace(buffer.getvalue().splitlines()) == ({}, events)


def test_write_refuses_an_invalid_trace(tmp_path):
    events = [TraceEvent(1.0, "a", "arrive"), TraceEvent(0.5, "a", "active")]
    with pytest.raises(TraceError) as info:
        write_trace(tmp_path / "bad.jsonl", events)
    assert info.value.line == 2
    assert not (tmp_path / "bad.jsonl").exists()


def test_span_stats_by_hand():
    # a active on [1, 4), b active on [2.5, 6): over [0, 6) the count is 0,1,2,1 on pieces.
    lines = [*GOOD[:6], '{"t": 6.0, "session": "a", "event": "depart"}']
    _, events = parse_trace(lines)
    rows = span_stats(events, span_s=3.0, duration_s=6.0)
    assert [r["arrivals"] for r in rows] == [2, 0]
    assert [r["departures"] for r in rows] == [0, 1]  # t == duration counts in the closed last span
    # [0,3): 0*1 + 1*1.5 + 2*0.5 = 2.5 -> 0.8333 ; [3,6): 2*1 + 1*2 = 4 -> 1.3333
    assert rows[0]["avg_active"] == pytest.approx(2.5 / 3)
    assert rows[1]["avg_active"] == pytest.approx(4 / 3)
    assert [r["max_active"] for r in rows] == [2, 2]


def test_volatility_is_std_of_activations_per_bin():
    lines = ['{"t": 0, "session": "a", "event": "arrive"}', '{"t": 0, "session": "b", "event": "arrive"}']
    lines += ['{"t": 1, "session": "a", "event": "active"}', '{"t": 2, "session": "b", "event": "active"}']
    lines += ['{"t": 9.9, "session": "a", "event": "idle"}']
    _, events = parse_trace(lines)
    # bins of 5 s over 10 s: activations [2, 0] -> population std 1.0
    assert activation_volatility(events, 5.0, 10.0) == pytest.approx(1.0)
    stats = trace_stats(events, span_s=5.0, duration_s=10.0)
    assert (
        stats["activations"] == 2 and stats["peak_active"] == 2 and stats["volatility"] == pytest.approx(1.0)
    )


def test_restating_the_current_activity_is_allowed():
    lines = [
        *GOOD[1:3],
        '{"t": 2.0, "session": "a", "event": "active"}',
        '{"t": 3.0, "session": "a", "event": "idle"}',
    ]
    lines.append('{"t": 3.5, "session": "a", "event": "idle"}')
    _, events = parse_trace(lines)
    assert [e.event for e in events] == ["arrive", "active", "active", "idle", "idle"]


@st.composite
def _valid_traces(draw):
    """Random valid traces: a small state machine over arrive/active/idle/depart."""
    n_steps = draw(st.integers(0, 40))
    t = 0.0
    state: dict[str, str] = {}
    events = []
    for k in range(n_steps):
        t += draw(st.sampled_from([0.0, 0.001, 0.5, 3.25]))
        live = sorted(s for s, v in state.items() if v != "gone")
        if not live or draw(st.integers(0, 3)) == 0:
            sid = f"s{k}"
            load = draw(st.sampled_from([1.0, 0.5, 2.0, 1.25]))
            model = draw(st.sampled_from([None, "wan-1.3b"]))
            events.append(TraceEvent(t, sid, "arrive", load, model, None))
            state[sid] = "idle"
            continue
        sid = draw(st.sampled_from(live))
        kind = draw(st.sampled_from(["active", "idle", "depart"]))
        events.append(TraceEvent(t, sid, kind))
        state[sid] = "gone" if kind == "depart" else kind
    meta = draw(st.none() | st.fixed_dictionaries({"name": st.text(max_size=5)}))
    return meta, events


@given(_valid_traces())
@settings(max_examples=60, deadline=None)
def test_any_valid_trace_round_trips(trace):
    meta, events = trace
    buffer = io.StringIO()
    write_trace(buffer, events, meta)
    assert parse_trace(buffer.getvalue().splitlines()) == (meta or {}, events)


@given(_valid_traces(), st.data())
@settings(max_examples=60, deadline=None)
def test_an_event_after_depart_is_rejected_at_its_line(trace, data):
    _, events = trace
    departed = [e for e in events if e.event == "depart"]
    assume(departed)
    victim = data.draw(st.sampled_from(departed))
    t_end = events[-1].t if events else 0.0
    bad = [
        *events,
        TraceEvent(t_end + 1.0, victim.session, data.draw(st.sampled_from(["active", "idle", "depart"]))),
    ]
    lines = [json.dumps(e.to_json()) for e in bad]
    with pytest.raises(TraceError) as info:
        parse_trace(lines)
    assert info.value.line == len(lines)
