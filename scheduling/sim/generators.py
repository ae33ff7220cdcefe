"""Seeded, deterministic session-trace generators (TurboServe Tables 5, 7, 11, 12; Poisson; diurnal).

Every generator returns ``(meta, events)`` in the format of :mod:`scheduling.sim.traces` and is a
pure function of its arguments: the same seed gives the same trace, byte for byte.

Activity model (see docs/traces.md): a session arrives idle, becomes active after a short think time,
then alternates active and idle periods whose lengths are heavy-tailed (Lomax/Pareto-II, finite
variance) until it departs. For the paper-shaped traces the arrival and departure counts per span are
reproduced exactly and the duty cycle (fraction of time active) of each span is calibrated so that the
average number of active sessions per span matches the paper's table; the Table 7 windows and the
Table 5 volatility segments control the active count directly.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np

from .traces import TraceEvent, activation_counts, active_count_steps, span_stats

# --------------------------------------------------------------------------------------------------
# Targets from the TurboServe paper (Appendix A/B).

# Table 12: per-minute arrivals, departures and average active sessions over 5 minutes.
TABLE12: dict[str, dict[str, tuple[float, ...]]] = {
    "T1": {
        "arrivals": (122, 130, 66, 22, 18),
        "departures": (44, 86, 88, 64, 38),
        "avg_active": (28.0, 56.2, 57.4, 37.4, 23.2),
    },
    "T2": {
        "arrivals": (218, 214, 248, 192, 204),
        "departures": (60, 124, 204, 196, 204),
        "avg_active": (61.0, 118.6, 147.6, 154.2, 149.4),
    },
    "T3": {
        "arrivals": (74, 148, 156, 264, 156),
        "departures": (10, 64, 126, 148, 214),
        "avg_active": (13.2, 49.4, 112.8, 121.4, 148.4),
    },
    "T4": {
        "arrivals": (500, 428, 308, 88, 80),
        "departures": (158, 266, 388, 236, 152),
        "avg_active": (118.4, 219.2, 268.0, 162.8, 101.8),
    },
    "T5": {
        "arrivals": (874, 862, 998, 762, 814),
        "departures": (238, 504, 810, 784, 814),
        "avg_active": (245.8, 475.2, 589.2, 616.8, 598.4),
    },
    "T6": {
        "arrivals": (296, 590, 626, 1062, 618),
        "departures": (36, 260, 502, 608, 846),
        "avg_active": (54.4, 198.4, 451.4, 487.2, 592.0),
    },
}

# Table 11 (motivation study, §3.2): 2-minute spans over 10 minutes.
TABLE11: dict[str, tuple[float, ...]] = {
    "arrivals": (31, 47, 30, 48, 44),
    "departures": (17, 24, 26, 39, 49),
    "avg_active": (10.36, 20.91, 19.30, 29.62, 33.49),
}

# Table 7: ten 30 s windows of the unseen fluctuating workload used for the per-window rho oracle.
TABLE7: dict[str, tuple[float, ...]] = {
    "avg_active": (32.00, 17.17, 7.67, 23.47, 51.23, 72.43, 12.43, 56.90, 22.30, 53.17),
    "max_active": (38, 18, 8, 28, 58, 77, 13, 68, 23, 73),
}

# Table 5: the ten profiling segments (volatility = std of new activations per 5 s bin).
TABLE5: tuple[tuple[int, float, int, int], ...] = (
    (1, 0.86, 7, 23),
    (2, 1.32, 11, 27),
    (3, 1.92, 15, 31),
    (4, 2.66, 19, 35),
    (5, 3.15, 23, 39),
    (6, 3.77, 27, 43),
    (7, 4.39, 31, 47),
    (8, 5.14, 35, 51),
    (9, 5.51, 39, 55),
    (10, 6.38, 43, 59),
)

PAPER_SHAPES = (*TABLE12, "table11")

# Heavy-tail index of active/idle period lengths (Lomax); > 2 keeps the variance finite.
PERIOD_TAIL_INDEX = 2.5


def _lomax_unit(rng: np.random.Generator, size: int | None = None):
    """Heavy-tailed variates with mean 1 (Lomax, tail index ``PERIOD_TAIL_INDEX``)."""
    return rng.pareto(PERIOD_TAIL_INDEX, size) * (PERIOD_TAIL_INDEX - 1.0)


# --------------------------------------------------------------------------------------------------
# Session population and the alternating active/idle process.


@dataclass
class _Session:
    sid: str
    arrive_t: float
    depart_t: float = math.inf
    load: float = 1.0
    model: str | None = None
    resolution: str | None = None
    toggles: list[tuple[float, str]] = field(default_factory=list)


LoadMix = Mapping[float, float] | Sequence[tuple[float, float]] | None


def _load_sampler(load_mix: LoadMix) -> tuple[np.ndarray, np.ndarray] | None:
    if not load_mix:
        return None
    pairs = list(load_mix.items()) if isinstance(load_mix, Mapping) else list(load_mix)
    loads = np.array([float(load) for load, _ in pairs])
    weights = np.array([float(w) for _, w in pairs])
    if np.any(loads <= 0) or not np.all(np.isfinite(loads)):
        raise ValueError("load_mix loads must be finite and > 0")
    if np.any(weights < 0) or weights.sum() <= 0:
        raise ValueError("load_mix weights must be >= 0 and not all zero")
    return loads, weights / weights.sum()


def _assign_loads(sessions: list[_Session], load_mix: LoadMix, rng: np.random.Generator) -> None:
    sampler = _load_sampler(load_mix)
    if sampler is None:
        return
    loads, probs = sampler
    picks = rng.choice(len(loads), size=len(sessions), p=probs)
    for session, pick in zip(sessions, picks, strict=True):
        session.load = float(loads[pick])


def _on_off_toggles(
    session: _Session,
    rng: np.random.Generator,
    duty: Callable[[float], float],
    mean_cycle_s: float,
    mean_think_s: float,
    horizon_s: float,
) -> list[tuple[float, str]]:
    """Alternate idle/active periods from arrival to departure (or the horizon).

    With duty cycle ``f = duty(t)`` at the start of a period, an active period has mean
    ``f * mean_cycle_s`` and an idle period ``(1 - f) * mean_cycle_s`` (both heavy-tailed), so the
    long-run fraction of time active is ``f`` and a full active+idle cycle lasts ``mean_cycle_s`` on
    average. The first activation follows a short think time after arrival (sessions arrive idle).
    """
    end = min(session.depart_t, horizon_s)
    toggles: list[tuple[float, str]] = []
    t = session.arrive_t + mean_think_s * float(_lomax_unit(rng))
    while t < end:
        toggles.append((t, "active"))
        f = min(max(duty(t), 1e-3), 0.999)
        t += mean_cycle_s * f * float(_lomax_unit(rng))
        if t >= end:
            break
        toggles.append((t, "idle"))
        f = min(max(duty(t), 1e-3), 0.999)
        t += mean_cycle_s * (1.0 - f) * float(_lomax_unit(rng))
    return toggles


def _events_from_sessions(sessions: Sequence[_Session], horizon_s: float) -> list[TraceEvent]:
    keyed: list[tuple[float, int, int, TraceEvent]] = []
    for index, session in enumerate(sessions):
        keyed.append(
            (
                session.arrive_t,
                0,
                index,
                TraceEvent(
                    session.arrive_t, session.sid, "arrive", session.load, session.model, session.resolution
                ),
            )
        )
        for t, kind in session.toggles:
            keyed.append((t, 1, index, TraceEvent(t, session.sid, kind)))
        if session.depart_t <= horizon_s:
            keyed.append((session.depart_t, 2, index, TraceEvent(session.depart_t, session.sid, "depart")))
    # Sort by time; at equal times arrivals first and departures last, then in session order.
    keyed.sort(key=lambda item: (item[0], item[1], item[2]))
    return [item[3] for item in keyed]


def _floor_ms(t: float) -> float:
    """Truncate to whole milliseconds. Truncating (not rounding) never pushes a time across a span or
    bin boundary, which are whole milliseconds, so per-span counts survive the conversion."""
    return math.floor(t * 1000.0) / 1000.0


def _round_times(sessions: Sequence[_Session]) -> None:
    """Times to milliseconds (readable files) while keeping each session's order strict."""
    for session in sessions:
        session.arrive_t = _floor_ms(session.arrive_t)
        last = session.arrive_t
        toggles = []
        for t, kind in session.toggles:
            rt = _floor_ms(t)
            if rt <= last:
                continue  # a period shorter than a millisecond: drop the pair member
            toggles.append((rt, kind))
            last = rt
        # Dropping one toggle can leave two equal kinds adjacent; keep only real transitions.
        cleaned: list[tuple[float, str]] = []
        for t, kind in toggles:
            if (cleaned and cleaned[-1][1] == kind) or (not cleaned and kind == "idle"):
                continue
            cleaned.append((t, kind))
        if session.depart_t != math.inf:
            session.depart_t = max(_floor_ms(session.depart_t), last)
            cleaned = [(t, k) for t, k in cleaned if t < session.depart_t]
        session.toggles = cleaned


# --------------------------------------------------------------------------------------------------
# Table 11/12: exact arrivals and departures per span, calibrated average activity.


def _span_skews(
    arrivals: Sequence[float], departures: Sequence[float], avg_active: Sequence[float], max_duty: float
) -> list[float]:
    """Per span, how much to skew arrivals early and departures late (exponent ``k >= 1``).

    With uniform times the mean population present in a span is ``P0 + (A - D) / 2``; a span whose
    average active target needs more than ``max_duty`` of that (Table 11's first span does) gets
    arrivals at ``u**k`` and departures at ``1 - u**k`` of the span, raising the mean present to
    ``P0 + (A*k - D) / (k + 1)``. ``k`` is the smallest value on a 0.25 grid that suffices.
    """
    skews = []
    present = 0.0
    for n_arr, n_dep, target in zip(arrivals, departures, avg_active, strict=True):
        need = target / max_duty
        k = 1.0
        while present + (n_arr * k - n_dep) / (k + 1.0) < need and k < 8.0:
            k += 0.25
        skews.append(k)
        present += n_arr - n_dep
    return skews


def _place_arrivals_departures(
    arrivals: Sequence[float],
    departures: Sequence[float],
    span_s: float,
    rng: np.random.Generator,
    min_age_s: float,
    prefix: str,
    skews: Sequence[float],
) -> list[_Session]:
    arrive_times: list[float] = []
    depart_times: list[float] = []
    for index, (n_arr, n_dep) in enumerate(zip(arrivals, departures, strict=True)):
        lo = index * span_s
        k = skews[index]
        arrive_times.extend(np.sort(lo + span_s * rng.uniform(0, 1, int(n_arr)) ** k).tolist())
        depart_times.extend(np.sort(lo + span_s * (1.0 - rng.uniform(0, 1, int(n_dep)) ** k)).tolist())
    sessions = [_Session(f"{prefix}{i + 1:05d}", t) for i, t in enumerate(arrive_times)]
    # Which present session leaves at each departure time: uniformly among those at least
    # ``min_age_s`` old (memoryless lifetimes), else the oldest present one.
    present: list[int] = []
    next_arrival = 0
    for t in depart_times:
        while next_arrival < len(sessions) and sessions[next_arrival].arrive_t < t:
            present.append(next_arrival)
            next_arrival += 1
        if not present:
            # Nobody has arrived yet: the departure waits for the next arrival (never observed for
            # the paper's tables, whose cumulative departures stay well below cumulative arrivals).
            present.append(next_arrival)
            t = sessions[next_arrival].arrive_t + 1e-3
            next_arrival += 1
        eligible = [k for k, s in enumerate(present) if t - sessions[s].arrive_t >= min_age_s]
        pick = present.pop(eligible[int(rng.integers(len(eligible)))] if eligible else 0)
        sessions[pick].depart_t = t
    return sessions


def spans_trace(
    arrivals: Sequence[float],
    departures: Sequence[float],
    avg_active: Sequence[float],
    span_s: float,
    *,
    seed: int = 0,
    mean_cycle_s: float = 40.0,
    mean_think_s: float = 3.0,
    min_age_s: float = 10.0,
    load_mix: LoadMix = None,
    calibration_rounds: int = 16,
    prefix: str = "s",
) -> tuple[dict, list[TraceEvent]]:
    """A trace with the given arrivals and departures per span (exactly) and average active sessions
    per span (calibrated): the general engine behind :func:`paper_trace`."""
    if not (len(arrivals) == len(departures) == len(avg_active)):
        raise ValueError("arrivals, departures and avg_active must have the same length")
    if np.any(np.cumsum(departures) > np.cumsum(arrivals)):
        raise ValueError("cumulative departures exceed cumulative arrivals")
    n_spans = len(arrivals)
    horizon = n_spans * span_s
    root = np.random.default_rng(seed)
    skews = _span_skews(arrivals, departures, avg_active, max_duty=0.7)
    sessions = _place_arrivals_departures(arrivals, departures, span_s, root, min_age_s, prefix, skews)
    _assign_loads(sessions, load_mix, root)
    session_seeds = root.integers(0, 2**63 - 1, size=len(sessions))
    targets = np.asarray(avg_active, dtype=float)

    def simulate(fractions: np.ndarray) -> list[TraceEvent]:
        def duty(t: float) -> float:
            return float(fractions[min(int(t // span_s), n_spans - 1)])

        # Common random numbers: each session replays its own stream in every calibration round.
        for session, s_seed in zip(sessions, session_seeds, strict=True):
            rng = np.random.default_rng(int(s_seed))
            session.toggles = _on_off_toggles(session, rng, duty, mean_cycle_s, mean_think_s, horizon)
        _round_times(sessions)
        return _events_from_sessions(sessions, horizon)

    # Initial duty cycle per span: target active over the expected population present.
    present = np.cumsum(arrivals) - np.cumsum(departures)
    mid_present = np.maximum((present + np.concatenate([[0.0], present[:-1]])) / 2.0, 1.0)
    fractions = np.clip(targets / mid_present, 0.02, 0.98)
    best: tuple[float, list[TraceEvent], np.ndarray] | None = None
    for _ in range(max(1, calibration_rounds)):
        events = simulate(fractions)
        achieved = np.array([row["avg_active"] for row in span_stats(events, span_s, horizon)])
        error = float(np.max(np.abs(achieved - targets) / np.maximum(targets, 1.0)))
        if best is None or error < best[0]:
            best = (error, events, fractions.copy())
        # Damped multiplicative update: the active count of a span also depends on earlier spans.
        ratio = targets / np.maximum(achieved, 0.05)
        fractions = np.clip(fractions * ratio**0.8, 0.01, 0.99)
    assert best is not None
    error, events, fractions = best
    meta = {
        "generator": "spans_trace",
        "seed": seed,
        "duration_s": horizon,
        "span_s": span_s,
        "target_arrivals": [int(a) for a in arrivals],
        "target_departures": [int(d) for d in departures],
        "target_avg_active": [float(a) for a in avg_active],
        "duty_cycle": [round(float(f), 4) for f in fractions],
        "span_skew": skews,
        "calibration_max_rel_error": round(error, 5),
        "mean_cycle_s": mean_cycle_s,
        "mean_think_s": mean_think_s,
        "period_tail_index": PERIOD_TAIL_INDEX,
        "load_mix": _load_mix_meta(load_mix),
    }
    return meta, events


def _load_mix_meta(load_mix: LoadMix) -> list[list[float]] | None:
    sampler = _load_sampler(load_mix)
    if sampler is None:
        return None
    return [[float(load), round(float(p), 6)] for load, p in zip(*sampler, strict=True)]


def paper_trace(name: str, seed: int = 0, *, load_mix: LoadMix = None) -> tuple[dict, list[TraceEvent]]:
    """A trace shaped like TurboServe Table 12 (``"T1"``..``"T6"``: per-minute spans over 5 minutes)
    or Table 11 (``"table11"``: 2-minute spans over 10 minutes)."""
    if name == "table11":
        meta, events = spans_trace(
            TABLE11["arrivals"],
            TABLE11["departures"],
            TABLE11["avg_active"],
            120.0,
            seed=seed,
            load_mix=load_mix,
        )
        source = "TurboServe Table 11"
    elif name in TABLE12:
        row = TABLE12[name]
        meta, events = spans_trace(
            row["arrivals"], row["departures"], row["avg_active"], 60.0, seed=seed, load_mix=load_mix
        )
        source = "TurboServe Table 12"
    else:
        raise ValueError(f"unknown paper trace {name!r} (expected one of {list(PAPER_SHAPES)})")
    meta = {"name": name, "source": source, **meta, "generator": "paper_trace"}
    return meta, events


# --------------------------------------------------------------------------------------------------
# Poisson and diurnal traces (open-ended workloads for sweeps).


def _arrival_times(
    rate_at: Callable[[float], float],
    rate_max: float,
    duration_s: float,
    rng: np.random.Generator,
    burst_factor: float,
    burst_fraction: float,
    burst_mean_s: float,
) -> list[float]:
    """Arrivals of a Poisson process with rate ``rate_at(t)`` (per second), optionally modulated by a
    two-state Markov chain (MMPP): in the burst state the rate is multiplied by ``burst_factor``. The
    normal-state rate is scaled down so that the long-run mean rate stays ``rate_at(t)``."""
    if burst_factor < 1.0:
        raise ValueError("burst_factor must be >= 1")
    if not 0.0 <= burst_fraction < 1.0:
        raise ValueError("burst_fraction must be in [0, 1)")
    bursty = burst_factor > 1.0 and burst_fraction > 0.0
    base_scale = 1.0 / (1.0 + burst_fraction * (burst_factor - 1.0)) if bursty else 1.0
    calm_mean_s = burst_mean_s * (1.0 - burst_fraction) / burst_fraction if bursty else math.inf
    bound = rate_max * base_scale * (burst_factor if bursty else 1.0)
    if bound <= 0:
        return []
    times: list[float] = []
    t = 0.0
    in_burst = False
    switch_at = float(rng.exponential(calm_mean_s)) if bursty else math.inf
    while True:
        t += float(rng.exponential(1.0 / bound))
        while t >= switch_at:
            in_burst = not in_burst
            switch_at += float(rng.exponential(burst_mean_s if in_burst else calm_mean_s))
        if t >= duration_s:
            return times
        rate = rate_at(t) * base_scale * (burst_factor if in_burst else 1.0)
        if rng.uniform() * bound < rate:  # thinning
            times.append(t)


def _open_trace(
    generator: str,
    rate_at: Callable[[float], float],
    rate_max: float,
    duration_s: float,
    mean_session_s: float,
    active_fraction: float,
    mean_cycle_s: float,
    mean_think_s: float,
    load_mix: LoadMix,
    seed: int,
    burst_factor: float,
    burst_fraction: float,
    burst_mean_s: float,
    extra_meta: dict,
) -> tuple[dict, list[TraceEvent]]:
    if duration_s <= 0 or mean_session_s <= 0 or mean_cycle_s <= 0:
        raise ValueError("duration_s, mean_session_s and mean_cycle_s must be > 0")
    if not 0.0 < active_fraction < 1.0:
        raise ValueError("active_fraction must be in (0, 1)")
    rng = np.random.default_rng(seed)
    times = _arrival_times(rate_at, rate_max, duration_s, rng, burst_factor, burst_fraction, burst_mean_s)
    sessions = []
    for index, t in enumerate(times):
        # Session lifetimes are heavy-tailed too (mean ``mean_session_s``).
        life = mean_session_s * float(_lomax_unit(rng))
        sessions.append(_Session(f"s{index + 1:06d}", t, t + max(life, 1.0)))
    _assign_loads(sessions, load_mix, rng)
    for session in sessions:
        session.toggles = _on_off_toggles(
            session, rng, lambda _t: active_fraction, mean_cycle_s, mean_think_s, duration_s
        )
    _round_times(sessions)
    events = _events_from_sessions(sessions, duration_s)
    meta = {
        "name": generator.removesuffix("_trace"),
        "generator": generator,
        "seed": seed,
        "duration_s": duration_s,
        "mean_session_s": mean_session_s,
        "active_fraction": active_fraction,
        "mean_cycle_s": mean_cycle_s,
        "mean_think_s": mean_think_s,
        "period_tail_index": PERIOD_TAIL_INDEX,
        "burst_factor": burst_factor,
        "burst_fraction": burst_fraction,
        "burst_mean_s": burst_mean_s,
        "load_mix": _load_mix_meta(load_mix),
        **extra_meta,
    }
    return meta, events


def poisson_trace(
    rate_per_min: float,
    duration_s: float,
    mean_session_s: float,
    *,
    active_fraction: float = 0.6,
    mean_cycle_s: float = 40.0,
    mean_think_s: float = 3.0,
    burst_factor: float = 1.0,
    burst_fraction: float = 0.1,
    burst_mean_s: float = 20.0,
    load_mix: LoadMix = None,
    seed: int = 0,
) -> tuple[dict, list[TraceEvent]]:
    """Poisson arrivals at ``rate_per_min`` (MMPP bursts when ``burst_factor > 1``), heavy-tailed
    session lifetimes with mean ``mean_session_s``, on/off activity with duty cycle ``active_fraction``.
    Sessions still present at ``duration_s`` have no depart event."""
    if rate_per_min < 0:
        raise ValueError("rate_per_min must be >= 0")
    rate = rate_per_min / 60.0
    return _open_trace(
        "poisson_trace",
        lambda _t: rate,
        rate,
        duration_s,
        mean_session_s,
        active_fraction,
        mean_cycle_s,
        mean_think_s,
        load_mix,
        seed,
        burst_factor,
        burst_fraction,
        burst_mean_s,
        {"rate_per_min": rate_per_min},
    )


def diurnal_trace(
    duration_s: float = 3600.0,
    *,
    peak_rate_per_min: float = 60.0,
    trough_rate_per_min: float = 10.0,
    period_s: float | None = None,
    mean_session_s: float = 180.0,
    active_fraction: float = 0.6,
    mean_cycle_s: float = 40.0,
    mean_think_s: float = 3.0,
    burst_factor: float = 1.0,
    burst_fraction: float = 0.1,
    burst_mean_s: float = 20.0,
    load_mix: LoadMix = None,
    seed: int = 0,
) -> tuple[dict, list[TraceEvent]]:
    """Arrival rate follows a raised cosine from the trough (t = 0) to the peak (t = period/2) and back;
    ``period_s`` defaults to the duration (one "day" compressed into the trace)."""
    if peak_rate_per_min < trough_rate_per_min or trough_rate_per_min < 0:
        raise ValueError("need 0 <= trough_rate_per_min <= peak_rate_per_min")
    period = float(period_s or duration_s)
    lo, hi = trough_rate_per_min / 60.0, peak_rate_per_min / 60.0

    def rate_at(t: float) -> float:
        return lo + (hi - lo) * (1.0 - math.cos(2.0 * math.pi * t / period)) / 2.0

    return _open_trace(
        "diurnal_trace",
        rate_at,
        hi,
        duration_s,
        mean_session_s,
        active_fraction,
        mean_cycle_s,
        mean_think_s,
        load_mix,
        seed,
        burst_factor,
        burst_fraction,
        burst_mean_s,
        {
            "peak_rate_per_min": peak_rate_per_min,
            "trough_rate_per_min": trough_rate_per_min,
            "period_s": period,
        },
    )


# --------------------------------------------------------------------------------------------------
# Directly controlled active counts: Table 7 windows and Table 5 volatility segments.


class _ActivityDriver:
    """Moves sessions between idle and active to follow a target active count, recording events.

    New sessions arrive when the idle pool runs dry; idle sessions depart after ``idle_timeout_s``
    with probability ``depart_prob`` each time they are checked.
    """

    def __init__(self, rng: np.random.Generator, prefix: str = "s"):
        self.rng = rng
        self.prefix = prefix
        self.events: list[tuple[float, int, TraceEvent]] = []
        self.active: list[str] = []
        self.idle: list[str] = []
        self.idle_since: dict[str, float] = {}
        self.seq = 0
        self.count = 0

    def _emit(self, t: float, session: str, kind: str) -> None:
        self.events.append((t, self.seq, TraceEvent(t, session, kind)))
        self.seq += 1

    def arrive(self, t: float, arrive_t: float | None = None) -> str:
        self.count += 1
        sid = f"{self.prefix}{self.count:05d}"
        at = t if arrive_t is None else arrive_t
        self.events.append((at, -1, TraceEvent(at, sid, "arrive")))
        self.idle.append(sid)
        self.idle_since[sid] = at
        return sid

    def activate(self, t: float, lead_s: float) -> None:
        if not self.idle:
            self.arrive(t, max(0.0, t - lead_s))
        sid = self.idle.pop(int(self.rng.integers(len(self.idle))))
        self.idle_since.pop(sid, None)
        self.active.append(sid)
        self._emit(t, sid, "active")

    def deactivate(self, t: float) -> None:
        sid = self.active.pop(int(self.rng.integers(len(self.active))))
        self.idle.append(sid)
        self.idle_since[sid] = t
        self._emit(t, sid, "idle")

    def retire_idle(self, t: float, idle_timeout_s: float, depart_prob: float, keep: int) -> None:
        for sid in list(self.idle):
            if len(self.idle) <= keep:
                return
            if t - self.idle_since[sid] >= idle_timeout_s and self.rng.uniform() < depart_prob:
                self.idle.remove(sid)
                del self.idle_since[sid]
                self._emit(t, sid, "depart")

    def trace(self) -> list[TraceEvent]:
        ordered = sorted(self.events, key=lambda item: (item[0], item[1]))
        return [item[2] for item in ordered]


def _integer_profile(
    rng: np.random.Generator, n: int, total: int, peak: int, start: float | None
) -> list[int]:
    """``n`` non-negative integers with sum ``total`` and maximum exactly ``peak``: a smooth random
    walk between the previous level and the peak, with one burst to the peak."""
    mean = total / n
    if not 0 <= mean <= peak:
        raise ValueError("need 0 <= total / n <= peak")
    walk = np.cumsum(rng.normal(0.0, 1.0, n))
    walk = (walk - walk.mean()) / (walk.std() + 1e-9)
    spread = max(0.5, min(peak - mean, mean) * 0.5)
    values = mean + spread * walk
    if start is not None:  # ease in from the previous window's level over the first few seconds
        ramp = np.exp(-np.arange(n) / 3.0)
        values = values * (1 - ramp) + start * ramp
    ints = np.clip(np.rint(values), 0, peak).astype(int)
    ints[int(rng.integers(n // 3, n))] = peak
    peak_at = int(np.argmax(ints == peak))
    # Fix the sum one unit at a time, never touching the peak position nor leaving [0, peak].
    guard = 0
    while ints.sum() != total and guard < 100_000:
        guard += 1
        k = int(rng.integers(n))
        if k == peak_at:
            continue
        if ints.sum() < total and ints[k] < peak:
            ints[k] += 1
        elif ints.sum() > total and ints[k] > 0:
            ints[k] -= 1
    if ints.sum() != total:
        raise ValueError("could not build an integer profile with the requested sum and peak")
    return ints.tolist()


def table7_windows(
    seed: int = 0,
    *,
    window_s: int = 30,
    churn_per_s: float = 0.4,
    idle_timeout_s: float = 40.0,
) -> tuple[dict, list[TraceEvent]]:
    """Ten 30 s windows with the average and maximum active sessions of TurboServe Table 7.

    The active count is held piecewise constant per second; its per-second values in each window are
    integers summing to ``round(avg * window_s)`` with maximum exactly the table's maximum, so the
    windows' averages match the table to its two decimals. On top of the net changes, ``churn_per_s``
    (mean, Poisson) swaps per second deactivate one session and activate another at the same instant.
    """
    rng = np.random.default_rng(seed)
    driver = _ActivityDriver(rng)
    profile: list[int] = []
    previous: float | None = None
    for avg, peak in zip(TABLE7["avg_active"], TABLE7["max_active"], strict=True):
        window = _integer_profile(rng, window_s, round(avg * window_s), int(peak), previous)
        profile.extend(window)
        previous = window[-1]
    for second, target in enumerate(profile):
        t = float(second)
        while len(driver.active) < target:
            driver.activate(t, lead_s=float(rng.uniform(0.5, 3.0)))
        while len(driver.active) > target:
            driver.deactivate(t)
        for _ in range(int(rng.poisson(churn_per_s))):
            if driver.active and driver.idle:
                driver.deactivate(t)
                driver.activate(t, lead_s=1.0)
        driver.retire_idle(t, idle_timeout_s, depart_prob=0.1, keep=5)
    duration = float(len(profile))
    meta = {
        "name": "table7",
        "source": "TurboServe Table 7",
        "generator": "table7_windows",
        "seed": seed,
        "duration_s": duration,
        "window_s": window_s,
        "target_avg_active": list(TABLE7["avg_active"]),
        "target_max_active": list(TABLE7["max_active"]),
        "churn_per_s": churn_per_s,
        "idle_timeout_s": idle_timeout_s,
    }
    return meta, driver.trace()


def segment_family(
    level: int,
    seed: int = 0,
    *,
    duration_s: float = 60.0,
    bin_s: float = 5.0,
    warmup_s: float = 10.0,
    mean_active_s: float = 15.0,
) -> tuple[dict, list[TraceEvent]]:
    """A profiling segment for volatility ``level`` 1..10 (TurboServe Table 5).

    The measured segment is ``[warmup_s, warmup_s + duration_s)``: sessions present at its start arrive
    and activate during the warm-up (they are not counted as the segment's arrivals). Inside the
    segment, new activations per ``bin_s`` bin follow the seed's base burst pattern scaled so that their
    standard deviation is the level's volatility; exactly the table's number of new sessions arrive
    (each is activated on arrival); the remaining activations re-activate idle sessions; each
    activation lasts a heavy-tailed period (mean ``mean_active_s``). The number of warm-up sessions is
    the smallest that lifts the peak active count to the table's value.
    """
    rows = {row[0]: row for row in TABLE5}
    if level not in rows:
        raise ValueError(f"level must be 1..10, got {level!r}")
    _, volatility, n_arrivals, peak_target = rows[level]
    n_bins = round(duration_s / bin_s)
    rng = np.random.default_rng([seed, 5])  # the base pattern depends on the seed only, not the level
    pattern = _lomax_unit(rng, n_bins) ** 1.5
    pattern = (pattern - pattern.mean()) / (pattern.std() + 1e-12)
    level_rng = np.random.default_rng([seed, level])
    base = n_arrivals / n_bins + 1.0
    counts = _scaled_counts(pattern, base, volatility, n_arrivals)

    # Activation times: uniform within each bin of the segment.
    start = warmup_s
    act_times: list[float] = []
    for b, c in enumerate(counts):
        lo = start + b * bin_s
        act_times.extend(_floor_ms(float(t)) for t in np.sort(level_rng.uniform(lo, lo + bin_s, c)))
    n_act = len(act_times)
    is_new = np.zeros(n_act, dtype=bool)
    is_new[level_rng.choice(n_act, size=n_arrivals, replace=False)] = True
    durations = mean_active_s * _lomax_unit(level_rng, n_act)
    warm_durations = (duration_s + warmup_s) * (0.5 + _lomax_unit(level_rng, 400))
    warm_starts = np.floor(np.sort(level_rng.uniform(0.0, warmup_s * 0.9, 400)) * 1000.0) / 1000.0
    end = start + duration_s

    act_offs = [_floor_ms(t + float(d)) for t, d in zip(act_times, durations, strict=True)]
    warm_offs = [_floor_ms(float(a + d)) for a, d in zip(warm_starts, warm_durations, strict=True)]

    def peak_with(n_warm: int) -> int:
        """Peak active count inside the segment with ``n_warm`` warm-up sessions (same times as the
        events written below; at equal times deactivations apply first, as in the trace)."""
        deltas = [(t, 1) for t in act_times] + [(t, -1) for t in act_offs]
        deltas += [(float(warm_starts[i]), 1) for i in range(n_warm)]
        deltas += [(warm_offs[i], -1) for i in range(n_warm)]
        deltas.sort(key=lambda item: (item[0], item[1]))
        level_now = best = 0
        started = False
        for t, d in deltas:
            if t >= start and not started:
                best, started = level_now, True  # the level carried into the segment counts too
            level_now += d
            if start <= t < end:
                best = max(best, level_now)
        return best

    n_warm = 0
    while peak_with(n_warm) < peak_target and n_warm < len(warm_starts):
        n_warm += 1

    # Materialise sessions: warm-up actives, an idle pool for re-activations, then the segment.
    n_reactivations = int(n_act - n_arrivals)
    sessions: list[_Session] = []
    for i in range(n_warm):
        s = _Session(f"w{i + 1:04d}", float(warm_starts[i]))
        off = warm_offs[i]
        s.toggles = [(float(warm_starts[i]), "active")] + ([(off, "idle")] if off < end else [])
        sessions.append(s)
    idle_pool = [
        _Session(f"p{i + 1:04d}", _floor_ms(float(t)))
        for i, t in enumerate(np.sort(level_rng.uniform(0.0, warmup_s * 0.9, n_reactivations)))
    ]
    sessions.extend(idle_pool)
    # Each re-activation uses a distinct pooled session (idle since the warm-up).
    pool_order = level_rng.permutation(len(idle_pool)).tolist()
    new_index = 0
    for t, off, new in zip(act_times, act_offs, is_new, strict=True):
        toggles = [(t, "active")] + ([(off, "idle")] if off < end else [])
        if new:
            new_index += 1
            s = _Session(f"n{new_index:04d}", t)
            s.toggles = toggles
            sessions.append(s)
        else:
            idle_pool[pool_order.pop()].toggles = toggles
    events = _events_from_sessions(sessions, end)
    meta = {
        "name": f"segment-L{level}",
        "source": "TurboServe Table 5",
        "generator": "segment_family",
        "level": level,
        "seed": seed,
        "duration_s": end,
        "segment_start_s": start,
        "segment_end_s": end,
        "bin_s": bin_s,
        "target_volatility": volatility,
        "target_arrivals": n_arrivals,
        "target_peak_active": peak_target,
        "activation_counts": [int(c) for c in counts],
        "warmup_sessions": n_warm,
        "mean_active_s": mean_active_s,
    }
    return meta, events


def _scaled_counts(pattern: np.ndarray, base: float, volatility: float, min_total: int) -> list[int]:
    """Integer activation counts ``base + s * pattern`` (clipped at 0) whose population std is as close
    to ``volatility`` as the integers allow, with a total of at least ``min_total``."""
    best: np.ndarray | None = None
    best_err = math.inf
    for s in np.linspace(0.0, 4.0 * volatility + 2.0, 801):
        counts = np.clip(np.rint(base + s * pattern), 0, None).astype(int)
        if counts.sum() < min_total:
            continue
        err = abs(float(counts.std()) - volatility)
        if err < best_err:
            best, best_err = counts, err
    assert best is not None
    # Polish with single-bin +-1 moves (keeps the burst shape, tightens the std).
    improved = True
    while improved and best_err > 1e-3:
        improved = False
        for k in range(len(best)):
            for step in (1, -1):
                trial = best.copy()
                trial[k] += step
                if trial[k] < 0 or trial.sum() < min_total:
                    continue
                err = abs(float(trial.std()) - volatility)
                if err + 1e-12 < best_err:
                    best, best_err, improved = trial, err, True
    return best.tolist()


def segment_stats(events: Sequence[TraceEvent], meta: dict) -> dict[str, float]:
    """Volatility, arrivals and peak active of a :func:`segment_family` trace over its segment window."""
    start, end, bin_s = meta["segment_start_s"], meta["segment_end_s"], meta["bin_s"]
    inside = [e for e in events if start <= e.t < end]
    shifted = [TraceEvent(e.t - start, e.session, e.event) for e in inside]
    counts = activation_counts(shifted, bin_s, end - start)
    steps = active_count_steps(events)
    times = [t for t, _ in steps]
    i0 = max(0, bisect.bisect_right(times, start) - 1)
    peak = max(c for t, c in steps[i0:] if t < end)
    return {
        "volatility": float(np.std(counts)),
        "arrivals": sum(1 for e in inside if e.event == "arrive"),
        "peak_active": peak,
        "activations": sum(counts),
    }


# --------------------------------------------------------------------------------------------------
# Registry used by the gen_trace command.

SHAPES = (*PAPER_SHAPES, "table7", "poisson", "diurnal", "segment")
