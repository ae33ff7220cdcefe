"""The static baselines as the TurboServe paper describes them (§7.1): where MAG and LAG part."""

from __future__ import annotations

from scheduling.core.policy import make_policy
from scheduling.core.types import GB, Event, GpuTypeSpec, GpuView, SessionView, Snapshot


def gpu_type(name: str, k: float, sessions: int, state_gb: float = 3.5) -> GpuTypeSpec:
    return GpuTypeSpec(
        name=name,
        gpu_type=name,
        capacity=k,
        latency_points=((0.0, 400.0), (2 * k, 1200.0)),
        price_per_hour=1.0,
        provisioning_delay_s=30.0,
        memory_limit_sessions=sessions,
        state_bytes=int(state_gb * GB),
    )


def place(name: str, snapshot: Snapshot) -> str:
    (assigned,) = make_policy(name).decide(snapshot, Event(snapshot.time, "tick")).assign
    return assigned[1]


def test_mag_places_by_free_memory_where_lag_places_by_load():
    # given an 80 GB-class GPU (K 8, 20 sessions of 3.5 GB) holding 2 sessions and a 141 GB-class one
    # (K 8, 40 sessions) holding 3, and a new active session
    types = {"small": gpu_type("small", 8, 20), "large": gpu_type("large", 8, 40)}
    resident = [SessionView(f"a{i}", 1, "executing", 1.0, "g-small", int(3.5 * GB)) for i in range(2)]
    resident += [SessionView(f"b{i}", 1, "executing", 1.0, "g-large", int(3.5 * GB)) for i in range(3)]
    snapshot = Snapshot.build(
        time=0.0,
        sessions=[*resident, SessionView("new", 1, "queued", 1.0, None, int(3.5 * GB))],
        gpus=[GpuView("g-small", "small", "ready"), GpuView("g-large", "large", "ready")],
        gpu_types=types,
    )
    # then LAG picks the GPU with less load per K, MAG the one with more free memory (129.5 vs 63 GB)
    assert place("lag", snapshot) == "g-small"
    assert place("mag", snapshot) == "g-large"


def test_mag_counts_state_bytes_not_sessions():
    # given two equal GPUs: one holds one heavy session (6 GB of state at load 2), the other two
    # light ones (1 GB each at load 0.5)
    types = {"t": gpu_type("t", 4, 10, state_gb=8.0)}
    sessions = [
        SessionView("heavy", 1, "executing", 2.0, "g1", 6 * GB),
        SessionView("l1", 1, "executing", 0.5, "g2", 1 * GB),
        SessionView("l2", 1, "executing", 0.5, "g2", 1 * GB),
        SessionView("new", 1, "queued", 1.0, None, 1 * GB),
    ]
    snapshot = Snapshot.build(
        time=0.0,
        sessions=sessions,
        gpus=[GpuView("g1", "t", "ready"), GpuView("g2", "t", "ready")],
        gpu_types=types,
    )
    # then MAG goes where more memory is free (g2: 2 GB used), whatever the session count; so does LAG
    # here (load 1 < 2) — and with the loads swapped LAG would follow the load, MAG the bytes
    assert place("mag", snapshot) == "g2"
    swapped = Snapshot.build(
        time=0.0,
        sessions=[
            SessionView("heavy", 1, "executing", 0.5, "g1", 6 * GB),
            SessionView("l1", 1, "executing", 1.0, "g2", 1 * GB),
            SessionView("l2", 1, "executing", 1.0, "g2", 1 * GB),
            SessionView("new", 1, "queued", 1.0, None, 1 * GB),
        ],
        gpus=[GpuView("g1", "t", "ready"), GpuView("g2", "t", "ready")],
        gpu_types=types,
    )
    assert place("lag", swapped) == "g1"
    assert place("mag", swapped) == "g2"
