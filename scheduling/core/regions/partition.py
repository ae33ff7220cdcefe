"""Per-region TurboServe under a global router: one snapshot, one policy and one decision per region.

The decision pipeline (``scheduling.core.pipeline``, run by the live scheduler and the simulator)
hands this module the whole pool's ``Snapshot`` plus the regions as plain data (``RegionLayout``:
which region each GPU and each session is in, each region's GPU limits) and gets back one
``Decision`` per region. Nothing here knows the database.

- ``partition_snapshot``: a GPU is in its region; a session on a GPU (executing or migrating) is in
  that GPU's region, any other session (queued, suspended) in its own routed region. So placement,
  rebalancing, consolidation and scale-in of one region only ever see, move and use that region's
  GPUs, and a session found running outside its region (placed before the router moved it) stays
  until its next idle period; it is placed in its own region at its next activation. Each region's
  GPU types carry the region's limit as ``availability`` (the policy's ``cheapest_type`` never adds
  beyond it); ``max_gpus`` is what the other regions leave of the pool's maximum; the warm minimum
  ``min_gpus`` counts every region's GPUs and any shortfall is kept in the default (local) region.
- ``decide_by_region``: each region's policy decides on its own snapshot (the event goes to the
  region of its session, ``pipeline.route_event``; the others decide a tick), then ``spill_queued`` re-routes the sessions a
  region had to queue: an active user waiting for memory is placed at once on a GPU with room in the
  nearest other region within its RTT budget (``alternatives``, nearest first, given by the caller),
  rather than waiting one provisioning delay (30–45 s) for its own region to grow. Only when no
  region within the budget has room does it wait in its own region's queue, whose scale-out (within
  the region's limits) it triggers. A region that lost queued sessions to another decides again
  without them (from the same policy state), so its autoscaler does not buy GPUs for load that left.
- ``regions_to_zero``: a region with no demand and a forecast of none (judged by the caller) gives
  back its GPUs down to its minimum, where TurboServe alone keeps a region's last ready GPU; it
  scales out again through its own policy when a session is routed there.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, field, replace
from functools import cached_property

from ..policy import Policy
from ..types import Decision, Event, GpuTypeSpec, Snapshot

_EPS = 1e-9
LIVE_GPU = ("provisioning", "ready", "draining")


@dataclass(frozen=True)
class RegionLayout:
    """The regions as plain names and numbers: the region of each session (its routed one) and of
    each GPU, each region's GPU limits (type -> most GPUs) and, for each session that may wait for a
    GPU, the regions within its RTT budget, nearest first. An id the layout does not name is in
    ``default``, the local region (the live loop passes ``gpu.models.Region.DEFAULT_NAME``); the
    empty layout is a pool in one region."""

    default: str = "local"
    session_region: Mapping[str, str] = field(default_factory=dict)
    gpu_region: Mapping[str, str] = field(default_factory=dict)
    gpu_limits: Mapping[str, Mapping[str, int]] = field(default_factory=dict)
    alternatives: Mapping[str, Sequence[str]] = field(default_factory=dict)

    @cached_property
    def one_region(self) -> bool:
        """Every GPU and session is in ``default``, which has no GPU limits: the pool is its own
        partition (``partition_snapshot``)."""
        return _one_region(self.session_region, self.gpu_region, self.gpu_limits, self.default, ())


def partition_snapshot(
    snapshot: Snapshot,
    *,
    session_region: Mapping[str, str],
    gpu_region: Mapping[str, str],
    gpu_limits: Mapping[str, Mapping[str, int]],
    default: str,
    include: Collection[str] = (),
) -> dict[str, Snapshot]:
    """One snapshot per region (the default region always, others when they hold a GPU or a
    session, or are in ``include``: a region at zero whose predictive floor asks for GPUs); ids
    missing from ``session_region``/``gpu_region`` are in ``default``. A pool wholly in ``default``,
    which has no limits of its own, is its own partition: ``snapshot`` itself, not a copy (the same
    snapshot a rebuild would give, without the O(pool) rebuild in the simulator's every decision)."""
    if _one_region(session_region, gpu_region, gpu_limits, default, include):
        return {default: snapshot}
    gpus_in: dict[str, list] = {default: []}
    for gid, gpu in snapshot.gpus.items():
        gpus_in.setdefault(gpu_region.get(gid, default), []).append(gpu)
    sessions_in: dict[str, list] = {}
    for sid, session in snapshot.sessions.items():
        if session.state == "executing":
            region = gpu_region.get(session.gpu or "", default)
        else:
            region = session_region.get(sid, default)
        sessions_in.setdefault(region, []).append(session)
    live = {r: sum(g.status in LIVE_GPU for g in gpus) for r, gpus in gpus_in.items()}
    total_live = sum(live.values())
    out = {}
    for region in sorted(set(gpus_in) | set(sessions_in) | set(include)):
        out[region] = Snapshot.build(
            time=snapshot.time,
            sessions=sessions_in.get(region, ()),
            gpus=gpus_in.get(region, ()),
            gpu_types=_limited(snapshot.gpu_types, gpu_limits.get(region, {})),
            min_gpus=max(0, snapshot.min_gpus - (total_live - live[default])) if region == default else 0,
            max_gpus=max(0, snapshot.max_gpus - (total_live - live.get(region, 0))),
        )
    return out


def _one_region(
    session_region: Mapping[str, str],
    gpu_region: Mapping[str, str],
    gpu_limits: Mapping[str, Mapping[str, int]],
    default: str,
    include: Collection[str],
) -> bool:
    return (
        not gpu_limits.get(default)
        and all(r == default for r in include)
        and all(r == default for r in gpu_region.values())
        and all(r == default for r in session_region.values())
    )


def _limited(gpu_types: Mapping[str, GpuTypeSpec], limits: Mapping[str, int]) -> dict[str, GpuTypeSpec]:
    """The types with the region's limit as their availability (the tighter of the two)."""
    out = {}
    for name, spec in gpu_types.items():
        limit = limits.get(name)
        if limit is not None and (spec.availability is None or limit < spec.availability):
            spec = replace(spec, availability=limit)
        out[name] = spec
    return out


@dataclass
class _Room:
    """What a ready GPU holds once its region's decision is applied."""

    spec: GpuTypeSpec
    count: int
    bytes: int
    load: float

    def fits(self, state_bytes: int) -> bool:
        """Memory for one more session (the hard limit; K is only the latency target)."""
        return (
            self.count + 1 <= self.spec.session_limit()
            and self.bytes + state_bytes <= self.spec.bytes_limit()
        )

    def take(self, load: float, state_bytes: int, sign: int = 1) -> None:
        self.count += sign
        self.bytes += sign * state_bytes
        self.load += sign * load


def _room(snapshot: Snapshot, decision: Decision) -> dict[str, _Room]:
    """Ready GPUs not drained by ``decision``, with their sessions after it (suspends, migrations
    and assignments applied)."""
    sessions = snapshot.sessions
    room = {
        gid: _Room(
            snapshot.spec(gid), len(snapshot.residents[gid]), snapshot.gpu_bytes[gid], snapshot.gpu_load[gid]
        )
        for gid, gpu in snapshot.gpus.items()
        if gpu.status == "ready" or gid in decision.undrain
    }

    def shift(sid: str, gid: str | None, sign: int) -> None:
        if gid in room:
            room[gid].take(sessions[sid].load, sessions[sid].state_bytes, sign)

    for sid in decision.suspend:
        shift(sid, sessions[sid].gpu, -1)
    for move in decision.migrations:
        shift(move.session, move.src, -1)
        shift(move.session, move.dst, +1)
    for sid, gid in decision.assign:
        shift(sid, gid, +1)
    for gid in decision.drain:
        room.pop(gid, None)
    return room


def spill_queued(
    snapshots: Mapping[str, Snapshot],
    decisions: Mapping[str, Decision],
    alternatives: Mapping[str, Sequence[str]],
) -> tuple[dict[str, Decision], dict[str, str]]:
    """Place each queued session with ``alternatives`` (other regions within its RTT budget, nearest
    first) on the GPU of the first of them that has room after that region's decision: below K
    first, then the lowest resulting latency (TurboServe's assignment rule, Eq. 3, within one
    region). A region that queues sessions of its own gives none of its room away. Returns the
    decisions with those sessions moved from one region's ``queue`` to another's ``assign``, and
    session -> new region."""
    rooms = {r: _room(snapshots[r], d) for r, d in decisions.items()}
    assign = {r: list(d.assign) for r, d in decisions.items()}
    queue = {r: list(d.queue) for r, d in decisions.items()}
    rerouted: dict[str, str] = {}
    for region in sorted(decisions):
        for sid in decisions[region].queue:
            s = snapshots[region].sessions[sid]
            for other in alternatives.get(sid, ()):
                if other == region or other not in rooms or decisions[other].queue:
                    continue  # a region queueing its own sessions has no room to give
                gid = _best_room(rooms[other], s.load, s.state_bytes)
                if gid is None:
                    continue
                rooms[other][gid].take(s.load, s.state_bytes)
                assign[other].append((sid, gid))
                queue[region].remove(sid)
                rerouted[sid] = other
                break
    out = {r: replace(d, assign=tuple(assign[r]), queue=tuple(queue[r])) for r, d in decisions.items()}
    return out, rerouted


def _best_room(room: Mapping[str, _Room], load: float, state_bytes: int) -> str | None:
    best = None
    for gid in sorted(room):
        r = room[gid]
        if not r.fits(state_bytes):
            continue
        after = r.load + load
        key = (after > r.spec.capacity + _EPS, r.spec.latency_ms(after), gid)
        if best is None or key < best:
            best = key
    return best[2] if best else None


def decide_by_region(
    policies: Mapping[str, Policy],
    snapshots: Mapping[str, Snapshot],
    events: Mapping[str, Event],
    *,
    alternatives: Mapping[str, Sequence[str]],
) -> tuple[dict[str, Decision], dict[str, str]]:
    """Each region's decision (``policies``, ``snapshots`` and the ``events`` their policies observe,
    by region), with queued sessions re-routed by ``spill_queued``; returns the decisions and session
    -> new region. A region whose queued sessions went elsewhere decides again without them, from the
    state its policy had before this event (so the event is observed once). One region has nowhere to
    spill to: its decision is its policy's."""
    if len(snapshots) == 1:
        return {r: policies[r].decide(s, events[r]) for r, s in snapshots.items()}, {}
    states = {r: policies[r].state_dict() for r in snapshots}
    decisions = {r: policies[r].decide(s, events[r]) for r, s in sorted(snapshots.items())}
    spilled, rerouted = spill_queued(snapshots, decisions, alternatives)
    for region, snapshot in sorted(snapshots.items()):
        gone = [sid for sid in decisions[region].queue if sid in rerouted]
        if not gone:
            continue
        policies[region].load_state_dict(states[region])
        # It queued, so it took no spilled session (``spill_queued``): its new decision is whole.
        spilled[region] = policies[region].decide(_without(snapshot, gone), events[region])
    return spilled, rerouted


def _without(snapshot: Snapshot, gone: Sequence[str]) -> Snapshot:
    """The region's snapshot without the sessions that left it, its predictive floor kept. Its jobs'
    fields are not carried over: so it was before the pipeline, and carrying them changes decisions
    (a behaviour change for its own issue, not this refactor's)."""
    rebuilt = Snapshot.build(
        time=snapshot.time,
        sessions=[s for sid, s in snapshot.sessions.items() if sid not in gone],
        gpus=snapshot.gpus.values(),
        gpu_types=snapshot.gpu_types,
        min_gpus=snapshot.min_gpus,
        max_gpus=snapshot.max_gpus,
    )
    # The waiting order and the spare-only sessions as the fair share left them (issue 29): without
    # tenants the order is the one the rebuild gives (arrival), so this changes nothing then.
    return replace(
        rebuilt,
        floor_load=snapshot.floor_load,
        pending=tuple(sid for sid in snapshot.pending if sid not in gone),
        spare_only=snapshot.spare_only.difference(gone),
    )


def regions_to_zero(
    snapshots: Mapping[str, Snapshot],
    decisions: Mapping[str, Decision],
    *,
    idle: Collection[str],
    minimum: Mapping[str, int],
) -> dict[str, Decision]:
    """Each region of ``idle`` (no demand forecast) that holds no session (executing, parked or
    queued) and no job, and whose decision adds nothing, releases its booting and ready GPUs beyond
    ``minimum`` (default 0): newest booting first, then ready ones by name. The runtime stops a
    released GPU through the provisioner that started it; the region's next session (routed there)
    is queued and scales it out again. Other regions' decisions are returned unchanged."""
    out = dict(decisions)
    for region in sorted(idle):
        snapshot, decision = snapshots.get(region), decisions.get(region)
        if snapshot is None or decision is None or snapshot.sessions or snapshot.job_gpus:
            continue
        if decision.add_gpus or decision.assign or decision.undrain or snapshot.job_demand_gpus > _EPS:
            continue
        gone = set(decision.release)
        kept = [
            gid
            for gid, gpu in snapshot.gpus.items()
            if gpu.status in ("provisioning", "ready") and gid not in gone and gid not in decision.drain
        ]
        surplus = len(kept) - minimum.get(region, 0)
        if surplus <= 0:
            continue
        order = sorted(
            kept,
            key=lambda g: (snapshot.gpus[g].status != "provisioning", -snapshot.gpus[g].requested_at, g),
        )
        out[region] = replace(
            decision,
            release=(*decision.release, *order[:surplus]),
            target_budget=max(0, decision.target_budget - surplus),
        )
    return out
