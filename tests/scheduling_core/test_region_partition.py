"""Per-region planning in the pure core (``scheduling.core.regions.partition``): each region's
TurboServe sees, places on and scales only its own GPUs; a session its region cannot place goes to the
nearest region within its budget that can, else waits in its own region."""

from __future__ import annotations

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from scheduling.core.regions.partition import decide_by_region, partition_snapshot
from scheduling.core.turboserve import TurboServePolicy
from scheduling.core.types import Event, GpuTypeSpec, GpuView, SessionView, Snapshot


def spec(k: float = 4.0, mem: int = 2) -> GpuTypeSpec:
    return GpuTypeSpec(
        name="t",
        gpu_type="t",
        capacity=k,
        latency_points=((0.0, 100.0), (2 * k, 300.0)),
        price_per_hour=1.0,
        provisioning_delay_s=30.0,
        memory_limit_sessions=mem,
    )


def snapshot(sessions, gpus, *, min_gpus: int = 0, max_gpus: int = 100) -> Snapshot:
    return Snapshot.build(
        time=100.0,
        sessions=sessions,
        gpus=gpus,
        gpu_types={"t": spec()},
        min_gpus=min_gpus,
        max_gpus=max_gpus,
    )


def ready(gid: str) -> GpuView:
    return GpuView(id=gid, gpu_type="t", status="ready", ready_at=0.0)


def active(sid: str, gpu: str | None = None, load: float = 1.0) -> SessionView:
    return SessionView(id=sid, alpha=1, state="executing" if gpu else "queued", gpu=gpu, load=load, since=1.0)


GPU_REGION = {"e1": "east", "e2": "east", "w1": "west", "w2": "west"}


def plan(snap: Snapshot, session_region: dict, alternatives: dict | None = None, limits: dict | None = None):
    parts = partition_snapshot(
        snap, session_region=session_region, gpu_region=GPU_REGION, gpu_limits=limits or {}, default="local"
    )
    policies = {r: TurboServePolicy(rho_hat=0.7, cooldown_s=0.0, release_grace_s=0.0) for r in parts}
    ticks = dict.fromkeys(parts, Event(time=snap.time, kind="tick"))
    return parts, *decide_by_region(policies, parts, ticks, alternatives=alternatives or {})


def test_the_partition_follows_the_gpu_for_placed_sessions_and_the_route_for_waiting_ones():
    # given a session routed west but still running on an east GPU, and one waiting for west
    snap = snapshot([active("a", gpu="e1"), active("b")], [ready("e1"), ready("e2"), ready("w1")], min_gpus=2)
    parts = partition_snapshot(
        snap,
        session_region={"a": "west", "b": "west"},
        gpu_region=GPU_REGION,
        gpu_limits={"west": {"t": 3}},
        default="local",
    )
    # then the placed one is planned with east's GPUs, the waiting one with west's
    assert {r: sorted(p.sessions) for r, p in parts.items()} == {"east": ["a"], "local": [], "west": ["b"]}
    assert {r: sorted(p.gpus) for r, p in parts.items()} == {
        "east": ["e1", "e2"],
        "local": [],
        "west": ["w1"],
    }
    # and west's limit is its GPU type's availability; the pool's maximum is shared, and so is its
    # warm minimum: what the other regions hold counts, the local region keeps any shortfall
    assert (parts["west"].gpu_types["t"].availability, parts["east"].gpu_types["t"].availability) == (3, None)
    assert [parts[r].min_gpus for r in ("east", "local", "west")] == [0, 0, 0]
    big = partition_snapshot(
        snapshot([], [ready("e1")], min_gpus=3),
        session_region={},
        gpu_region=GPU_REGION,
        gpu_limits={},
        default="local",
    )
    assert big["local"].min_gpus == 2
    assert [parts[r].max_gpus for r in ("east", "local", "west")] == [99, 97, 98]


def test_a_session_is_placed_only_on_its_regions_gpus():
    # given an empty west GPU and two east GPUs with one session each
    snap = snapshot(
        [active("a", gpu="e1"), active("b", gpu="e2"), active("c")], [ready("e1"), ready("e2"), ready("w1")]
    )
    # when a third east session becomes active
    _, decisions, rerouted = plan(snap, {"a": "east", "b": "east", "c": "east"})
    # then it goes to an east GPU rather than the empty west one
    assert decisions["east"].assign in ((("c", "e1"),), (("c", "e2"),))
    assert decisions["west"].assign == () and rerouted == {}


def test_scale_in_is_per_region():
    # given east's two GPUs at ρ = 0.75 (ρ̂ = 0.7 ± 0.1) and west's two idle
    gpus = [ready("e1"), ready("e2"), ready("w1"), ready("w2")]
    snap = snapshot([active("a", gpu="e1", load=3.0), active("b", gpu="e2", load=3.0)], gpus)
    _, decisions, _ = plan(snap, {"a": "east", "b": "east"})
    # then west drains and releases one (TurboServe keeps a region's last ready GPU) while east keeps
    # both: on the whole pool (ρ_max 0.75) west's idle GPUs would not have counted
    assert (decisions["west"].drain, decisions["west"].release) == (("w1",), ("w1",))
    assert (decisions["east"].drain, decisions["east"].release) == ((), ())


def test_a_session_its_region_cannot_hold_goes_to_the_nearest_region_with_room():
    # given east's two GPUs full in memory (two sessions each, ρ = 0.75) and a fifth east session active
    residents = [active(f"s{i}", gpu=g, load=1.5) for i, g in enumerate(["e1", "e1", "e2", "e2"])]
    snap = snapshot([*residents, active("x", load=1.5)], [ready("e1"), ready("e2"), ready("w1")])
    routes = {s.id: "east" for s in residents} | {"x": "east"}
    # when west is within its RTT budget, then it runs there now, and east buys no GPU for it
    _, decisions, rerouted = plan(snap, routes, alternatives={"x": ["east", "west"]})
    assert rerouted == {"x": "west"}
    assert decisions["west"].assign == (("x", "w1"),)
    assert (decisions["east"].queue, decisions["east"].add_gpus) == ((), ())
    # and without a region within its budget it waits in east, which scales out for it
    _, decisions, rerouted = plan(snap, routes)
    assert (rerouted, decisions["east"].queue, decisions["east"].add_gpus) == ({}, ("x",), (("t", 1),))
    # but never beyond east's GPU limit
    _, decisions, _ = plan(snap, routes, limits={"east": {"t": 2}})
    assert (decisions["east"].queue, decisions["east"].add_gpus) == (("x",), ())


def test_a_region_that_queues_its_own_sessions_takes_none_from_another():
    # given both regions full: east's two GPUs and west's one hold two sessions each
    placed = [active(f"s{i}", gpu=g) for i, g in enumerate(["e1", "e1", "e2", "e2", "w1", "w1"])]
    snap = snapshot([*placed, active("x"), active("y")], [ready("e1"), ready("e2"), ready("w1")])
    routes = {s.id: GPU_REGION[s.gpu] for s in placed} | {"x": "east", "y": "west"}
    # when each region has one more active session, each allowed in the other
    _, decisions, rerouted = plan(snap, routes, alternatives={"x": ["west"], "y": ["east"]})
    # then neither moves: both wait in their own region
    assert rerouted == {}
    assert (decisions["east"].queue, decisions["west"].queue) == (("x",), ("y",))


REGIONS = ("east", "west", "local")


@st.composite
def regional_clusters(draw):
    """Up to six ready GPUs spread over three regions, sessions on them within memory or waiting."""
    gpu_region = {f"g{i}": draw(st.sampled_from(REGIONS)) for i in range(draw(st.integers(1, 6)))}
    sessions, routes, used = [], {}, dict.fromkeys(gpu_region, 0)
    for i in range(draw(st.integers(0, 14))):
        sid = f"s{i:02d}"
        gpu = draw(st.sampled_from([None, *gpu_region]))
        if gpu is not None and used[gpu] >= 2:
            gpu = None  # the memory limit: two sessions
        if gpu is not None:
            used[gpu] += 1
        alpha = draw(st.integers(0, 1)) if gpu is not None else 1
        sessions.append(
            SessionView(
                id=sid, alpha=alpha, state="executing" if gpu else "queued", gpu=gpu, load=1.0, since=1.0
            )
        )
        routes[sid] = gpu_region[gpu] if gpu else draw(st.sampled_from(REGIONS))
    alternatives = {s.id: draw(st.permutations(REGIONS)) for s in sessions if s.gpu is None}
    return snapshot(sessions, [ready(g) for g in gpu_region]), gpu_region, routes, alternatives


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(regional_clusters())
def test_no_session_is_placed_outside_its_region_and_no_gpu_over_memory(cluster):
    snap, gpu_region, routes, alternatives = cluster
    parts = partition_snapshot(
        snap, session_region=routes, gpu_region=gpu_region, gpu_limits={}, default="local"
    )
    policies = {r: TurboServePolicy(rho_hat=0.7) for r in parts}
    ticks = dict.fromkeys(parts, Event(time=snap.time, kind="tick"))
    decisions, rerouted = decide_by_region(policies, parts, ticks, alternatives=alternatives)
    resident = {g: list(snap.residents[g]) for g in gpu_region}
    for region, decision in decisions.items():
        for sid in decision.suspend:
            resident[snap.sessions[sid].gpu].remove(sid)
        for move in decision.migrations:
            # Rebalancing stays inside the region.
            assert gpu_region[move.src] == gpu_region[move.dst] == region
            resident[move.src].remove(move.session)
            resident[move.dst].append(move.session)
        for sid, gid in decision.assign:
            # A session starts in its routed region, or in the one it was re-routed to.
            assert gpu_region[gid] == region == rerouted.get(sid, routes[sid])
            resident[gid].append(sid)
    # Memory is never exceeded, and every active session is placed or waits exactly once.
    assert all(len(sessions) <= 2 for sessions in resident.values())
    queued = [sid for d in decisions.values() for sid in d.queue]
    placed = {sid for sessions in resident.values() for sid in sessions}
    assert len(queued) == len(set(queued)) and not set(queued) & placed
    assert {s.id for s in snap.sessions.values() if s.alpha} <= placed | set(queued)
    # A session is re-routed only to a region its alternatives allow, and only when its own was full.
    assert all(region in alternatives[sid] and region != routes[sid] for sid, region in rerouted.items())
