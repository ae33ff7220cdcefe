"""TurboServe closed-loop policy (§5, Algorithm 1, Appendix A) plus two switchable extensions.

Per event:
1. the workload detector records the event and looks up (λ, ρ̂) for the current volatility level;
2. PLACE: idle residents are suspended, pending active sessions are assigned (Eq. 3, min resulting
   bottleneck latency, tie-break less loaded), then migration-aware min-max rebalancing (Eq. 4);
3. SCALE: ρ_max feedback with hysteresis ρ̂ ± δ and the proportional target
   M_tar = ⌈N_req / (K·ρ̂)⌉ clamped to [M_min, M_max] (computed in capacity units so that
   heterogeneous types work; homogeneous pools give exactly the paper's formula);
   scale-out adds GPUs (they count toward cost and budget, not capacity, until ready) and placement
   rebalances onto them when they report ready; scale-in consolidates first and releases only
   GPUs left empty (Algorithm 1 lines 4–9).

Beyond the paper, each switchable so its effect can be measured:
* ``headroom``: spare capacity for the net new activations the detector expects within one
  provisioning delay (drift + z·σ over that horizon, the rule of ``scheduling.core.spares``), and
  that predicted load also triggers scale-out — a burst during boot is what sets the worst-case
  latency. ``spares="off"`` feeds the rule as before (the type's stated delay, ``headroom_z``, added to
  N_req before ÷ρ̂); ``spares="boot-aware"`` (issue 27) with the delay the platform predicts for its
  next scale-out (``Snapshot.scale_out_delay_s``), ``spare_margin_z`` and the floor ``spare_min``,
  kept as free capacity at K: the need is max(N_req/ρ̂, N_req + spare);
* ``cooldown_s``: no scale-in until this long after the last scale-out (anti-flapping);
* ``release_grace_s`` (default half the type's provisioning delay): a drained GPU, once empty, stays
  (paid, warm) this long before release, so a scale-out soon after a scale-in un-drains it instead
  of waiting a whole provisioning delay for a new one (the ski-rental trade-off);
* ``scale_in_window_s`` (default 0 = off; ``None`` = one provisioning delay of the type the pool
  would add): scale-in releases only capacity above the largest observed need N_req/ρ̂ in this
  trailing window — the scale-down stabilisation window of Kubernetes' HPA, sized by the boot time.
  A dip shorter than the window keeps its GPUs. Off by default: on the reproduction's generated
  traces it cost more than it saved (docs/results, extension ablation, two seeds).

One-shot jobs (issue 14, GenServe beside the streams): when the snapshot reports the jobs' GPU
demand (``job_demand_gpus``, their backlog against deadlines), the empty GPUs running jobs
(``job_gpus``) and more empty GPUs up to ⌈demand⌉ are kept out of stream placement and rebalancing —
unless an active session finds no other room or a stream GPU is above K (streams first: kept GPUs
are given back one at a time, those without a job first) — and max(demand, GPUs kept), in capacity
units, is added to N_req/ρ̂ for scaling.

Predictive floor (TORTA Eq. 6, issue 16): when the snapshot carries a forecast load F
(``floor_load``, the decision pipeline's input: ``scheduling.core.pipeline``), the need is at least
the capacity of ⌈(F + σ·√F) / (K·ρ̂)⌉ GPUs, so scale-out starts before the load shows in ρ and
scale-in keeps them; the floor's GPUs are reported in ``Signals.floor_gpus``.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .detector import (
    VolatilityLevel,
    VolatilityTable,
    WorkloadDetector,
    fixed_table,
    load_volatility_table,
)
from .index import UNIT, exact_units
from .placement import PlacementWork
from .policy import Policy
from .regions.forecast import predictive_floor
from .spares import DEFAULT_MARGIN_Z, SPARE_POLICIES, SpareInputs, SpareTarget, spare_target
from .types import Decision, Event, EventKind, GpuTypeSpec, Signals, Snapshot

_EPS = 1e-9


def target_budget(n_req: float, capacity: float, rho_hat: float, m_min: int, m_max: int) -> int:
    """M_tar = ⌈N_req / (K·ρ̂)⌉ clamped to [M_min, M_max] (§5.2.2)."""
    m = math.ceil(n_req / (capacity * rho_hat) - 1e-9) if n_req > 0 else 0
    return max(m_min, min(m_max, m))


def hysteresis(rho_max: float, rho_hat: float, delta: float) -> int:
    """+1 scale out when ρ_max > ρ̂ + δ, −1 scale in when ρ_max < ρ̂ − δ, else 0."""
    if rho_max > rho_hat + delta:
        return 1
    if rho_max < rho_hat - delta:
        return -1
    return 0


def cheapest_type(gpu_types: dict[str, GpuTypeSpec] | Any, counts: dict[str, int]) -> str | None:
    """Type with the lowest price per unit of capacity that still has availability."""
    best = None
    for name in sorted(gpu_types):
        spec = gpu_types[name]
        if spec.availability is not None and counts.get(name, 0) >= spec.availability:
            continue
        key = (spec.price_per_hour / spec.capacity, spec.provisioning_delay_s, name)
        if best is None or key < best:
            best = key
    return best[2] if best else None


class TurboServePolicy(Policy):
    name = "turboserve"
    accepts_rho_hat = True

    def __init__(
        self,
        *,
        migration: bool = True,
        autoscale: bool = True,
        headroom: bool = True,
        headroom_z: float = 0.5,
        spares: str = "off",
        spare_margin_z: float = DEFAULT_MARGIN_Z,
        spare_min: float = 0.0,
        cooldown_s: float = 30.0,
        eta: float = 0.5,
        delta: float = 0.1,
        min_residency_s: float = 2.0,
        release_grace_s: float | None = None,
        scale_in_window_s: float | None = 0.0,
        table: VolatilityTable | str | Path | None = None,
        rho_hat: float | None = None,
        name: str | None = None,
    ):
        if rho_hat is not None:
            table = fixed_table(rho_hat)
        elif table is None or isinstance(table, str | Path):
            table = load_volatility_table(table)
        self.table: VolatilityTable = table
        self.detector = WorkloadDetector(table)
        self.migration = migration
        self.autoscale = autoscale
        self.headroom = headroom
        self.headroom_z = headroom_z
        if spares not in SPARE_POLICIES:
            raise ValueError(f"spares must be one of {', '.join(SPARE_POLICIES)}, got {spares!r}")
        if not (math.isfinite(spare_margin_z) and spare_margin_z >= 0):
            raise ValueError("spare_margin_z must be a finite number >= 0")
        if not (math.isfinite(spare_min) and spare_min >= 0):
            raise ValueError("spare_min must be a finite number >= 0")
        self.spares = spares
        self.spare_margin_z = spare_margin_z
        self.spare_min = spare_min
        self.cooldown_s = cooldown_s
        self.eta = eta
        self.delta = delta
        self.min_residency_s = min_residency_s
        self.release_grace_s = release_grace_s
        if scale_in_window_s is not None and not scale_in_window_s >= 0:
            raise ValueError("scale_in_window_s must be >= 0")
        self.scale_in_window_s = scale_in_window_s
        # Sliding maximum of the capacity each decision needed: [second, needed], values decreasing.
        self.needed_window: list[list[float]] = []
        self.drained_at: dict[str, float] = {}
        self.last_scale_out = -math.inf
        self.last_scale_in = -math.inf
        # σ of the predictive floor (TORTA Eq. 6), whose input F is the snapshot's ``floor_load``.
        self.floor_sigma = 0.5
        if name:
            self.name = name

    def describe(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "migration": self.migration,
            "autoscale": self.autoscale,
            "headroom": self.headroom,
            "headroom_z": self.headroom_z,
            "spares": self.spares,
            "spare_margin_z": self.spare_margin_z,
            "spare_min": self.spare_min,
            "cooldown_s": self.cooldown_s,
            "eta": self.eta,
            "delta": self.delta,
            "min_residency_s": self.min_residency_s,
            "release_grace_s": self.release_grace_s,
            "scale_in_window_s": self.scale_in_window_s,
            "levels": len(self.table.levels),
        }

    def state_dict(self) -> dict[str, Any]:
        return {
            "detector": self.detector.state_dict(),
            "last_scale_out": None if math.isinf(self.last_scale_out) else self.last_scale_out,
            "last_scale_in": None if math.isinf(self.last_scale_in) else self.last_scale_in,
            "drained_at": dict(sorted(self.drained_at.items())),
            "needed_window": [list(row) for row in self.needed_window],
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.detector.load_state_dict(state.get("detector", {}))
        out, inn = state.get("last_scale_out"), state.get("last_scale_in")
        self.last_scale_out = -math.inf if out is None else float(out)
        self.last_scale_in = -math.inf if inn is None else float(inn)
        self.drained_at = {str(k): float(v) for k, v in state.get("drained_at", {}).items()}
        self.needed_window = [[float(t), float(v)] for t, v in state.get("needed_window", [])]

    def _needed_in_window(self, now: float, needed: float, window_s: float) -> float:
        """Record ``needed`` and return the most capacity needed within the last ``window_s``.

        A monotonic deque with one entry per whole second: O(1) amortised per decision and at most
        ``window_s + 1`` entries, so the persisted state stays small at any event rate.
        """
        rows = self.needed_window
        second = float(math.floor(now))
        while rows and rows[-1][1] <= needed:
            rows.pop()
        if not rows or rows[-1][0] != second:
            rows.append([second, needed])
        while rows and rows[0][0] < second - window_s:
            rows.pop(0)
        return max(needed, rows[0][1]) if rows else needed

    # ------------------------------------------------------------------------------------------
    @staticmethod
    def _reserve_for_jobs(snapshot: Snapshot, work: PlacementWork) -> list[str]:
        """Empty ready GPUs kept out of stream placement for jobs (issue 14): those running a job,
        then others up to ⌈job demand⌉ in all. Ordered so that ``pop()`` gives back a GPU without a
        job first."""
        if not snapshot.job_gpus and snapshot.job_demand_gpus <= 0:
            return []
        busy = set(snapshot.job_gpus)
        empty = [g for g in work.eligible if work.count[g] == 0 and snapshot.gpus[g].status == "ready"]
        with_job = [g for g in empty if g in busy]
        spare = max(0, math.ceil(snapshot.job_demand_gpus - 1e-9) - len(with_job))
        reserved = with_job + [g for g in empty if g not in busy][:spare][::-1]
        for gid in reserved:
            work.make_ineligible(gid)
        return reserved

    def decide(self, snapshot: Snapshot, event: Event) -> Decision:
        """One event (Algorithm 1): observe it, PLACE (suspend, assign, rebalance), then SCALE. Its
        inputs beyond the sessions and GPUs — the jobs' demand and the predictive floor — are fields
        of ``snapshot`` (``job_demand_gpus``, ``job_gpus``, ``floor_load``), never attributes."""
        now = snapshot.time
        # A tenant over its GPU quota's arrivals and departures are not the demand the detector
        # forecasts headroom from (issue 29): the pool never grows for them.
        observed = (
            event if event.session is None or event.session not in snapshot.spare_only else _tick(event)
        )
        sigma, level = self._observe(now, observed)
        rho_hat = level.rho_hat
        work = PlacementWork(snapshot, eta=self.eta, min_residency_s=self.min_residency_s)
        suspend, reserved, queue = self._place(snapshot, work)
        pool = _PoolCensus.of(snapshot)
        if self.migration:
            for gid in pool.draining:
                work.evacuate(gid)
            work.relieve_overflow()
            work.rebalance()

        # Demand: the placed load and the waiting sessions', less the tenants' over a GPU quota
        # (issue 29): what they run or wait for never asks for GPUs.
        spare = _spare_load(snapshot, work, set(suspend) | set(queue)) if snapshot.spare_only else {}
        demand_queue = [s for s in queue if s not in snapshot.spare_only]
        n_req = work.total_load() - sum(spare.values())
        n_req += sum(snapshot.sessions[s].load for s in demand_queue)
        rho_max = work.rho_max()
        if not work.n_eligible and n_req > 0:
            rho_max = math.inf
        signal_rho = rho_max
        if spare and work.eligible:
            signal_rho = max(
                ((work.load[g] - spare.get(g, 0.0)) / work.spec[g].capacity for g in work.eligible),
                default=0.0,
            )
        need = self._need(snapshot, pool, n_req, rho_hat, reserved)
        plan = _ScalePlan(pool.live, dict(pool.counts), {}, [], [], [])
        if self.autoscale:
            signal = signal_rho
            if self.headroom and self.spares == "off" and pool.capacity > 0:
                signal = max(signal, (n_req + need.headroom) / pool.capacity)
            direction = hysteresis(signal, rho_hat, self.delta)
            if direction < 0 and spare and hysteresis(rho_max, rho_hat, self.delta) >= 0:
                # Not demand, but running: the pool does not shrink under it either.
                direction = 0
            # Boot-aware spares: short as soon as the free capacity at K (booting GPUs count: they
            # arrive within the delay) is below the spare target.
            spare_short = self.spares == "boot-aware" and pool.capacity - n_req < need.headroom - _EPS
            short = (
                direction > 0 or demand_queue or need.floor_short or need.job_capacity > _EPS or spare_short
            )
            if short and need.needed > pool.capacity + _EPS:
                self._scale_out(snapshot, work, pool, need, plan, queue)
            elif direction < 0 and not queue and now - self.last_scale_out >= self.cooldown_s:
                self._scale_in(snapshot, work, pool, need, plan, reserved)
            if plan.budget < snapshot.min_gpus:
                self._warm_minimum(snapshot, plan)
        self._release_drained(snapshot, work, pool, plan)

        migrations, assigns = work.migrations()
        return Decision(
            time=now,
            assign=assigns,
            migrations=migrations,
            suspend=tuple(suspend),
            queue=tuple(queue),
            target_budget=max(plan.budget, 0),
            add_gpus=tuple(sorted(plan.add.items())),
            drain=tuple(plan.drain),
            undrain=tuple(plan.undrain),
            release=tuple(plan.release),
            signals=Signals(
                rho_max=rho_max if math.isfinite(rho_max) else 1e9,
                volatility=sigma,
                volatility_level=level.level,
                lam=level.lam,
                rho_hat=rho_hat,
                n_req=n_req,
                headroom=need.headroom,
                bottleneck_ms=work.bottleneck_ms(),
                floor_gpus=need.floor_gpus,
                spares=need.spares,
            ),
        )

    def _observe(self, now: float, event: Event) -> tuple[float, VolatilityLevel]:
        """The workload detector sees the event and gives the volatility level's (λ, ρ̂)."""
        if math.isinf(self.last_scale_out):
            # The pool we start with counts as a scale-out: do not dump a warm pool before the
            # first cooldown has shown what load arrives.
            self.last_scale_out = now
        if event.kind in ("active", "idle", "depart"):
            self.detector.observe(now, event.kind, event.was_active)
        return self.detector.level(now)

    def _place(self, snapshot: Snapshot, work: PlacementWork) -> tuple[list[str], list[str], list[str]]:
        """PLACE (Algorithm 1 line 2) before rebalancing: suspend idle residents, keep GPUs for jobs,
        assign U(t) (Eq. 3). Returns the suspended sessions, the GPUs still kept for jobs and the
        sessions left waiting."""
        suspend: list[str] = []
        for sid in snapshot.idle_resident:
            work.remove(sid, snapshot.sessions[sid].gpu)  # type: ignore[arg-type]
            suspend.append(sid)
        reserved = self._reserve_for_jobs(snapshot, work)
        queue = _assign(work, snapshot.pending)
        while reserved and (queue or work.rho_max() > 1.0 + _EPS):
            # Streams first: while a session finds no room or a stream GPU is above K, GPUs kept for
            # jobs are given back one at a time, those without a job step in flight first (the list
            # ends with them); rebalancing below then moves load onto them.
            work.make_eligible(reserved.pop())
            queue = _assign(work, queue)
        return suspend, reserved, queue

    def _need(
        self, snapshot: Snapshot, pool: _PoolCensus, n_req: float, rho_hat: float, reserved: list[str]
    ) -> _Need:
        """The capacity the pool needs (load units at K): N_req (+ headroom) / ρ̂, raised to the
        predictive floor, plus the jobs' demand; and the most needed within the scale-in window."""
        now = snapshot.time
        add_type = cheapest_type(snapshot.gpu_types, pool.counts)
        delay = snapshot.gpu_types[add_type].provisioning_delay_s if add_type else 0.0
        spares = self._spares(snapshot, add_type, delay) if self.headroom else None
        headroom = spares.target if spares is not None else 0.0
        if self.spares == "boot-aware":
            # Spares are free capacity at K: the slack ρ̂ leaves counts toward them.
            needed = max(n_req / rho_hat, n_req + headroom)
        else:
            needed = (n_req + headroom) / rho_hat
        floor_gpus = None
        floor_capacity = 0.0
        if self.autoscale:
            floor_gpus, floor_capacity = self._floor(snapshot, add_type, rho_hat)
        floor_short = floor_capacity > pool.capacity + _EPS
        needed = max(needed, floor_capacity)
        # The jobs need their demand, and at least the GPUs kept for them (out of the streams' reach).
        job_gpus = max(snapshot.job_demand_gpus, float(len(reserved)))
        job_capacity = job_gpus * snapshot.gpu_types[add_type].capacity if add_type else 0.0
        needed += job_capacity
        window = delay if self.scale_in_window_s is None else self.scale_in_window_s
        # The window holds the observed need (N_req/ρ̂), not the forecast: a forecast that did not
        # materialise (a ramp that ended) must not keep its GPUs for another window.
        needed_recently = needed
        if self.autoscale:
            needed_recently = max(needed, self._needed_in_window(now, n_req / rho_hat, window))
            needed_recently = max(needed_recently, floor_capacity)
        return _Need(
            headroom=headroom,
            needed=needed,
            needed_recently=needed_recently,
            floor_gpus=floor_gpus,
            floor_short=floor_short,
            job_capacity=job_capacity,
            spares=spares,
        )

    def _spares(self, snapshot: Snapshot, add_type: str | None, stated_delay: float) -> SpareTarget:
        """The spare rule (``scheduling.core.spares``) on this decision's inputs: ``off`` with the
        type's stated delay and ``headroom_z``; ``boot-aware`` with the delay the platform predicts
        for its next scale-out of that type, the margin and the floor."""
        mean, std = self.detector.net_activation_stats(snapshot.time)
        delay, source, z, floor = stated_delay, "stated", self.headroom_z, 0.0
        if self.spares == "boot-aware":
            z, floor = self.spare_margin_z, self.spare_min
            predicted = (snapshot.scale_out_delay_s or {}).get(add_type) if add_type else None
            if predicted is not None:
                delay, source = predicted, "predicted"
        return spare_target(
            SpareInputs(
                policy=self.spares,
                delay_s=delay,
                delay_source=source,
                bin_s=self.detector.bin_s,
                mean_per_bin=mean,
                std_per_bin=std,
                margin_z=z,
                floor=floor,
                job_gpus=snapshot.job_demand_gpus,
            )
        )

    def _floor(self, snapshot: Snapshot, add_type: str | None, rho_hat: float) -> tuple[int | None, float]:
        """The predictive floor (TORTA Eq. 6) on the snapshot's forecast load F (``floor_load``): its
        GPUs (``None``: no floor this decision) and their capacity in load units at K, with Q = 0 and
        C = K·ρ̂ of the type scale-out would add, so the floor's GPUs run at the same target as the
        reactive part."""
        if snapshot.floor_load is None or add_type is None:
            return None, 0.0
        k = snapshot.gpu_types[add_type].capacity
        gpus = predictive_floor(
            0.0, snapshot.floor_load, k * rho_hat, sigma=self.floor_sigma, max_gpus=snapshot.max_gpus
        )
        return gpus, gpus * k

    def _scale_out(
        self,
        snapshot: Snapshot,
        work: PlacementWork,
        pool: _PoolCensus,
        need: _Need,
        plan: _ScalePlan,
        queue: list[str],
    ) -> None:
        """Scale-out precedes rebalancing (Algorithm 1 lines 7–9): undrain paid-for GPUs first, then
        add the cheapest types until the need is covered; waiting sessions take undrained GPUs."""
        deficit = need.needed - pool.capacity
        for gid in sorted(pool.draining, key=lambda g: (-work.load.get(g, 0.0), g)):
            if deficit <= _EPS:
                break
            plan.undrain.append(gid)
            work.make_eligible(gid)
            deficit -= work.spec[gid].capacity
            plan.budget += 1
        total = sum(plan.counts.values())
        while deficit > _EPS and total < snapshot.max_gpus:
            t = cheapest_type(snapshot.gpu_types, plan.counts)
            if t is None:
                break
            plan.add_one(t)
            total += 1
            deficit -= snapshot.gpu_types[t].capacity
        if plan.add or plan.undrain:
            self.last_scale_out = snapshot.time
        if plan.undrain:
            queue[:] = _assign(work, queue)
            if self.migration:
                # The undrained GPUs may give room below K that GPUs above K must use first.
                work.relieve_overflow()
                work.rebalance()

    def _scale_in(
        self,
        snapshot: Snapshot,
        work: PlacementWork,
        pool: _PoolCensus,
        need: _Need,
        plan: _ScalePlan,
        reserved: list[str],
    ) -> None:
        """Scale-in (Algorithm 1 lines 4–6): consolidate, then drain; release only GPUs left empty.
        Only capacity no decision in the stabilisation window needed is surplus: cancel the newest
        booting GPUs first, then drain the least loaded, dearest per unit of capacity."""
        gpus, types = snapshot.gpus, snapshot.gpu_types
        surplus = pool.capacity - need.needed_recently
        if plan.budget <= snapshot.min_gpus:
            # Nothing may go (the loop below would skip every GPU): skip sorting them all.
            if self.migration:
                work.rebalance()
            return
        cancel = sorted(pool.provisioning, key=lambda g: (-gpus[g].requested_at, g))
        ready = sorted(
            (g for g in work.eligible if g not in reserved),
            key=lambda g: (
                work.rho(g),
                -types[gpus[g].gpu_type].price_per_hour / types[gpus[g].gpu_type].capacity,
                g,
            ),
        )
        for gid in cancel + ready:
            k = types[gpus[gid].gpu_type].capacity
            if plan.budget <= snapshot.min_gpus or k > surplus + _EPS:
                continue
            if gpus[gid].status == "provisioning":
                plan.release.append(gid)
            else:
                if work.n_eligible <= 1:
                    continue
                work.make_ineligible(gid)
                plan.drain.append(gid)
            surplus -= k
            plan.budget -= 1
        if plan.drain or plan.release:
            self.last_scale_in = snapshot.time
        if self.migration:
            for gid in plan.drain:
                work.evacuate(gid)
            work.rebalance()

    @staticmethod
    def _warm_minimum(snapshot: Snapshot, plan: _ScalePlan) -> None:
        """Warm minimum pool (M_min): keep it provisioned even without load."""
        total = sum(plan.counts.values())
        while plan.budget < snapshot.min_gpus and total < snapshot.max_gpus:
            t = cheapest_type(snapshot.gpu_types, plan.counts)
            if t is None:
                break
            plan.add_one(t)
            total += 1

    def _release_drained(
        self, snapshot: Snapshot, work: PlacementWork, pool: _PoolCensus, plan: _ScalePlan
    ) -> None:
        """Release drained GPUs left empty once their grace has passed; forget GPUs that are gone or
        no longer draining (bounded, JSON-persisted state)."""
        now, gpus = snapshot.time, snapshot.gpus
        self.drained_at = {
            g: t for g, t in self.drained_at.items() if g in gpus and gpus[g].status == "draining"
        }
        for gid in plan.drain:
            self.drained_at[gid] = now
        for gid in plan.undrain:
            self.drained_at.pop(gid, None)
        for gid in pool.draining + plan.drain:
            if gid in plan.undrain or work.count[gid] != 0:
                continue
            # Keep an emptied GPU (paid, warm) for release_grace_s: a scale-out in that window
            # un-drains it at once instead of booting a new one for a full provisioning delay.
            grace = self.release_grace_s
            if grace is None:
                grace = 0.5 * snapshot.gpu_types[gpus[gid].gpu_type].provisioning_delay_s
            if now - self.drained_at.get(gid, -math.inf) >= grace:
                plan.release.append(gid)
                self.drained_at.pop(gid, None)


def _assign(work: PlacementWork, sessions: Iterable[str]) -> list[str]:
    """Assign each session to its best GPU (Eq. 3: min resulting bottleneck latency, tie-break less
    loaded), in order; returns those left without room."""
    waiting: list[str] = []
    for sid in sessions:
        gid = work.best_gpu(sid)
        if gid is None:
            waiting.append(sid)
        else:
            work.add(sid, gid)
    return waiting


@dataclass(slots=True)
class _PoolCensus:
    """One pass over the GPUs for everything the autoscaler needs: live (ready or booting) GPUs,
    their capacity, the booting and draining ones, and GPUs held per type (draining included)."""

    live: int = 0
    provisioning: list[str] = field(default_factory=list)
    draining: list[str] = field(default_factory=list)
    counts: dict[str, int] = field(default_factory=dict)
    capacity: float = 0.0

    @classmethod
    def of(cls, snapshot: Snapshot) -> _PoolCensus:
        """From the snapshot's index when it has one (O(booting + draining + types)); the capacity
        there is exact where every type's K is a whole number of 2⁻²⁰ units, else the float sum."""
        index = snapshot.index
        if index is not None:
            types = snapshot.gpu_types
            units = [exact_units(types[t].capacity) for t, n in index.live.items() if n]
            if all(u is not None for u in units):
                capacity = sum(
                    (exact_units(types[t].capacity) or 0) * n for t, n in sorted(index.live.items())
                )
                return cls(
                    sum(index.live.values()),
                    index.in_order(index.provisioning),
                    index.in_order(index.draining),
                    {t: n for t, n in index.held.items() if n},
                    capacity / UNIT,
                )
        live: list[str] = []
        provisioning: list[str] = []
        draining: list[str] = []
        counts: dict[str, int] = {}
        capacity = 0.0
        for gid, v in snapshot.gpus.items():
            status = v.status
            if status == "ready" or status == "provisioning":
                live.append(gid)
                capacity += snapshot.gpu_types[v.gpu_type].capacity
                if status == "provisioning":
                    provisioning.append(gid)
            elif status == "draining":
                draining.append(gid)
            else:
                continue
            counts[v.gpu_type] = counts.get(v.gpu_type, 0) + 1
        return cls(len(live), provisioning, draining, counts, capacity)


@dataclass(slots=True)
class _Need:
    """What the autoscaler scales to (capacity in load units at K)."""

    headroom: float
    needed: float
    needed_recently: float
    floor_gpus: int | None
    floor_short: bool
    job_capacity: float
    spares: SpareTarget | None = None


@dataclass(slots=True)
class _ScalePlan:
    """The SCALE half of a decision as it is built: budget and GPUs per type after it, and its
    actions."""

    budget: int
    counts: dict[str, int]
    add: dict[str, int] = field(default_factory=dict)
    drain: list[str] = field(default_factory=list)
    undrain: list[str] = field(default_factory=list)
    release: list[str] = field(default_factory=list)

    def add_one(self, gpu_type: str) -> None:
        self.add[gpu_type] = self.add.get(gpu_type, 0) + 1
        self.counts[gpu_type] = self.counts.get(gpu_type, 0) + 1
        self.budget += 1


class TurboServeNoMigration(TurboServePolicy):
    """Fig. 8 ablation: no migrations; new sessions are still placed and the pool still scales."""

    name = "turboserve-no-migration"

    def __init__(self, **kwargs: Any):
        super().__init__(migration=False, **kwargs)


class TurboServeNoAutoscale(TurboServePolicy):
    """Fig. 8 ablation: a fixed pool (static, like the baselines); placement and migration as usual."""

    name = "turboserve-no-autoscale"
    static = True

    def __init__(self, **kwargs: Any):
        super().__init__(autoscale=False, **kwargs)


class TurboServePaper(TurboServePolicy):
    """The paper's loop without our extensions: no headroom, cooldown, release grace or scale-in window."""

    name = "turboserve-paper"

    def __init__(self, **kwargs: Any):
        super().__init__(headroom=False, cooldown_s=0.0, release_grace_s=0.0, scale_in_window_s=0.0, **kwargs)


def _spare_load(snapshot: Snapshot, work: PlacementWork, unplaced: set[str]) -> dict[str, float]:
    """Per GPU, the load of sessions on spare capacity only (``Snapshot.spare_only``) where the
    placement leaves them (moved this decision, else where they execute; none while unplaced)."""
    spare: dict[str, float] = {}
    for sid in snapshot.spare_only:
        view = snapshot.sessions.get(sid)
        if view is None or sid in unplaced:
            continue
        gid = work.location.get(sid) or (view.gpu if view.state == "executing" else None)
        if gid is not None and gid in work.load:
            spare[gid] = spare.get(gid, 0.0) + view.load
    return spare


def _tick(event: Event) -> Event:
    return Event(time=event.time, kind=EventKind.TICK)
