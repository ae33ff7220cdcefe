"""Demand by origin: a seeded diurnal generator and traces whose ``arrive`` events carry ``"origin"``.

A region trace is an ordinary trace (``scheduling.sim.traces``, ``docs/traces.md``) whose ``arrive``
lines also carry ``"origin": "<name>"``. The shared trace parser stays as it is: :func:`parse_region_trace`
takes the origin off each ``arrive`` line, checks it against the topology, and hands the rest to
:func:`scheduling.sim.traces.parse_trace`, so every other rule of the format still applies.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from scheduling.sim.traces import TraceError, TraceEvent, parse_trace

from .topology import Topology


@dataclass(frozen=True)
class RegionTrace:
    meta: dict
    events: list[TraceEvent]
    origin_of: dict[str, str]  # session -> origin name
    duration_s: float


def parse_region_trace(lines: Iterable[str], topology: Topology) -> RegionTrace:
    """Parse a trace with origins; raise :class:`TraceError` naming the line (and ``origin``)."""
    known = set(topology.origin_names)
    origin_of: dict[str, str] = {}
    stripped: list[str] = []
    for number, raw in enumerate(lines, start=1):
        text = raw.strip()
        if text:
            try:
                record = json.loads(text)
            except json.JSONDecodeError as exc:
                raise TraceError(number, f"bad JSON: {exc.msg}") from None
            if isinstance(record, dict) and record.get("event") == "arrive":
                if "origin" not in record:
                    raise TraceError(number, "'origin' is required on every arrive event of a region trace")
                origin = record.pop("origin")
                if origin not in known:
                    raise TraceError(
                        number, f"'origin' {origin!r} is not an origin of topology {topology.name!r}"
                    )
                origin_of[str(record.get("session"))] = origin
                text = json.dumps(record)
            elif isinstance(record, dict) and "origin" in record:
                raise TraceError(number, "'origin' is allowed only on arrive events")
        stripped.append(text)
    meta, events = parse_trace(stripped)
    duration = float(meta.get("duration_s", events[-1].t if events else 0.0))
    return RegionTrace(meta, events, origin_of, duration)


def read_region_trace(path: str | Path, topology: Topology) -> RegionTrace:
    with open(path, encoding="utf-8") as handle:
        return parse_region_trace(handle, topology)


def write_region_trace(path: str | Path, trace: RegionTrace) -> None:
    lines = [json.dumps({"meta": trace.meta}, sort_keys=True)] if trace.meta else []
    for event in trace.events:
        record = event.to_json()
        if event.event == "arrive":
            record["origin"] = trace.origin_of[event.session]
        lines.append(json.dumps(record))
    Path(path).write_text("".join(line + "\n" for line in lines), encoding="utf-8")


@dataclass(frozen=True)
class DemandShape:
    duration_s: float = 6 * 3600.0  # TORTA §6.1: 6 hours (480 slots of 45 s)
    day_s: float = 3 * 3600.0  # one compressed "day" of the diurnal cycle (two in the paper's 6 h)
    mean_utilisation: float = 0.45  # mean offered load / total capacity of all regions at their limits
    diurnal_amplitude: float = 0.6  # peak = mean × (1 + a), trough = mean × (1 − a)
    mean_session_s: float = 240.0  # exponential session length
    loads: tuple[tuple[float, float], ...] = ((0.5, 0.5), (1.0, 0.3), (2.0, 0.2))  # (load, share)
    bursts: int = 6  # flash crowds: one origin's arrival rate × burst_factor for burst_s
    burst_factor: float = 3.0
    burst_s: float = 600.0


def arrival_rate(topology: Topology, shape: DemandShape, t: np.ndarray) -> np.ndarray:
    """Expected arrivals per second for every origin at times ``t`` (origins × len(t)), no bursts.

    Each origin's rate peaks at local mid-afternoon: its UTC offset shifts the phase by offset / 24 of
    a (compressed) day. Rates are set so the mean offered load is ``mean_utilisation`` of capacity.
    """
    weights = np.array([o.weight for o in topology.origins], dtype=float)
    weights = weights / weights.sum()
    mean_load = float(sum(load * share for load, share in shape.loads))
    total_load = shape.mean_utilisation * float(topology.max_capacity().sum())
    base = weights * total_load / (shape.mean_session_s * mean_load)  # arrivals/s per origin
    offsets = np.array([o.utc_offset_h for o in topology.origins]) / 24.0
    phase = 2 * math.pi * (t[None, :] / shape.day_s + offsets[:, None] - 0.375)
    return base[:, None] * (1.0 + shape.diurnal_amplitude * np.sin(phase))


def generate_demand(topology: Topology, shape: DemandShape, seed: int) -> RegionTrace:
    """Seeded diurnal sessions by origin: Poisson arrivals per second, exponential lengths, mixed loads,
    plus ``bursts`` flash crowds at random origins and times. Sessions are active from arrival to
    departure (no idle spells), so the offered load is what the GPUs must serve."""
    rng = np.random.default_rng(seed)
    seconds = np.arange(0.0, shape.duration_s, 1.0)
    rate = arrival_rate(topology, shape, seconds)
    for _ in range(shape.bursts):
        origin = int(rng.integers(len(topology.origins)))
        start = float(rng.uniform(0, shape.duration_s - shape.burst_s))
        inside = (seconds >= start) & (seconds < start + shape.burst_s)
        rate[origin, inside] *= shape.burst_factor
    counts = rng.poisson(rate)
    load_values = np.array([load for load, _ in shape.loads])
    load_p = np.array([share for _, share in shape.loads])
    load_p = load_p / load_p.sum()
    records: list[tuple[float, str, str, float]] = []
    origin_of: dict[str, str] = {}
    names = topology.origin_names
    index = 0
    for o, s in zip(*np.nonzero(counts), strict=True):
        for _ in range(int(counts[o, s])):
            t = float(s + rng.uniform(0, 1))
            length = float(rng.exponential(shape.mean_session_s))
            load = float(rng.choice(load_values, p=load_p))
            session = f"s{index}"
            index += 1
            origin_of[session] = names[o]
            records.append((t, session, "arrive", load))
            records.append((t, session, "active", load))
            records.append((min(t + length, shape.duration_s), session, "depart", load))
    order = {"arrive": 0, "active": 1, "depart": 2}
    records.sort(key=lambda r: (r[0], order[r[2]], r[1]))
    events = [
        TraceEvent(round(t, 3), session, kind, load if kind == "arrive" else 1.0)
        for t, session, kind, load in records
    ]
    meta = {"name": f"{topology.name}-diurnal", "seed": seed, "duration_s": shape.duration_s}
    return RegionTrace(meta, events, origin_of, shape.duration_s)


def origin_load_by_slot(trace: RegionTrace, topology: Topology, tick_s: float, slot_s: float) -> np.ndarray:
    """slots × origins: the mean active load per origin over each slot, sampled like the simulator does
    (at tick ``i`` the events before ``i · tick_s`` have happened). Routing cannot change it, so it is
    the truth a forecast of demand by origin is judged against (and what the oracle forecaster knows)."""
    index = {name: i for i, name in enumerate(topology.origin_names)}
    n_ticks = max(1, math.ceil(trace.duration_s / tick_s - 1e-9))
    samples = np.zeros((n_ticks, len(index)))
    loads: dict[str, float] = {}
    current = np.zeros(len(index))
    active: set[str] = set()
    events = trace.events
    cursor = 0
    for tick in range(n_ticks):
        while cursor < len(events) and events[cursor].t < tick * tick_s:
            event = events[cursor]
            cursor += 1
            origin = index[trace.origin_of[event.session]]
            if event.event == "arrive":
                loads[event.session] = event.load
            elif event.event == "active" and event.session not in active:
                active.add(event.session)
                current[origin] += loads[event.session]
            elif event.event in ("idle", "depart") and event.session in active:
                active.discard(event.session)
                current[origin] -= loads[event.session]
        samples[tick] = current
    per_slot = max(1, round(slot_s / tick_s))
    n_slots = n_ticks // per_slot
    return samples[: n_slots * per_slot].reshape(n_slots, per_slot, -1).mean(axis=1)
