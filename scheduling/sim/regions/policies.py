"""Region policies: where a new session goes, and whether live sessions move (``docs/regions.md``).

Every policy routes only within the session's RTT budget. The contract a policy implements:

- ``route(sim, origin, load) -> region`` for each new session;
- ``on_slot(sim, now)`` once per slot: may move live sessions (``sim.move``) and set
  ``sim.floor_capacity`` (a minimum capacity per region the autoscaler keeps);
- ``metrics(sim) -> dict`` extra result fields (``macro_solve_ms_p99`` where a plan is solved).

Baselines: ``nearest`` (lowest RTT, never moves), ``round-robin`` (cycles over the regions in budget,
never moves), ``least-loaded`` (lowest utilisation of ready capacity; each slot moves sessions out of
overloaded regions to the least-loaded region with room — the reactive rebalancing of single-slot
methods), ``skylb`` (SkyLB-like: the nearest region while it has ready room, else spill-over to the
least-loaded region in budget with room; session affinity, never moves). ``torta``: the OT plan with
smoothing, the predictive floor, and moves only when they pay for their switching cost.
"""

from __future__ import annotations

import math
import time
import warnings
from typing import Any

import numpy as np

from scheduling.core.regions.forecast import (
    OracleForecaster,
    make_forecaster,
    prediction_accuracy,
    predictive_floor,
)
from scheduling.core.regions.moves import MoveCase, move_verdict
from scheduling.core.regions.transport import (
    CostWeights,
    TransportPlan,
    cost_matrix,
    gpu_pools,
    routing_probabilities,
    smooth_plan,
    solve_plan,
)

from .demand import origin_load_by_slot


class RegionPolicyError(ValueError):
    pass


class RegionPolicy:
    name = "base"

    def reset(self, sim) -> None:
        pass

    def route(self, sim, origin: int, load: float) -> int:
        raise NotImplementedError

    def on_slot(self, sim, now: float) -> None:
        pass

    def metrics(self, sim) -> dict[str, Any]:
        return {}


def _candidates(sim, origin: int) -> np.ndarray:
    return np.flatnonzero(sim.allowed[origin])


def _least_loaded_with_room(sim, origin: int, load: float, exclude: int | None = None) -> int | None:
    ready = sim.ready_capacity()
    region_load = sim.region_load()
    best, best_key = None, None
    for r in _candidates(sim, origin):
        if r == exclude or region_load[r] + load > ready[r] + 1e-9:
            continue
        key = ((region_load[r] + load) / ready[r], sim.rtt[origin, r])
        if best_key is None or key < best_key:
            best, best_key = int(r), key
    return best


class NearestPolicy(RegionPolicy):
    name = "nearest"

    def route(self, sim, origin, load):
        return int(sim.nearest[origin])


class RoundRobinPolicy(RegionPolicy):
    name = "round-robin"

    def reset(self, sim):
        self.cursor = np.zeros(sim.n_origins, dtype=int)

    def route(self, sim, origin, load):
        regions = _candidates(sim, origin)
        region = regions[self.cursor[origin] % len(regions)]
        self.cursor[origin] += 1
        return int(region)


class LeastLoadedPolicy(RegionPolicy):
    name = "least-loaded"

    def route(self, sim, origin, load):
        ready = sim.ready_capacity()
        region_load = sim.region_load()
        regions = _candidates(sim, origin)
        keys = [((region_load[r] + load) / max(ready[r], 1e-9), sim.rtt[origin, r]) for r in regions]
        return int(regions[min(range(len(regions)), key=keys.__getitem__)])

    def on_slot(self, sim, now):
        # Reactive rebalancing: drain every overloaded region into regions with ready room.
        ready = sim.ready_capacity()
        for r in range(sim.n_regions):
            for sid in sorted(sim.region_sessions[r], key=lambda s: (-sim.sessions[s].load, s)):
                if sim.region_load()[r] <= ready[r] + 1e-9:
                    break
                session = sim.sessions[sid]
                target = _least_loaded_with_room(sim, session.origin, session.load, exclude=r)
                if target is not None:
                    sim.move(sid, target)


class SkyLbPolicy(RegionPolicy):
    """Local first, spill over to the least-loaded region in budget with room; sessions stay put."""

    name = "skylb"

    def route(self, sim, origin, load):
        local = int(sim.nearest[origin])
        if sim.region_load()[local] + load <= sim.ready_capacity()[local] + 1e-9:
            return local
        spill = _least_loaded_with_room(sim, origin, load, exclude=local)
        return local if spill is None else spill


class TortaPolicy(RegionPolicy):
    """TORTA's macro layer without the RL refinement: OT plan → row-normalise → smooth (§5.2), the
    regional predictive floor (§5.3.1, Eq. 6), and cost-benefit-gated moves of live sessions.

    Options: ``method`` (emd | sinkhorn), ``beta`` (smoothing step), ``forecast`` (ets |
    seasonal-naive | last-value | oracle | none — none disables the floor; oracle knows the future,
    blurred by ``oracle_noise``), ``sigma`` (Eq. 6 safety factor),
    ``refit_every`` (slots between ETS refits), ``w_rtt``/``w_transfer``/``w_price`` (cost weights,
    ms-equivalents per ms and per $/load-unit-hour), ``switch_penalty`` (how many ms of saving one ms
    of stall must buy before a session moves), ``move_cooldown_s`` (a session moved less than this ago
    stays; a move back also pays the switch that brought it: ``moves.PastMove``).
    """

    name = "torta"

    def __init__(
        self,
        *,
        method: str = "emd",
        beta: float = 0.5,
        forecast: str = "ets",
        sigma: float = 0.5,
        refit_every: int = 40,
        w_rtt: float = 1.0,
        w_transfer: float = 100.0,
        w_price: float = 100.0,
        switch_penalty: float = 1.0,
        move_cooldown_s: float = 300.0,
        reactive_utilisation: float = 1.0,
        oracle_noise: float = 0.0,
    ):
        if method not in ("emd", "sinkhorn"):
            raise RegionPolicyError(f"method must be 'emd' or 'sinkhorn', got {method!r}")
        if not 0 < beta <= 1:
            raise RegionPolicyError(f"beta must be in (0, 1], got {beta!r}")
        if forecast not in ("ets", "seasonal-naive", "last-value", "oracle", "none"):
            raise RegionPolicyError(
                f"forecast must be ets, seasonal-naive, last-value, oracle or none, got {forecast!r}"
            )
        if oracle_noise < 0:
            raise RegionPolicyError(f"oracle_noise must be >= 0, got {oracle_noise!r}")
        self.oracle_noise = oracle_noise
        if sigma < 0 or refit_every < 1 or switch_penalty < 0 or move_cooldown_s < 0:
            raise RegionPolicyError(
                "sigma, switch_penalty and move_cooldown_s must be >= 0, refit_every >= 1"
            )
        self.move_cooldown_s = move_cooldown_s
        self.method = method
        self.beta = beta
        self.forecast_name = forecast
        self.sigma = sigma
        self.refit_every = refit_every
        self.weights = CostWeights(w_rtt, w_transfer, w_price)
        self.switch_penalty = switch_penalty
        if not 0 < reactive_utilisation <= 1:
            raise RegionPolicyError(f"reactive_utilisation must be in (0, 1], got {reactive_utilisation!r}")
        self.reactive_utilisation = reactive_utilisation

    def reset(self, sim):
        config = sim.config
        # Supply columns are (region, GPU type) pools; routing and the floor use their region sums.
        self.pools = gpu_pools(sim.limits, sim.type_capacity, sim.gpu_price_h)
        self.pool_allowed = sim.allowed[:, self.pools.region]
        self.pool_cost = cost_matrix(
            sim.rtt[:, self.pools.region],
            sim.transfer_per_unit_h[:, self.pools.region],
            self.pools.price_per_unit_h,
            self.weights,
        )
        self.pool_supply = self.pools.capacity * config.target_utilisation
        self.supply = sim.max_capacity * config.target_utilisation
        # Region-level cost for routing fallbacks: the region's cheapest pool.
        self.cost = cost_matrix(sim.rtt, sim.transfer_per_unit_h, sim.price_per_unit_h, self.weights)
        season = max(1, round(sim.trace.meta.get("day_s", 3 * 3600.0) / config.slot_s))
        if self.forecast_name == "oracle":
            truth = origin_load_by_slot(sim.trace, sim.topology, config.tick_s, config.slot_s)
            self.forecaster = OracleForecaster(truth, self.oracle_noise)
        else:
            self.forecaster = make_forecaster(
                "last-value" if self.forecast_name == "none" else self.forecast_name,
                sim.n_origins,
                season=season,
                refit_every=self.refit_every,
            )
        # GPUs requested now are ready a provisioning delay later and must serve until the slot after:
        # the floor uses the forecast at that step (a max over the steps would hold capacity through
        # every decline).
        self.horizon = max(1, math.ceil((config.provisioning_delay_s + config.slot_s) / config.slot_s))
        self.floor_step = self.horizon - 1
        self.plan: np.ndarray | None = None
        self.slot_counts = np.zeros((sim.n_origins, sim.n_regions))
        self.solve_ms: list[float] = []
        self.predicted: list[np.ndarray] = []  # one-step forecasts, compared with what came
        self.actual: list[np.ndarray] = []
        self._last_forecast: np.ndarray | None = None
        if self.forecast_name != "none":
            sim.reactive_utilisation = self.reactive_utilisation

    # -- macro plan ------------------------------------------------------------------------------

    def on_slot(self, sim, now):
        history = sim.origin_load_history
        if not history:
            return
        observed = history[-1]
        if self._last_forecast is not None:
            self.predicted.append(self._last_forecast)
            self.actual.append(observed)
        self.forecaster.observe(observed)
        ahead = self.forecaster.forecast(self.horizon)
        next_slot = ahead[:, 0]
        self._last_forecast = next_slot

        started = time.perf_counter()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            pooled = solve_plan(
                next_slot, self.pool_supply, self.pool_cost, self.pool_allowed, method=self.method
            )
        plan = TransportPlan(self.pools.to_regions(pooled.flow, sim.n_regions), pooled.overflow)
        probabilities = routing_probabilities(plan, sim.allowed, self.supply)
        self.plan = smooth_plan(self.plan, probabilities, self.beta)
        self.solve_ms.append((time.perf_counter() - started) * 1000.0)
        self.slot_counts[:] = 0

        if self.forecast_name != "none":
            self._set_floor(sim, ahead[:, self.floor_step])
        self._move_overloaded(sim, now)

    def _set_floor(self, sim, demand: np.ndarray) -> None:
        """Eq. 6 per region, on the demand expected there one provisioning delay ahead: live sessions
        stay where they are, the share that turns over within the horizon follows the plan."""
        horizon_s = sim.config.provisioning_delay_s + sim.config.slot_s
        turnover = min(1.0, horizon_s / sim.expected_session_s())
        by_origin = sim.load_or.sum(axis=1, keepdims=True)
        current = np.where(by_origin > 0, sim.load_or / np.maximum(by_origin, 1e-12), self.plan)
        share = (1.0 - turnover) * current + turnover * self.plan
        region_demand = demand @ share
        floor = np.zeros(sim.n_regions)
        for r in range(sim.n_regions):
            # Q = 0: an overloaded region serves every session, slower, rather than queueing some, and
            # F forecasts the whole active load, overloaded or not; adding the overload would count it twice.
            gpus = predictive_floor(
                0.0,
                region_demand[r],
                sim.capacity_per_gpu[r],
                sigma=self.sigma,
                max_gpus=int(sim.max_gpus[r]),
            )
            floor[r] = gpus * sim.capacity_per_gpu[r]
        sim.floor_capacity = floor

    # -- routing ---------------------------------------------------------------------------------

    def route(self, sim, origin, load):
        regions = _candidates(sim, origin)
        if self.plan is None:
            local = int(sim.nearest[origin])
            if sim.region_load()[local] + load <= sim.ready_capacity()[local] + 1e-9:
                return local
            spill = _least_loaded_with_room(sim, origin, load)
            return local if spill is None else spill
        # Follow the plan's split for this origin: the region furthest behind its share this slot.
        counts = self.slot_counts[origin]
        deficit = self.plan[origin, regions] * (counts.sum() + 1) - counts[regions]
        region = int(regions[int(np.argmax(deficit))])
        ready = sim.ready_capacity()
        region_load = sim.region_load()
        if region_load[region] + load > ready[region] + 1e-9:
            # The planned region has no ready room (its GPUs are still booting): take the cheapest
            # region in budget that has, by the same cost the plan minimises.
            roomy = [r for r in regions if region_load[r] + load <= ready[r] + 1e-9]
            if roomy:
                region = int(min(roomy, key=lambda r: self.cost[origin, r]))
            else:
                # Nowhere has ready room: the region that will be least loaded once its GPUs boot.
                coming = ready + sim.pending_capacity()
                region = int(
                    min(regions, key=lambda r: ((region_load[r] + load) / coming[r], self.cost[origin, r]))
                )
        self.slot_counts[origin, region] += 1
        return region

    # -- moves -----------------------------------------------------------------------------------

    def _move_overloaded(self, sim, now):
        """Move a live session out of an overloaded region only if the latency it saves (its own and
        its neighbours', until the region's booting GPUs relieve it) beats its stall × switch_penalty
        (``moves.move_verdict``, the live scheduler's rule too)."""
        config = sim.config
        ready = sim.ready_capacity()
        expected_s = sim.expected_session_s()
        for r in range(sim.n_regions):
            if sim.region_load()[r] <= ready[r] + 1e-9:
                continue
            relief_s = self._relief_s(sim, r, now, expected_s)
            for sid in sorted(sim.region_sessions[r], key=lambda s: (-sim.sessions[s].load, s)):
                load_r = sim.region_load()[r]
                if load_r <= ready[r] + 1e-9:
                    break
                session = sim.sessions[sid]
                target = _least_loaded_with_room(sim, session.origin, session.load, exclude=r)
                if target is None:
                    continue
                verdict = move_verdict(
                    MoveCase(
                        load=session.load,
                        source_load=load_r,
                        source_capacity=ready[r],
                        target_load=sim.region_load()[target],
                        target_capacity=ready[target],
                        source_rtt_ms=sim.rtt[session.origin, r],
                        target_rtt_ms=sim.rtt[session.origin, target],
                        neighbours=sim.count_or[:, r].sum() - 1,
                        chunk_ms=config.chunk_ms,
                        chunks=min(relief_s, expected_s) / config.chunk_period_s,
                    ),
                    switch_cost_ms=sim.stall_ms(session.origin, target),
                    switch_penalty=self.switch_penalty,
                    target=target,
                    last_move=sim.last_move(sid),
                    cooldown_s=self.move_cooldown_s,
                )
                if verdict.pays:
                    sim.move(sid, target)

    @staticmethod
    def _relief_s(sim, r: int, now: float, horizon_s: float) -> float:
        """Seconds until GPUs already booting in region ``r`` cover its overload (``horizon_s`` if never)."""
        overload = sim.region_load()[r] - sim.ready_capacity()[r]
        arriving = sorted((t, sim.type_capacity[k]) for t, rr, k in sim.pending if rr == r)
        covered = 0.0
        for ready_at, capacity in arriving:
            covered += capacity
            if covered >= overload - 1e-9:
                return max(0.0, ready_at - now)
        return horizon_s

    def metrics(self, sim):
        solve = np.array(self.solve_ms) if self.solve_ms else np.zeros(1)
        accuracy = None
        if self.predicted:
            accuracy = prediction_accuracy(np.sum(self.predicted, axis=1), np.sum(self.actual, axis=1))
        return {
            "macro_solve_ms_p99": float(np.percentile(solve, 99)),
            "macro_solve_ms_mean": float(solve.mean()),
            "transport": self.method,
            "forecast": self.forecast_name,
            "forecast_accuracy": accuracy,
            "forecast_fits": self.forecaster.fits,
            "forecast_fit_s": self.forecaster.fit_seconds,
        }


POLICIES = {
    "torta": TortaPolicy,
    "nearest": NearestPolicy,
    "round-robin": RoundRobinPolicy,
    "least-loaded": LeastLoadedPolicy,
    "skylb": SkyLbPolicy,
}


def make_region_policy(name: str, **options: Any) -> RegionPolicy:
    if name not in POLICIES:
        raise RegionPolicyError(f"unknown policy {name!r} (expected one of {sorted(POLICIES)})")
    try:
        return POLICIES[name](**options)
    except TypeError as exc:
        raise RegionPolicyError(f"{name}: {exc}") from None
