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

Pure Python (no numpy needed): both callers pass plain numbers.
"""

from __future__ import annotations

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
class MoveVerdict:
    saving_ms: float
    switch_cost_ms: float
    pays: bool


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


def move_verdict(case: MoveCase, *, switch_cost_ms: float, switch_penalty: float = 1.0) -> MoveVerdict:
    """Move only when the saving beats the switching cost × ``switch_penalty`` (strictly)."""
    saving = move_saving_ms(case)
    return MoveVerdict(saving, switch_cost_ms, saving > switch_penalty * switch_cost_ms)
