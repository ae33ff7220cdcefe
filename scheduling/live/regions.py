"""The live regions (docs/regions.md, "Live platform"): the global router, its forecast slot, and
the split of a scale-out over the regions within their GPU limits.

The algorithms are ``scheduling.core.regions`` (the simulator's): this module only reads the
platform's state into their arrays and keeps the previous plan, the load history and the forecast in
Redis.

- demand by origin: the load of live (not terminated) sessions per origin, the arriving one included,
  raised to the forecast of the next slot where ``region_forecast_step`` (beat, one call a slot)
  has stored one for the same origins;
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
(``region`` null: placed as before, on any worker); a region beyond the budget is never assigned.
"""

from __future__ import annotations

import json
import logging
from collections import defaultdict
from dataclasses import dataclass, replace
from typing import Any

import numpy as np
from django.conf import settings
from django.db import transaction
from django.db.models import Sum

from gpu.models import GpuWorker, Region
from scheduling.core.regions.forecast import make_forecaster
from scheduling.core.regions.transport import (
    CostWeights,
    cost_matrix,
    routing_probabilities,
    smooth_plan,
    solve_plan,
)
from scheduling.live.outbox import redis_client
from sessions.models import GenerationSession

log = logging.getLogger(__name__)

PLAN_KEY = "streamserve:regions:plan"
HISTORY_KEY = "streamserve:regions:history"  # one JSON sample a slot: {"origins", "load"}
FORECAST_KEY = "streamserve:regions:forecast"  # {"origins", "demand"}: the next slot's, by origin
ETS_WINDOW = 80  # the samples ETS is fitted on (scheduling.core.regions.forecast.EtsForecaster)
_DEFAULT_USD_PER_SESSION_H = 1.0  # price scale when no live worker has a price


def _origins(regions: list[Region]) -> list[str]:
    return sorted({o for r in regions for o in r.rtt_ms})


def _origin_load(origins: list[str]) -> np.ndarray:
    """The load of live (not terminated) sessions per origin, in ``origins`` order."""
    load = np.zeros(len(origins))
    index = {o: j for j, o in enumerate(origins)}
    live = (
        GenerationSession.objects.exclude(status=GenerationSession.Status.TERMINATED)
        .filter(origin__in=origins)
        .values("origin")
        .annotate(load=Sum("load"))
    )
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
    """The latest run of samples taken with these origins (older ones described other columns)."""
    tail: list[list[float]] = []
    for sample in reversed(samples):
        if sample["origins"] != origins:
            break
        tail.append(sample["load"])
    return tail[::-1]


def region_forecast_step() -> dict[str, float]:
    """One forecast slot (beat task "region forecast", its period the slot): observe each origin's
    load, append it to the history in Redis, and store the forecast one slot ahead for the router.

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
    sample = {"origins": origins, "load": _origin_load(origins).tolist()}
    client.rpush(HISTORY_KEY, json.dumps(sample))
    client.ltrim(HISTORY_KEY, -max(keep, ETS_WINDOW), -1)
    samples = [json.loads(raw) for raw in client.lrange(HISTORY_KEY, -keep, -1)]
    forecaster = make_forecaster(name, len(origins), season=season)
    for load in _history_tail(samples, origins):
        forecaster.observe(np.array(load))
    demand = forecaster.forecast(1)[:, 0]
    client.set(FORECAST_KEY, json.dumps({"origins": origins, "demand": demand.tolist()}))
    return dict(zip(origins, demand.tolist(), strict=True))


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
    client.set(PLAN_KEY, json.dumps({"regions": names, "origins": origins, "plan": smoothed.tolist()}))
    return regions, origins, smoothed, allowed


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
class RegionShare:
    """Part of a scale-out: ``count`` GPUs for ``region`` (``None``: the local region, see ``Region``)
    at ``price_multiplier`` × the GPU type's price."""

    region: Region | None
    count: int
    price_multiplier: float = 1.0

    @property
    def name(self) -> str:
        return self.region.name if self.region else Region.DEFAULT_NAME


def _region_figures(gpu_type: str) -> tuple[dict[str, float], dict[str, float], dict[str, int]]:
    """By region name (the local region's for a null region): routed load of live sessions, Σ K of
    live workers, and live workers of ``gpu_type``."""
    names = dict(Region.objects.values_list("pk", "name"))
    load: dict[str, float] = defaultdict(float)
    slots: dict[str, float] = defaultdict(float)
    used: dict[str, int] = defaultdict(int)
    for region_id, session_load in (
        GenerationSession.objects.exclude(status=GenerationSession.Status.TERMINATED)
        .values("region_id")
        .annotate(load=Sum("load"))
        .values_list("region_id", "load")
    ):
        load[names.get(region_id, Region.DEFAULT_NAME)] += session_load
    live = GpuWorker.objects.filter(status__in=GpuWorker.LIVE_STATUSES)
    for region_id, k, worker_type in live.values_list("region_id", "capacity", "gpu_type"):
        name = names.get(region_id, Region.DEFAULT_NAME)
        slots[name] += k
        used[name] += worker_type == gpu_type
    return load, slots, used


def scale_out_regions(*, gpu_type: str, count: int, capacity_per_gpu: int) -> list[RegionShare]:
    """Split a scale-out of ``count`` GPUs of ``gpu_type`` over the regions, within their limits.

    Each GPU goes to the region whose routed load (live sessions with that region; the local region
    takes those without one) is furthest above its capacity (Σ K of its live workers), counting the
    GPUs already given; ties go to the lower price multiplier, then the name. A region takes a GPU
    only while its live GPUs of that type are under its ``gpu_limits`` entry (a type without an entry
    is not limited). The local region is always a candidate, limited by its row when it has one, and
    its new workers keep a null region. GPUs no region has room for are not requested: the limits are
    hard, and the autoscaler asks again on a later decision.
    """
    rows = {r.name: r for r in Region.objects.all()}
    local = rows.pop(Region.DEFAULT_NAME, None)
    candidates = [RegionShare(None, 0, local.price_multiplier if local else 1.0)]
    candidates += [RegionShare(row, 0, row.price_multiplier) for row in rows.values()]

    def has_room(share: RegionShare, given: int) -> bool:
        row = share.region or local  # the local region's limits live on its row, if any
        limit = row.gpu_limits.get(gpu_type) if row else None
        return limit is None or used[share.name] + given < limit

    load, slots, used = _region_figures(gpu_type)
    given: dict[str, int] = defaultdict(int)
    for _ in range(count):
        room = [c for c in candidates if has_room(c, given[c.name])]
        if not room:
            log.warning(
                "scale-out of %s: %d GPUs beyond every region's limit", gpu_type, count - sum(given.values())
            )
            break
        deficit = {c.name: load[c.name] - slots[c.name] - given[c.name] * capacity_per_gpu for c in room}
        best = min(room, key=lambda c: (-deficit[c.name], c.price_multiplier, c.name))
        given[best.name] += 1
    return [replace(c, count=given[c.name]) for c in candidates if given[c.name]]
