"""Property tests (hypothesis) of the scheduling contract, for every built-in policy.

Given a random consistent snapshot and event, apply the decision to a model of the cluster and check:
the hard memory limit is never exceeded; K is exceeded only when no ready GPU has room below it;
every active session is placed whenever memory allows; a GPU is released only when empty; each
session has one owner; identical inputs give identical decisions.
"""

from __future__ import annotations

import math

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from scheduling.core.policy import BUILTIN_POLICIES, make_policy
from scheduling.core.types import GB, Event, GpuTypeSpec, GpuView, SessionView, Snapshot


def _spec(name: str, k: int, mem: int, price: float) -> GpuTypeSpec:
    return GpuTypeSpec(
        name=name,
        gpu_type=name,
        capacity=float(k),
        latency_points=((0.0, 200.0), (float(2 * k), 200.0 + 60.0 * 2 * k)),
        price_per_hour=price,
        provisioning_delay_s=20.0,
        memory_limit_sessions=mem,
        memory_limit_bytes=mem * 4 * GB,
        state_bytes=2 * GB,
    )


@st.composite
def cluster(draw, heterogeneous: bool = True, tight: bool = False):
    n_types = draw(st.integers(1, 2)) if heterogeneous else 1
    types = {}
    for i in range(n_types):
        k = draw(st.integers(2, 6))
        # tight: memory holds fewer sessions than K, so the hard limit binds on every decision.
        mem = draw(st.integers(1, 3)) if tight else k + draw(st.integers(0, 4))
        types[f"t{i}"] = _spec(f"t{i}", k, mem, draw(st.sampled_from([1.0, 2.5, 4.0])))
    n_gpus = draw(st.integers(1, 4))
    gpus = []
    for j in range(n_gpus):
        status = draw(st.sampled_from(["ready", "ready", "ready", "provisioning", "draining"]))
        gpus.append(GpuView(f"g{j}", draw(st.sampled_from(sorted(types))), status, requested_at=float(j)))
    used = {g.id: [0, 0] for g in gpus}
    sessions = []
    loads = [1.0] if not heterogeneous else [0.5, 1.0, 1.5, 2.0]
    # Up to ~40 sessions on at most 4 GPUs: memory limits are often binding.
    for i in range(draw(st.integers(0, 40))):
        alpha = draw(st.sampled_from([0, 1, 1]))
        load = draw(st.sampled_from(loads))
        state_bytes = int(load * 2 * GB)
        state = draw(
            st.sampled_from(["executing", "suspended", "queued"] if alpha else ["executing", "suspended"])
        )
        gpu = None
        if state == "executing":
            hosts = [
                g
                for g in gpus
                if g.status in ("ready", "draining")
                and used[g.id][0] + 1 <= types[g.gpu_type].memory_limit_sessions
                and used[g.id][1] + state_bytes <= types[g.gpu_type].memory_limit_bytes
            ]
            if not hosts:
                state = "suspended" if not alpha else "queued"
            else:
                host = draw(st.sampled_from(hosts))
                gpu = host.id
                used[gpu][0] += 1
                used[gpu][1] += state_bytes
        sessions.append(SessionView(f"s{i:02d}", alpha, state, load, gpu, state_bytes, since=float(i)))
    time = draw(st.floats(0.0, 500.0))
    snap = Snapshot.build(time=time, sessions=sessions, gpus=gpus, gpu_types=types, min_gpus=1, max_gpus=10)
    kinds = ["tick", "gpu_ready"]
    if sessions:
        kinds += ["active", "idle", "arrive"]
    kind = draw(st.sampled_from(kinds))
    session = (
        draw(st.sampled_from([s.id for s in sessions])) if kind in ("active", "idle", "arrive") else None
    )
    return snap, Event(time, kind, session=session)


def apply(snap: Snapshot, decision):
    """Apply a decision to a plain placement model; assert the structural rules on the way."""
    placement = {s.id: s.gpu for s in snap.sessions.values() if s.state == "executing"}
    status = {g.id: g.status for g in snap.gpus.values()}
    touched = [*decision.suspend, *(m.session for m in decision.migrations), *(a[0] for a in decision.assign)]
    assert len(touched) == len(set(touched)), "a session appears in two actions"
    for gid in decision.undrain:
        status[gid] = "ready"
    for sid in decision.suspend:
        assert sid in placement
        del placement[sid]
    for m in decision.migrations:
        assert placement.get(m.session) == m.src and status[m.dst] == "ready" and m.src != m.dst
        assert m.kappa_ms >= 0
        placement[m.session] = m.dst
    for sid, gid in decision.assign:
        assert sid not in placement, "one owner per session"
        assert status[gid] == "ready"
        placement[sid] = gid
    for sid in decision.queue:
        assert sid not in placement and snap.sessions[sid].alpha == 1
    for gid in decision.drain:
        assert status[gid] == "ready"
        status[gid] = "draining"
    for gid in decision.release:
        assert gid not in placement.values(), "released GPU still has residents"
        status[gid] = "released"
    return placement, status


def check_invariants(snap: Snapshot, decision, placement, status, check_k: bool):
    count: dict[str, int] = {}
    used: dict[str, int] = {}
    load: dict[str, float] = {}
    for sid, gid in placement.items():
        s = snap.sessions[sid]
        count[gid] = count.get(gid, 0) + 1
        used[gid] = used.get(gid, 0) + s.state_bytes
        load[gid] = load.get(gid, 0.0) + s.load
    for gid in count:
        spec = snap.spec(gid)
        assert count[gid] <= spec.memory_limit_sessions, "hard memory limit (sessions) exceeded"
        assert used[gid] <= spec.memory_limit_bytes, "hard memory limit (bytes) exceeded"

    def has_memory(gid: str, sid: str) -> bool:
        spec = snap.spec(gid)
        s = snap.sessions[sid]
        return (
            count.get(gid, 0) + 1 <= spec.memory_limit_sessions
            and used.get(gid, 0) + s.state_bytes <= spec.memory_limit_bytes
        )

    ready = sorted(g for g, st_ in status.items() if st_ == "ready")
    for s in snap.sessions.values():
        if s.alpha and s.id not in placement:
            assert s.id in decision.queue, f"active session {s.id} neither placed nor queued"
            assert not any(has_memory(g, s.id) for g in ready), f"{s.id} queued although a GPU has memory"
    if check_k:
        for gid in ready:
            spec = snap.spec(gid)
            if load.get(gid, 0.0) <= spec.capacity + 1e-9:
                continue
            smallest = min(snap.sessions[sid].load for sid, g in placement.items() if g == gid)
            for other in ready:
                if other == gid:
                    continue
                room = load.get(other, 0.0) + smallest <= snap.spec(other).capacity + 1e-9
                assert not (room and count.get(other, 0) + 1 <= snap.spec(other).memory_limit_sessions), (
                    f"{gid} above K while {other} has room below K"
                )


@pytest.mark.parametrize("name", BUILTIN_POLICIES)
@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=cluster())
def test_contract_holds_for_every_builtin_policy(name, data):
    snap, event = data
    decision = make_policy(name).decide(snap, event)
    placement, status = apply(snap, decision)
    check_invariants(snap, decision, placement, status, check_k=False)


@pytest.mark.parametrize("name", BUILTIN_POLICIES)
@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=cluster(tight=True))
def test_memory_limit_binds_and_queue_only_when_full(name, data):
    snap, event = data
    decision = make_policy(name).decide(snap, event)
    placement, status = apply(snap, decision)
    check_invariants(snap, decision, placement, status, check_k=False)


def _undrain_case() -> tuple[Snapshot, Event]:
    """Found by Hypothesis: g0 above K with recently placed residents (no rebalancing move), g1
    filled to K by the assignments, and g2 draining: the scale-out undrains g2, which then has room
    below K that g0 must use."""
    t = _spec("t0", 2, 3, 1.0)
    sessions = [
        SessionView("s00", 1, "executing", 1.0, "g0", 2 * GB, since=0.0),
        SessionView("s01", 1, "suspended", 1.0, None, 2 * GB, since=1.0),
        SessionView("s02", 1, "suspended", 1.0, None, 2 * GB, since=2.0),
        SessionView("s03", 1, "executing", 1.0, "g0", 2 * GB, since=3.0),
        SessionView("s04", 1, "executing", 1.0, "g0", 2 * GB, since=4.0),
    ]
    gpus = [
        GpuView("g0", "t0", "ready", requested_at=0.0),
        GpuView("g1", "t0", "ready", requested_at=1.0),
        GpuView("g2", "t0", "draining", requested_at=2.0),
    ]
    snap = Snapshot.build(
        time=0.0, sessions=sessions, gpus=gpus, gpu_types={"t0": t}, min_gpus=1, max_gpus=10
    )
    return snap, Event(time=0.0, kind="tick")


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=cluster(heterogeneous=False))
@example(data=_undrain_case())
def test_turboserve_exceeds_k_only_when_no_ready_gpu_has_room(data):
    snap, event = data
    decision = make_policy("turboserve").decide(snap, event)
    placement, status = apply(snap, decision)
    check_invariants(snap, decision, placement, status, check_k=True)


@pytest.mark.parametrize("name", ["turboserve", "base", "lag", "mag", "turboserve-no-migration"])
@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=cluster())
def test_decisions_are_deterministic(name, data):
    snap, event = data
    first = make_policy(name).decide(snap, event)
    second = make_policy(name).decide(snap, event)
    assert first == second


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=cluster())
def test_turboserve_releases_only_empty_gpus_and_counts_budget(data):
    snap, event = data
    decision = make_policy("turboserve").decide(snap, event)
    _placement, status = apply(snap, decision)
    live = sum(1 for s in status.values() if s in ("provisioning", "ready"))
    added = sum(n for _, n in decision.add_gpus)
    assert decision.target_budget == live + added
    assert math.isfinite(decision.signals.rho_max)
