"""The live regions (docs/regions.md, "Live platform"): the global router, its forecast slot, the
slot's moves of parked sessions, and the regions as the scheduler's per-region planning reads them
(``region_layout``; the planning itself is the decision pipeline's, ``scheduling.core.pipeline``).

The algorithms are ``scheduling.core.regions`` (the simulator's): this module only reads the
platform's state into their arrays and keeps the previous plan, the load history and the forecast in
Redis.

- demand by origin: the load of live (not terminated) sessions per origin, the arriving one included,
  raised to the forecast of the next slot where ``region_forecast_step`` (beat, one call a slot)
  has stored one for the same origins;
- predictive floor (``REGION_FORECAST_FLOOR``): each region's autoscaler target is raised to TORTA's
  Eq. 6 on the plan's share of each origin's forecast active load (``region_floor_load``, read by
  ``scheduling.live.run``), as ``simulate --forecast`` does for one region;
- capacity by region: Σ K over the region's live workers (a worker without a region is in the
  local region, ``Region.DEFAULT_NAME``, which takes part when it has a row with RTTs);
- cost: ``w_rtt · RTT + w_price · price_multiplier · (mean $/h per session slot of the live workers)``;
- allowed: RTT ≤ ``REGION_RTT_BUDGET_MS`` (a missing RTT is not allowed);
- plan: ``solve_plan`` (``ot.emd``, absolute masses), ``routing_probabilities`` (overflow spread by
  capacity), ``smooth_plan`` against the previous plan (β = ``REGION_PLAN_BETA``) when the regions and
  origins are the same.

A session is routed to the allowed region where its origin is furthest below the plan's share
(``share · demand − sessions already there``): deterministic, and it fills the plan in proportion.
With one region, without an origin, or with no region within the budget, the session keeps no region
(``region`` null: the local region); a region beyond the budget is never assigned.
"""

from __future__ import annotations

import json
import logging
import math
from collections.abc import Mapping
from dataclasses import astuple, dataclass, field
from typing import Any

import numpy as np
from django.conf import settings
from django.db import transaction
from django.db.models import Sum

from gpu.models import GpuWorker, Region
from scheduling.core.regions import partition as core_partition
from scheduling.core.regions.forecast import make_forecaster
from scheduling.core.regions.transport import (
    CostWeights,
    cost_matrix,
    routing_probabilities,
    smooth_plan,
    solve_plan,
)
from scheduling.live.outbox import redis_client
from scheduling.live.worker_profiles import default_gpu_type, gpu_profiles
from sessions.models import GenerationSession

log = logging.getLogger(__name__)

PLAN_KEY = "streamserve:regions:plan"
HISTORY_KEY = "streamserve:regions:history"  # one JSON sample a slot: {"origins", "load"}
FORECAST_KEY = "streamserve:regions:forecast"  # {"origins", "demand"}: the next slot's, by origin
ETS_WINDOW = 80  # the samples ETS is fitted on (scheduling.core.regions.forecast.EtsForecaster)
_DEFAULT_USD_PER_SESSION_H = 1.0  # price scale when no live worker has a price


def _origins(regions: list[Region]) -> list[str]:
    return sorted({o for r in regions for o in r.rtt_ms})


def _origin_load(origins: list[str], *, active_only: bool = False) -> np.ndarray:
    """The load of live (not terminated) sessions per origin, in ``origins`` order; with
    ``active_only`` of the active ones only (the load the GPUs serve, the predictive floor's input)."""
    load = np.zeros(len(origins))
    index = {o: j for j, o in enumerate(origins)}
    live = GenerationSession.objects.exclude(status=GenerationSession.Status.TERMINATED).filter(
        origin__in=origins
    )
    if active_only:
        live = live.filter(activity=GenerationSession.Activity.ACTIVE)
    live = live.values("origin").annotate(load=Sum("load"))
    for row in live:
        load[index[row["origin"]]] = row["load"]
    return load


def _forecast(origins: list[str]) -> np.ndarray | None:
    """The next slot's demand by origin stored by ``region_forecast_step``; ``None`` when there is
    none for these origins (no slot has run yet, or the regions' RTT rows changed since)."""
    raw = redis_client().get(FORECAST_KEY)
    if not raw:
        return None
    stored = json.loads(raw)
    return np.array(stored["demand"]) if stored.get("origins") == origins else None


def _state() -> tuple[list[Region], list[str], np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    regions = list(Region.objects.order_by("name"))
    origins = _origins(regions)
    index = {r.pk: i for i, r in enumerate(regions)}
    default = next((i for i, r in enumerate(regions) if r.name == Region.DEFAULT_NAME), None)
    capacity = np.zeros(len(regions))
    slot_prices: list[float] = []
    for region_id, k, price in GpuWorker.objects.filter(status__in=GpuWorker.LIVE_STATUSES).values_list(
        "region_id", "capacity", "price_per_hour"
    ):
        i = index.get(region_id, default)
        if i is not None:
            capacity[i] += k
        slot_prices.append(float(price) / k)
    slot_price = float(np.mean(slot_prices)) if slot_prices and max(slot_prices) > 0 else None
    price = np.array([r.price_multiplier for r in regions]) * (slot_price or _DEFAULT_USD_PER_SESSION_H)
    rtt = np.array([[float(r.rtt_ms.get(o, np.inf)) for r in regions] for o in origins]).reshape(
        len(origins), len(regions)
    )
    demand = _origin_load(origins)
    forecast = _forecast(origins)
    if forecast is not None:
        # TORTA §5.2 solves the plan on the next slot's forecast demand; the sessions already here
        # last minutes, so the plan covers at least them and the forecast's rise beyond.
        demand = np.maximum(demand, forecast)
    return regions, origins, rtt, demand, capacity, price


def origin_demand() -> list[dict[str, Any]]:
    """Each known origin's load now beside the forecast stored for the next slot (the console's
    forecast against actual; ``forecast`` null until a slot has run for these origins)."""
    origins = _origins(list(Region.objects.all()))
    load = _origin_load(origins)
    forecast = _forecast(origins)
    return [
        {
            "origin": origin,
            "load": round(float(load[j]), 3),
            "forecast": None if forecast is None else round(float(forecast[j]), 3),
        }
        for j, origin in enumerate(origins)
    ]


def _history_tail(samples: list[dict], origins: list[str]) -> list[list[float]]:
    """The latest run of samples taken with these origins (older ones described other columns), each
    its live load then its active load by origin."""
    tail: list[list[float]] = []
    for sample in reversed(samples):
        if sample["origins"] != origins or "active" not in sample:
            break
        tail.append(sample["load"] + sample["active"])
    return tail[::-1]


def _floor_horizon() -> int:
    """Slots the predictive floor looks ahead, as in the simulator (``forecast_floor``):
    ``h = ⌈(delay + slot) / slot⌉``, delay the shortest provisioning delay of the GPU profiles (a GPU
    requested now is ready after it) and slot the "region forecast" beat period."""
    slot = float(settings.PERIODIC_TASKS["region forecast"]["every_s"])
    delay = min((spec.provisioning_delay_s for spec in gpu_profiles().values()), default=0.0)
    return max(1, math.ceil((delay + slot) / slot - 1e-9))


def region_forecast_step() -> dict[str, float]:
    """One forecast slot (beat task "region forecast", its period the slot): observe each origin's
    load, append it to the history in Redis, and store the forecast one slot ahead for the router.
    Each origin's active load is forecast beside it (same forecaster, its own series), and its
    largest forecast over the floor's horizon (``_floor_horizon``) is stored as the origin's
    ``floor`` input (``region_floor_load``).

    The forecaster (``REGION_FORECAST``) is rebuilt from the history each slot, since beat runs on
    any Celery worker: ETS over its last ``ETS_WINDOW`` samples (statsmodels fits at 12 and 52
    samples), seasonal-naive over one season, last-value over one sample. Returns origin -> demand.
    """
    client = redis_client()
    origins = _origins(list(Region.objects.all()))
    if not origins:
        client.delete(FORECAST_KEY)
        return {}
    name = settings.STREAMSERVE["REGION_FORECAST"]
    season = settings.STREAMSERVE["REGION_FORECAST_SEASON_SLOTS"]
    keep = {"ets": ETS_WINDOW, "seasonal-naive": season, "last-value": 1}[name]
    sample = {
        "origins": origins,
        "load": _origin_load(origins).tolist(),
        "active": _origin_load(origins, active_only=True).tolist(),
    }
    client.rpush(HISTORY_KEY, json.dumps(sample))
    client.ltrim(HISTORY_KEY, -max(keep, ETS_WINDOW), -1)
    samples = [json.loads(raw) for raw in client.lrange(HISTORY_KEY, -keep, -1)]
    n = len(origins)
    forecaster = make_forecaster(name, 2 * n, season=season)
    for row in _history_tail(samples, origins):
        forecaster.observe(np.array(row))
    ahead = forecaster.forecast(_floor_horizon())
    demand = ahead[:n, 0]
    floor = np.maximum(ahead[n:].max(axis=1), 0.0)
    client.set(
        FORECAST_KEY,
        json.dumps({"origins": origins, "demand": demand.tolist(), "floor": floor.tolist()}),
    )
    return dict(zip(origins, demand.tolist(), strict=True))


def region_floor_load() -> dict[str, float] | None:
    """Each region's predictive-floor input F (TORTA Eq. 6): the plan's share of each origin's
    forecast active load (``region_forecast_step``'s ``floor``), summed by region. The plan is the
    one routing follows (the latest ``region_plan`` stored), except for a region at zero, which gets
    the share a plan with its standby capacity gives it (``_floor_plan``); the share of an origin the plan leaves
    unrouted (no region within its budget) and, with fewer than two regions, all of it, is the local
    region's (``Region.DEFAULT_NAME``), where unrouted sessions run. ``None`` when no forecast or
    plan matches the current regions and origins (no floor this run)."""
    regions = list(Region.objects.order_by("name"))
    origins = _origins(regions)
    client = redis_client()
    raw = client.get(FORECAST_KEY)
    stored = json.loads(raw) if raw else {}
    if not origins or stored.get("origins") != origins or "floor" not in stored:
        return None
    floor = np.array(stored["floor"])
    if len(regions) < 2:
        return {Region.DEFAULT_NAME: float(floor.sum())}
    raw = client.get(PLAN_KEY)
    planned = json.loads(raw) if raw else {}
    names = [r.name for r in regions]
    if planned.get("regions") != names or planned.get("origins") != origins:
        return None
    plan = np.array(planned["plan"])
    out = dict(zip(names, (floor @ _stored_floor_plan(planned)).tolist(), strict=True))
    unrouted = float(floor @ np.clip(1.0 - plan.sum(axis=1), 0.0, None))
    out[Region.DEFAULT_NAME] = out.get(Region.DEFAULT_NAME, 0.0) + unrouted
    return out


def region_idle_forecast() -> set[str]:
    """The regions with a forecast of no demand: the plan's share of every origin's forecast demand
    and of its forecast active load (``region_forecast_step``) is nil there. Empty without a stored
    forecast and plan for the current regions and origins, or with fewer than two regions: a region
    is never scaled to zero on no forecast at all. The local region is never in it (the warm
    minimum ``min_gpus`` is kept there)."""
    regions = list(Region.objects.order_by("name"))
    origins = _origins(regions)
    if len(regions) < 2 or not origins:
        return set()
    client = redis_client()
    raw = client.get(FORECAST_KEY)
    stored = json.loads(raw) if raw else {}
    raw = client.get(PLAN_KEY)
    planned = json.loads(raw) if raw else {}
    names = [r.name for r in regions]
    if (
        stored.get("origins") != origins
        or planned.get("regions") != names
        or planned.get("origins") != origins
    ):
        return set()
    plan = _stored_floor_plan(planned)  # a region at zero the floor brings back is not idle
    demand = np.maximum(np.array(stored["demand"]), np.array(stored.get("floor", stored["demand"])))
    expected = np.clip(demand, 0.0, None) @ plan
    return {n for n, e in zip(names, expected.tolist(), strict=True) if e < 1e-6 and n != Region.DEFAULT_NAME}


def region_plan() -> tuple[list[Region], list[str], np.ndarray, np.ndarray] | None:
    """The smoothed routing plan (origins × regions, row-stochastic) and the allowed mask; ``None``
    with fewer than two regions or no origins. Stores the plan as the next call's previous one."""
    regions, origins, rtt, demand, capacity, price = _state()
    if len(regions) < 2 or not origins:
        return None
    allowed = rtt <= settings.STREAMSERVE["REGION_RTT_BUDGET_MS"]
    finite_rtt = np.where(np.isfinite(rtt), rtt, 0.0)
    cost = cost_matrix(finite_rtt, np.zeros_like(finite_rtt), price, CostWeights())
    plan = solve_plan(demand, capacity, cost, allowed)
    with np.errstate(invalid="ignore", divide="ignore"):  # an origin with no region within budget
        probs = np.nan_to_num(routing_probabilities(plan, allowed, fallback=capacity + 1e-6))
    names = [r.name for r in regions]
    client = redis_client()
    raw = client.get(PLAN_KEY)
    previous = None
    if raw:
        stored = json.loads(raw)
        if stored.get("regions") == names and stored.get("origins") == origins:
            previous = np.array(stored["plan"])
    smoothed = smooth_plan(previous, probs, settings.STREAMSERVE["REGION_PLAN_BETA"])
    smoothed = smoothed * allowed  # the previous plan may predate a budget change
    floor_plan = _floor_plan(regions, demand, capacity, cost, allowed, smoothed)
    client.set(
        PLAN_KEY,
        json.dumps(
            {
                "regions": names,
                "origins": origins,
                "plan": smoothed.tolist(),
                "floor_plan": floor_plan.tolist(),
            }
        ),
    )
    return regions, origins, smoothed, allowed


def _standby_capacity(region: Region) -> float:
    """What a region at zero could bring up: Σ K over its GPU limits (one GPU of the default type
    when it names none)."""
    profiles = gpu_profiles()
    limits = {t: n for t, n in region.gpu_limits.items() if t in profiles}
    if not limits:
        return float(profiles[default_gpu_type()].capacity)
    return float(sum(n * profiles[t].capacity for t, n in limits.items()))


def _floor_plan(
    regions: list[Region],
    demand: np.ndarray,
    capacity: np.ndarray,
    cost: np.ndarray,
    allowed: np.ndarray,
    plan: np.ndarray,
) -> np.ndarray:
    """The shares the predictive floor sizes each region for: the routing plan's, except for a
    region at zero (no live GPU; never the local region). The routing plan gives such a region no
    share, since it has no capacity, so its floor would never ask for a GPU and it would come back
    only for a session routed to it. Its column here is the one a plan solved with its standby
    capacity (``_standby_capacity``) gives it: when its origins' forecast demand makes it worth
    routing there, Eq. 6 requests its GPUs one provisioning delay ahead; once they boot (live,
    counted in ``_state``) the routing plan gives it its share."""
    zero = [i for i, r in enumerate(regions) if capacity[i] <= 0 and r.name != Region.DEFAULT_NAME]
    if not zero or demand.sum() <= 0:
        return plan
    standby = capacity.copy()
    for i in zero:
        standby[i] = _standby_capacity(regions[i])
    solved = solve_plan(demand, standby, cost, allowed)
    with np.errstate(invalid="ignore", divide="ignore"):
        probs = np.nan_to_num(routing_probabilities(solved, allowed, fallback=standby + 1e-6))
    out = plan.copy()
    out[:, zero] = (probs * allowed)[:, zero]
    return out


def _stored_floor_plan(planned: dict) -> np.ndarray:
    """The stored plan's floor shares (``_floor_plan``; the routing plan for one stored without)."""
    return np.array(planned.get("floor_plan", planned["plan"]))


@transaction.atomic
def session_region_route(*, session_id: str) -> Region | None:
    """Assign an arriving session its region by the plan (see the module docstring); returns it.

    Runs on the committed ``arrive`` event, outside any request transaction, so it opens its own.
    The decision reads the sessions already routed and adds one: two arrivals routed at once would
    see the same deficit and both take it. Locking the region rows serialises routing decisions
    (arrivals are rare next to chunks; the lock lasts one plan solve).
    """
    session = GenerationSession.objects.select_for_update(no_key=True).filter(pk=session_id).first()
    if session is None or session.region_id is not None or not session.origin:
        return None
    list(Region.objects.select_for_update().values_list("pk", flat=True))
    planned = region_plan()
    if planned is None:
        return None
    regions, origins, plan, allowed = planned
    if session.origin not in origins:
        return None
    o = origins.index(session.origin)
    if not allowed[o].any():
        log.warning("session %s from %s: no region within the RTT budget", session_id, session.origin)
        return None
    placed = dict(
        GenerationSession.objects.exclude(status=GenerationSession.Status.TERMINATED)
        .filter(origin=session.origin, region__isnull=False)
        .exclude(pk=session.pk)
        .values("region_id")
        .annotate(load=Sum("load"))
        .values_list("region_id", "load")
    )
    demand = sum(placed.values()) + session.load
    deficit = np.array([plan[o, r] * demand - placed.get(reg.pk, 0.0) for r, reg in enumerate(regions)])
    deficit = np.where(allowed[o], deficit, -np.inf)
    region = regions[int(np.argmax(deficit))]
    GenerationSession.objects.filter(pk=session.pk).update(region=region)
    return region


@dataclass(frozen=True)
class ParkedMove:
    """A parked session the slot moved: it resumes in ``target`` at its next activation."""

    session: str
    origin: str
    source: str
    target: str


def parked_sessions_reroute() -> list[ParkedMove]:
    """Once a slot: move parked sessions off the regions the plan shifts their origin's load away from.

    The plan (``region_plan``, on the forecast) gives each origin's share per region; an origin's
    routed load in a region beyond share × its load is excess there, below it a deficit. An idle,
    suspended session (its state parked in host memory: no chunk is running) in a region with
    excess gets the allowed region (within the RTT budget) with the largest deficit, longest idle
    first, while both the excess and the deficit hold at least its load (so moves never overshoot and
    the next slot does not move it back), at most ``REGION_MOVES_PER_SLOT`` a slot. Only its
    ``region`` changes now (a compare-and-set on it still being idle and suspended there); at its next
    activation the scheduler places it in the new region, and the state moves by the usual
    resume-from-another-host migration (``resume-remote``), so a session that never comes back costs no
    transfer. Sessions without a region (not routed) stay.
    """
    limit = settings.STREAMSERVE["REGION_MOVES_PER_SLOT"]
    if limit == 0:
        return []
    with transaction.atomic():
        # Serialised with arrival routing, which reads the same placed loads (see session_region_route).
        list(Region.objects.select_for_update().values_list("pk", flat=True))
        planned = region_plan()
        if planned is None:
            return []
        regions, origins, plan, allowed = planned
        index = {r.pk: i for i, r in enumerate(regions)}
        row_of = {o: j for j, o in enumerate(origins)}
        live = GenerationSession.objects.exclude(status=GenerationSession.Status.TERMINATED).filter(
            origin__in=origins, region__isnull=False
        )
        placed = np.zeros((len(origins), len(regions)))
        for origin, region_id, load in (
            live.values("origin", "region_id")
            .annotate(load=Sum("load"))
            .values_list("origin", "region_id", "load")
        ):
            placed[row_of[origin], index[region_id]] += load
        excess = placed - plan * placed.sum(axis=1, keepdims=True)
        parked = live.filter(
            status=GenerationSession.Status.SUSPENDED, activity=GenerationSession.Activity.IDLE
        ).order_by("last_active_at", "pk")
        moves: list[ParkedMove] = []
        for session in parked:
            if len(moves) >= limit:
                break
            o, r = row_of[session.origin], index[session.region_id]
            if excess[o, r] < session.load - 1e-9:
                continue
            deficit = np.where(allowed[o], -excess[o], -np.inf)
            deficit[r] = -np.inf
            t = int(np.argmax(deficit))
            if deficit[t] < session.load - 1e-9:
                continue
            moved = GenerationSession.objects.filter(
                pk=session.pk,
                region_id=session.region_id,
                status=GenerationSession.Status.SUSPENDED,
                activity=GenerationSession.Activity.IDLE,
            ).update(region=regions[t])
            if moved != 1:
                continue  # it became active meanwhile: the scheduler has it
            excess[o, r] -= session.load
            excess[o, t] += session.load
            moves.append(ParkedMove(str(session.pk), session.origin, regions[r].name, regions[t].name))
            log.info("parked session %s (%s) moved from region %s to %s", *astuple(moves[-1]))
    return moves


@dataclass(frozen=True)
class RegionLayout(core_partition.RegionLayout):
    """The regions as the decision pipeline takes them (``scheduling.core.regions.partition``: plain
    names and numbers), with the rows a region's decision points new workers and sessions to: by
    name, the local region's only when an operator added one."""

    rows: Mapping[str, Region] = field(default_factory=dict)

    def row(self, name: str) -> Region | None:
        """The row a region's new workers and sessions point to (``None``: the local region)."""
        return None if name == Region.DEFAULT_NAME else self.rows[name]


def region_layout(*, sessions: list[GenerationSession], workers: list[GpuWorker]) -> RegionLayout:
    """Which region each session and worker is in (a null region is the local one), each region's
    GPU limits, and for each session that may have to wait for a GPU (any not executing) with an
    origin, the regions within ``REGION_RTT_BUDGET_MS`` of it, nearest first."""
    rows = {r.name: r for r in Region.objects.all()}
    names = {r.pk: r.name for r in rows.values()}

    def name(region_id: int | None) -> str:
        return names.get(region_id, Region.DEFAULT_NAME) if region_id is not None else Region.DEFAULT_NAME

    budget = settings.STREAMSERVE["REGION_RTT_BUDGET_MS"]
    alternatives = {}
    for s in sessions:
        if s.origin and s.status != GenerationSession.Status.EXECUTING:
            near = sorted((r.rtt_ms[s.origin], n) for n, r in rows.items() if s.origin in r.rtt_ms)
            alternatives[str(s.pk)] = [n for rtt, n in near if rtt <= budget]
    return RegionLayout(
        default=Region.DEFAULT_NAME,
        rows=rows,
        session_region={str(s.pk): name(s.region_id) for s in sessions},
        gpu_region={w.name: name(w.region_id) for w in workers},
        gpu_limits={n: dict(r.gpu_limits) for n, r in rows.items()},
        alternatives=alternatives,
    )


def sessions_reroute(
    *, sessions: dict[str, GenerationSession], rerouted: dict[str, str], layout: RegionLayout
) -> None:
    """Record the regions the planning moved waiting sessions to (rows locked by the run)."""
    for sid, region_name in sorted(rerouted.items()):
        region = layout.row(region_name)
        log.info("session %s re-routed to region %s (no room in its own)", sid, region_name)
        GenerationSession.objects.filter(pk=sid).update(region=region)
        sessions[sid].region = region


def region_price_multiplier(region: Region | None) -> float:
    """The price multiplier of a region's new workers (the local region's from its row, if any)."""
    if region is None:
        region = Region.objects.filter(name=Region.DEFAULT_NAME).first()
    return region.price_multiplier if region is not None else 1.0
