"""``Snapshot.patched`` (the live loop's cached snapshot, issue 30) equals ``Snapshot.build`` on the
same sessions: every field, every order — for any sequence of arrivals, departures, placements,
moves, suspensions and activity changes."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from scheduling.core.types import GpuTypeSpec, GpuView, SessionView, Snapshot

GPUS = [GpuView(id=f"g{i}", gpu_type="t", status="ready") for i in range(4)]
TYPES = {
    "t": GpuTypeSpec(
        name="t",
        gpu_type="t",
        capacity=4.0,
        latency_points=((0.0, 400.0), (8.0, 1200.0)),
        price_per_hour=1.0,
        provisioning_delay_s=30.0,
        memory_limit_sessions=8,
    )
}
IDS = [f"s{i:02d}" for i in range(24)]


@st.composite
def views(draw, sid: str) -> SessionView:
    state = draw(st.sampled_from(["executing", "suspended", "queued"]))
    return SessionView(
        id=sid,
        alpha=draw(st.integers(0, 1)),
        state=state,
        load=draw(st.sampled_from([1.0, 0.5, 0.1, 2.0, 0.3])),
        gpu=draw(st.sampled_from([g.id for g in GPUS])) if state == "executing" else None,
        state_bytes=draw(st.integers(1, 5)) * 2**30,
        since=float(draw(st.integers(0, 5))),  # ties in ``since``: the id breaks them
    )


@st.composite
def pools(draw) -> dict[str, SessionView]:
    ids = draw(st.lists(st.sampled_from(IDS), unique=True, max_size=16))
    return {sid: draw(views(sid)) for sid in ids}


@st.composite
def changes(draw) -> dict[str, SessionView | None]:
    ids = draw(st.lists(st.sampled_from(IDS), unique=True, max_size=8))
    return {sid: draw(st.none() | views(sid)) for sid in ids}


def _build(sessions: dict[str, SessionView], time: float) -> Snapshot:
    return Snapshot.build(
        time=time, sessions=sessions.values(), gpus=GPUS, gpu_types=TYPES, min_gpus=1, max_gpus=9
    )


def _assert_identical(got: Snapshot, want: Snapshot) -> None:
    assert got == want
    # Equality of mappings ignores order; the policy's determinism does not.
    assert list(got.sessions) == list(want.sessions)
    assert {g: list(v) for g, v in got.residents.items()} == {g: list(v) for g, v in want.residents.items()}
    assert got.pending == want.pending and got.idle_resident == want.idle_resident
    assert [repr(x) for x in got.gpu_load.values()] == [repr(x) for x in want.gpu_load.values()]


@settings(max_examples=300, deadline=None)
@given(pools(), st.lists(changes(), min_size=1, max_size=4))
def test_a_patched_snapshot_equals_one_built_from_its_sessions(start, steps):
    sessions = dict(start)
    snapshot = _build(sessions, 0.0)
    for t, changed in enumerate(steps, start=1):
        for sid, view in changed.items():
            if view is None:
                sessions.pop(sid, None)
            else:
                sessions[sid] = view
        snapshot = snapshot.patched(time=float(t), changed=changed, min_gpus=1, max_gpus=9)
        _assert_identical(snapshot, _build(sessions, float(t)))


def test_a_patch_refuses_what_build_refuses():
    snapshot = _build({}, 0.0)
    with pytest.raises(ValueError, match="unknown GPU"):
        snapshot.patched(
            time=1.0, changed={"s": SessionView(id="s", alpha=1, state="executing", gpu="nowhere")}
        )
    with pytest.raises(ValueError, match="unknown state"):
        snapshot.patched(time=1.0, changed={"s": SessionView(id="s", alpha=1, state="lost")})
