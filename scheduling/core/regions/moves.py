"""Whether a live session should move to another region: the saving against the switching cost.

One rule for the simulator (``policies.TortaPolicy._move_overloaded``) and the live scheduler
(``scheduling.live.regions.running_sessions_move``), so the two cannot drift apart
(``docs/regions.md``, "Moves").

A move pays when what it saves over the chunks it is counted for beats its switching cost ×
``switch_penalty``:

- **saving** per chunk = the session's own latency change (RTT and the overload stretch of the
  source against the target's after it arrives) + the stretch its neighbours in the source shed +
  a price term in ms-equivalents (the router's ``w_price`` × the price difference per load unit; the
  simulator's TORTA passes 0), times the chunks until the source's booting GPUs relieve it or the
  session is expected to end;
- **switching cost** = the session's state crossing the WAN (bytes over the link's bandwidth) plus one
  RTT for the user to reconnect: the stall of its first chunk in the new region.

Hysteresis (``PastMove``): a session that moved less than ``cooldown_s`` ago does not move again, and
a move back to the region it last left is charged that earlier switch as well as its own — a plan
that flips between slots would otherwise pay for the same pair of switches over and over.

Pure Python (no numpy needed): both callers pass plain numbers.
"""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass


@dataclass(frozen=True)
class MoveCase:
    """One candidate move of one session from a source to a target region.

    Loads are in load units (a session's ``load``), capacities the ready capacity (Σ K) of each
    region, latencies in ms. ``source_load``/``target_load`` are the regions' loads now (the session
    counted in the source). ``neighbours``: the other sessions in the source, each of which sheds
    the stretch the move removes. ``chunks``: how many of the session's chunks the saving lasts.
    ``price_ms_per_chunk``: the price saving per chunk in ms-equivalents (0: latency only)."""

    load: float
    source_load: float
    source_capacity: float
    target_load: float
    target_capacity: float
    source_rtt_ms: float
    target_rtt_ms: float
    neighbours: int
    chunk_ms: float
    chunks: float
    price_ms_per_chunk: float = 0.0


@dataclass(frozen=True)
class PastMove:
    """A session's last move: how long ago it ended (s), the region it left, and its switching cost."""

    age_s: float
    source: Hashable
    switch_cost_ms: float


@dataclass(frozen=True)
class MoveVerdict:
    saving_ms: float
    switch_cost_ms: float  # the move's own switching cost (the stall it causes)
    pays: bool
    charged_ms: float = 0.0  # what the saving must beat: its own switch, plus the previous one on a move back
    held: str = ""  # "cooldown": the session moved too recently to be considered


def switch_cost_ms(*, state_bytes: float, wan_gbps: float, rtt_ms: float) -> float:
    """The stall a move adds to the session's next chunk: its state over the WAN, then one RTT."""
    return state_bytes * 8.0 / (wan_gbps * 1e9) * 1000.0 + rtt_ms


def stretch(load: float, capacity: float) -> float:
    """How much slower than at capacity a region's chunks run (the simulator's pooled model)."""
    return max(1.0, load / max(capacity, 1e-9))


def move_saving_ms(case: MoveCase) -> float:
    """The latency (and price, in ms-equivalents) a move saves over ``case.chunks`` chunks."""
    stretch_before = stretch(case.source_load, case.source_capacity)
    stretch_after = stretch(case.source_load - case.load, case.source_capacity)
    old_latency = case.source_rtt_ms + case.chunk_ms * stretch_before
    new_latency = case.target_rtt_ms + case.chunk_ms * stretch(
        case.target_load + case.load, case.target_capacity
    )
    return case.chunks * (
        (old_latency - new_latency)
        + case.neighbours * case.chunk_ms * (stretch_before - stretch_after)
        + case.price_ms_per_chunk
    )


def move_verdict(
    case: MoveCase,
    *,
    switch_cost_ms: float,
    switch_penalty: float = 1.0,
    target: Hashable | None = None,
    last_move: PastMove | None = None,
    cooldown_s: float = 0.0,
) -> MoveVerdict:
    """Move only when the saving beats the switching cost × ``switch_penalty`` (strictly).

    With the session's ``last_move``: held when it ended less than ``cooldown_s`` ago; a move to
    ``target`` == the region it then left is charged both switches (the round trip's)."""
    saving = move_saving_ms(case)
    charged = switch_cost_ms
    if last_move is not None and target is not None and target == last_move.source:
        charged += last_move.switch_cost_ms
    if last_move is not None and last_move.age_s < cooldown_s:
        return MoveVerdict(saving, switch_cost_ms, False, charged, held="cooldown")
    return MoveVerdict(saving, switch_cost_ms, saving > switch_penalty * charged, charged)


# -- the live scheduler's slot: which running sessions move ------------------------------------


@dataclass(frozen=True)
class RegionNow:
    """A region as the slot's moves see it: ready capacity (Σ K) and the load on it, when its
    booting GPUs would cover its overload (``relief_s``, None: none are booting), a price per load
    unit in ms-equivalents (the router's price term), the RTT from each origin, and how many more
    sessions its ready workers' memory holds (``free_sessions``)."""

    capacity: float
    load: float
    price_ms: float
    rtt_ms: dict[str, float]
    free_sessions: int
    relief_s: float | None = None
    sessions: int = 0


@dataclass(frozen=True)
class RunningSession:
    id: str
    origin: str
    region: str
    load: float
    state_bytes: float
    last_move: PastMove | None = None  # its last completed cross-region move (hysteresis)


@dataclass(frozen=True)
class MoveSettings:
    rtt_budget_ms: float
    chunk_ms: float
    chunk_period_s: float
    horizon_s: float  # how long a moved session is expected to go on (the simulator's 300 s default)
    limit: int  # at most this many moves a slot (REGION_MOVES_PER_SLOT)
    wan_gbps: float
    wan_gbps_pairs: dict[tuple[str, str], float]  # (source, target) -> Gbit/s, overriding wan_gbps
    switch_penalty: float = 1.0
    cooldown_s: float = 0.0  # a session moved less than this ago stays (REGION_MOVE_COOLDOWN_S)

    def bandwidth(self, source: str, target: str) -> float:
        pairs = self.wan_gbps_pairs
        return pairs.get((source, target), pairs.get((target, source), self.wan_gbps))


@dataclass(frozen=True)
class RegionMove:
    session: str
    source: str
    target: str
    why: str  # "overload" (the source's load exceeds its ready capacity) or "plan" (its origin's excess)
    saving_ms: float
    switch_cost_ms: float  # its own (recorded on the Migration, summed by the audit)
    charged_ms: float = 0.0  # what the saving beat: its own switch, plus the previous one on a move back


def running_moves(
    regions: dict[str, RegionNow],
    sessions: list[RunningSession],
    settings: MoveSettings,
    *,
    excess: dict[tuple[str, str], float] | None = None,
) -> list[RegionMove]:
    """The slot's moves of running sessions across regions (the simulator's step 6, for live state).

    Sources, in this order: each overloaded region (load above its ready capacity), its heaviest
    sessions first, while it stays overloaded; then sessions whose origin the routing plan wants to
    shed from their region (``excess[(origin, region)]``: load routed there beyond the plan's share,
    at least the session's). A candidate target is another region within the session's RTT budget
    whose ready capacity has room for the session (and memory for one more), least utilised after
    it, then nearest; for a plan move it must be below the plan's share for that origin by at least
    the session's load. A session moves only when ``move_verdict`` says the saving beats the
    switching cost (``switch_cost_ms`` over the pair's WAN bandwidth, plus the previous switch on a
    move back to the region the session last left), and never within ``settings.cooldown_s`` of its
    last move; at most ``settings.limit`` moves. Loads are updated after each move, so later decisions see the earlier ones."""
    excess = dict(excess or {})
    load = {name: r.load for name, r in regions.items()}
    count = {name: r.sessions for name, r in regions.items()}
    free = {name: r.free_sessions for name, r in regions.items()}
    moved: set[str] = set()
    out: list[RegionMove] = []

    def overloaded(name: str) -> bool:
        return load[name] > regions[name].capacity + 1e-9

    def target_for(s: RunningSession, plan: bool) -> str | None:
        best, best_key = None, None
        for name, r in sorted(regions.items()):
            rtt = r.rtt_ms.get(s.origin)
            if name == s.region or rtt is None or rtt > settings.rtt_budget_ms or free[name] < 1:
                continue
            if load[name] + s.load > r.capacity + 1e-9:
                continue
            if plan and -excess.get((s.origin, name), 0.0) < s.load - 1e-9:
                continue
            key = ((load[name] + s.load) / r.capacity, rtt, name)
            if best_key is None or key < best_key:
                best, best_key = name, key
        return best

    def consider(s: RunningSession, why: str) -> None:
        source = regions[s.region]
        target = target_for(s, why == "plan")
        if target is None or s.origin not in source.rtt_ms:
            return
        t = regions[target]
        relief = source.relief_s if source.relief_s is not None else settings.horizon_s
        verdict = move_verdict(
            MoveCase(
                load=s.load,
                source_load=load[s.region],
                source_capacity=source.capacity,
                target_load=load[target],
                target_capacity=t.capacity,
                source_rtt_ms=source.rtt_ms[s.origin],
                target_rtt_ms=t.rtt_ms[s.origin],
                neighbours=max(0, count[s.region] - 1),
                chunk_ms=settings.chunk_ms,
                chunks=min(relief, settings.horizon_s) / settings.chunk_period_s,
                price_ms_per_chunk=(source.price_ms - t.price_ms) * s.load,
            ),
            switch_cost_ms=switch_cost_ms(
                state_bytes=s.state_bytes,
                wan_gbps=settings.bandwidth(s.region, target),
                rtt_ms=t.rtt_ms[s.origin],
            ),
            switch_penalty=settings.switch_penalty,
            target=target,
            last_move=s.last_move,
            cooldown_s=settings.cooldown_s,
        )
        if not verdict.pays:
            return
        out.append(
            RegionMove(
                s.id, s.region, target, why, verdict.saving_ms, verdict.switch_cost_ms, verdict.charged_ms
            )
        )
        moved.add(s.id)
        load[s.region] -= s.load
        load[target] += s.load
        count[s.region] -= 1
        count[target] += 1
        free[s.region] += 1
        free[target] -= 1
        excess[(s.origin, s.region)] = excess.get((s.origin, s.region), 0.0) - s.load
        excess[(s.origin, target)] = excess.get((s.origin, target), 0.0) + s.load

    by_load = sorted(sessions, key=lambda s: (-s.load, s.id))
    for name in sorted(regions):
        for s in by_load:
            if len(out) >= settings.limit or not overloaded(name):
                break
            if s.region == name and s.id not in moved:
                consider(s, "overload")
    for s in by_load:
        if len(out) >= settings.limit:
            break
        if (
            s.id not in moved
            and s.region in regions
            and excess.get((s.origin, s.region), 0.0) >= s.load - 1e-9
        ):
            consider(s, "plan")
    return out
