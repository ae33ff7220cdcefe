"""A multi-region simulator in virtual time (``docs/regions.md``).

Model, per tick (default 5 s):

- Every region pools its ready GPUs (mixed types, each serving ``sessions_per_gpu`` load units at the
  chunk SLO). A region's chunks take ``chunk_ms × max(1, load / ready capacity)`` — the sessions share
  the pool, as a per-region placement that keeps GPUs balanced would — plus the RTT between the
  session's origin and the region. That is a chunk's latency; its mean over all chunks is the
  *response time*, its maximum the *worst chunk*.
- A moved session stalls for one chunk: its state crosses the WAN (``state_mb`` at ``wan_mbps``) and the
  user reconnects (one RTT). The stall counts in the chunk latencies of that session.
- Each region autoscales reactively: it requests GPUs (cheapest per load unit first, within its limits)
  when load exceeds ``target_utilisation`` of the capacity it has or awaits, and they become ready
  ``provisioning_delay_s`` later; it releases one GPU per tick (most expensive per load unit first) when
  the rest still keeps load under the target and no scale-out happened for ``scale_in_cooldown_s``. A
  policy may add a predictive floor (TORTA Eq. 6), which the autoscaler treats as a minimum capacity.
- GPUs are billed from request to release at their type's price × the region's multiplier.

Policies (``policies.py``) route each new session to a region and may move live sessions each slot
(default 45 s, TORTA §6.1). Sessions are counted while ``active``; idle sessions hold no GPU.
"""

from __future__ import annotations

import math
import time
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

from scheduling.core.regions.moves import PastMove, switch_cost_ms

from .demand import RegionTrace
from .topology import Topology


class RegionSimulationError(ValueError):
    pass


@dataclass(frozen=True)
class RegionSimConfig:
    slot_s: float = 45.0  # TORTA §6.1: 480 slots of 45 s in 6 h
    tick_s: float = 5.0
    chunk_ms: float = 600.0  # one chunk's compute at or under capacity
    chunk_period_s: float = 1.0  # one chunk per second of video per session
    slo_ms: float = 1000.0  # per-chunk latency SLO, RTT included
    provisioning_delay_s: float = 40.0  # our cold boot is 30–45 s
    target_utilisation: float = 0.85
    scale_in_cooldown_s: float = 90.0
    min_gpus_per_region: int = 1
    state_mb: float = 12.8  # a paused 480p streaming session (GenServe's measurement, NOTES-wave2)
    wan_mbps: float = 1000.0
    stream_gb_per_session_h: float = 0.9  # ≈ 2 Mbit/s of video to the user
    # Latency and cost are counted from here on: every region starts with min_gpus_per_region while
    # the first sessions pile up, a cold start that says nothing about the policies.
    warmup_s: float = 600.0

    def validate(self) -> None:
        for name in ("slot_s", "tick_s", "chunk_ms", "chunk_period_s", "slo_ms", "wan_mbps"):
            if not getattr(self, name) > 0:
                raise RegionSimulationError(f"{name} must be > 0")
        if self.slot_s < self.tick_s:
            raise RegionSimulationError("slot_s must be >= tick_s")
        if not 0 < self.target_utilisation <= 1:
            raise RegionSimulationError("target_utilisation must be in (0, 1]")
        if (
            self.provisioning_delay_s < 0
            or self.scale_in_cooldown_s < 0
            or self.state_mb < 0
            or self.warmup_s < 0
        ):
            raise RegionSimulationError("delays, cooldowns and state size must be >= 0")
        if self.min_gpus_per_region < 1:
            raise RegionSimulationError(
                "min_gpus_per_region must be >= 1 (a region without GPUs has no latency)"
            )


@dataclass
class Session:
    origin: int
    region: int
    load: float
    active: bool
    arrived_s: float
    moved: tuple[float, int, float] | None = None  # its last move: (time, region left, switching cost ms)


class RegionSimulator:
    """One run of one policy over one trace. Policies read the public attributes and call :meth:`move`."""

    def __init__(self, topology: Topology, trace: RegionTrace, policy: Any, config: RegionSimConfig):
        config.validate()
        self.topology = topology
        self.trace = trace
        self.policy = policy
        self.config = config
        self.n_origins = len(topology.origins)
        self.n_regions = len(topology.regions)
        self.origin_index = {name: i for i, name in enumerate(topology.origin_names)}
        self.rtt = topology.rtt_ms
        self.allowed = topology.allowed()
        self.nearest = np.argmin(np.where(self.allowed, self.rtt, np.inf), axis=1)
        # GPU types: per region only those it may hold.
        self.type_names = list(topology.gpu_types)
        gt = topology.gpu_types
        self.type_capacity = np.array([gt[k].sessions_per_gpu for k in self.type_names])
        self.limits = np.array([[r.gpus.get(k, 0) for k in self.type_names] for r in topology.regions])
        self.multiplier = np.array([r.price_multiplier for r in topology.regions])
        self.gpu_price_h = self.multiplier[:, None] * np.array([gt[k].usd_per_hour for k in self.type_names])
        per_unit = np.array([gt[k].usd_per_hour / gt[k].sessions_per_gpu for k in self.type_names])
        self.scale_out_order = [
            [k for k in np.argsort(per_unit, kind="stable") if self.limits[r, k] > 0]
            for r in range(self.n_regions)
        ]
        self.max_capacity = self.limits @ self.type_capacity
        self.max_gpus = self.limits.sum(axis=1)
        self.capacity_per_gpu = self.max_capacity / np.maximum(self.max_gpus, 1)
        # $ per load unit and hour if served entirely on the region's cheapest type, for the router.
        self.price_per_unit_h = np.array(
            [
                self.gpu_price_h[r, order[0]] / self.type_capacity[order[0]]
                for r, order in enumerate(self.scale_out_order)
            ]
        )
        egress = topology.transfer_usd_per_gb * config.stream_gb_per_session_h
        self.transfer_per_unit_h = np.where(
            self.rtt > topology.rtt_ms.min(axis=1, keepdims=True) + 1e-9, egress, 0.0
        )

        self.ready = np.zeros((self.n_regions, len(self.type_names)), dtype=int)
        self.pending: list[tuple[float, int, int]] = []  # (ready at, region, type)
        for r in range(self.n_regions):
            self._request(r, config.min_gpus_per_region, now=None)
        self.last_scale_out = np.full(self.n_regions, -math.inf)
        self.floor_capacity = np.zeros(self.n_regions)
        # A policy with a predictive floor may run the reactive part at a higher target: the floor
        # carries the headroom then (TORTA: σ·√F), and the reactive part only catches what it missed.
        self.reactive_utilisation = config.target_utilisation

        self.sessions: dict[str, Session] = {}
        self.region_sessions: list[set[str]] = [set() for _ in range(self.n_regions)]
        self.load_or = np.zeros((self.n_origins, self.n_regions))
        self.count_or = np.zeros((self.n_origins, self.n_regions))
        self.now = 0.0
        self.completed_lengths: list[float] = []
        # Per-slot observations for the policies (mean load per origin over the last slot).
        self._origin_load_acc = np.zeros(self.n_origins)
        self._acc_ticks = 0
        self.origin_load_history: list[np.ndarray] = []
        self._slot_routed = np.zeros((self.n_origins, self.n_regions))
        self._previous_routed: np.ndarray | None = None
        # Metrics.
        self.chunks = 0.0
        self.latency_sum = 0.0
        self.rtt_sum = 0.0
        self.remote_chunks = 0.0
        self.slo_chunks = 0.0
        self.worst_ms = 0.0
        self.cost_usd = 0.0
        self.gpu_seconds = 0.0
        self.peak_gpus = 0
        self.moves = 0
        self.routing_churn: list[tuple[float, float]] = []  # (weight, churn) per slot
        self.scale_actions = 0

    # --------------------------------------------------------------------------------------------
    # Capacity.

    def ready_capacity(self) -> np.ndarray:
        return self.ready @ self.type_capacity

    def pending_capacity(self) -> np.ndarray:
        pending = np.zeros(self.n_regions)
        for _, r, k in self.pending:
            pending[r] += self.type_capacity[k]
        return pending

    def region_load(self) -> np.ndarray:
        return self.load_or.sum(axis=0)

    def _request(self, r: int, gpus: int, now: float | None) -> None:
        """Ask for ``gpus`` more GPUs in region ``r``, cheapest per load unit first (``now=None``: ready at t=0)."""
        held = self.ready[r] + np.bincount(
            [k for _, rr, k in self.pending if rr == r], minlength=len(self.type_names)
        )
        for k in self.scale_out_order[r]:
            while gpus > 0 and held[k] < self.limits[r, k]:
                held[k] += 1
                gpus -= 1
                if now is None:
                    self.ready[r, k] += 1
                else:
                    self.pending.append((now + self.config.provisioning_delay_s, r, k))

    def _autoscale(self, now: float) -> None:
        config = self.config
        load = self.region_load()
        ready_cap = self.ready_capacity()
        pending_cap = self.pending_capacity()
        desired = np.maximum(load / self.reactive_utilisation, self.floor_capacity)
        for r in range(self.n_regions):
            short = desired[r] - ready_cap[r] - pending_cap[r]
            if short > 1e-9:
                before = len(self.pending)
                # Enough GPUs of the cheapest types to cover the shortfall.
                needed = 0
                covered = 0.0
                for k in self.scale_out_order[r]:
                    room = (
                        self.limits[r, k]
                        - self.ready[r, k]
                        - sum(1 for _, rr, kk in self.pending if rr == r and kk == k)
                    )
                    take = min(room, math.ceil((short - covered) / self.type_capacity[k] - 1e-9))
                    if take > 0:
                        needed += take
                        covered += take * self.type_capacity[k]
                    if covered >= short - 1e-9:
                        break
                self._request(r, needed, now)
                if len(self.pending) > before:
                    self.last_scale_out[r] = now
                    self.scale_actions += 1
            elif pending_cap[r] == 0 and now - self.last_scale_out[r] >= config.scale_in_cooldown_s:
                if self.ready[r].sum() <= config.min_gpus_per_region:
                    continue
                # Release the most expensive GPU per load unit if the rest still meets the target.
                for k in reversed(self.scale_out_order[r]):
                    if self.ready[r, k] > 0 and ready_cap[r] - self.type_capacity[k] >= desired[r] - 1e-9:
                        self.ready[r, k] -= 1
                        self.scale_actions += 1
                        break

    # --------------------------------------------------------------------------------------------
    # Sessions.

    def _place(self, sid: str, session: Session) -> None:
        self.region_sessions[session.region].add(sid)
        self.load_or[session.origin, session.region] += session.load
        self.count_or[session.origin, session.region] += 1

    def _unplace(self, sid: str, session: Session) -> None:
        self.region_sessions[session.region].discard(sid)
        self.load_or[session.origin, session.region] -= session.load
        self.count_or[session.origin, session.region] -= 1

    def move(self, sid: str, region: int) -> None:
        """Move a live session to ``region`` (within its RTT budget); its next chunk stalls."""
        session = self.sessions[sid]
        if not self.allowed[session.origin, region]:
            raise RegionSimulationError(f"move of {sid} to region {region} breaks its RTT budget")
        if region == session.region:
            return
        self._unplace(sid, session)
        session.moved = (self.now, session.region, self.stall_ms(session.origin, region))
        session.region = region
        self._place(sid, session)
        if self.now < self.config.warmup_s:
            return
        self.moves += 1
        stall = self.stall_ms(session.origin, region)
        # The stalled chunk replaces one ordinary chunk of this session at its new region.
        cap = max(float(self.ready_capacity()[region]), 1e-9)
        ordinary = self.rtt[session.origin, region] + self.config.chunk_ms * max(
            1.0, self.region_load()[region] / cap
        )
        self.latency_sum += stall
        self.worst_ms = max(self.worst_ms, ordinary + stall)
        if ordinary <= self.config.slo_ms < ordinary + stall:
            self.slo_chunks -= 1

    def last_move(self, sid: str) -> PastMove | None:
        """The session's last move as the move rule's hysteresis takes it (``moves.PastMove``)."""
        moved = self.sessions[sid].moved
        if moved is None:
            return None
        at, source, cost = moved
        return PastMove(age_s=self.now - at, source=source, switch_cost_ms=cost)

    def stall_ms(self, origin: int, region: int) -> float:
        """A move's switching cost (``moves.switch_cost_ms``, shared with the live scheduler)."""
        return switch_cost_ms(
            state_bytes=self.config.state_mb * 1e6,
            wan_gbps=self.config.wan_mbps / 1000.0,
            rtt_ms=self.rtt[origin, region],
        )

    def expected_session_s(self) -> float:
        """Mean length of the sessions that ended so far (300 s until some have)."""
        return float(np.mean(self.completed_lengths[-500:])) if self.completed_lengths else 300.0

    def _handle(self, event: Any) -> None:
        if event.event == "arrive":
            origin = self.origin_index[self.trace.origin_of[event.session]]
            region = int(self.policy.route(self, origin, event.load))
            if not self.allowed[origin, region]:
                raise RegionSimulationError(
                    f"policy {self.policy.name} routed {event.session} beyond its RTT budget"
                )
            self.sessions[event.session] = Session(origin, region, event.load, False, event.t)
            self._slot_routed[origin, region] += 1
            return
        session = self.sessions[event.session]
        if event.event == "active" and not session.active:
            session.active = True
            self._place(event.session, session)
        elif event.event in ("idle", "depart") and session.active:
            session.active = False
            self._unplace(event.session, session)
        if event.event == "depart":
            self.completed_lengths.append(event.t - session.arrived_s)
            del self.sessions[event.session]

    # --------------------------------------------------------------------------------------------
    # Time.

    def _tick(self, now: float, slot_boundary: bool) -> None:
        config = self.config
        still = []
        for ready_at, r, k in self.pending:
            if ready_at <= now + 1e-9:
                self.ready[r, k] += 1
            else:
                still.append((ready_at, r, k))
        self.pending = still
        if slot_boundary:
            if self._acc_ticks:
                self.origin_load_history.append(self._origin_load_acc / self._acc_ticks)
            self._origin_load_acc = np.zeros(self.n_origins)
            self._acc_ticks = 0
            self._record_churn()
            self.policy.on_slot(self, now)
        self._autoscale(now)

        self._origin_load_acc += self.load_or.sum(axis=1)
        self._acc_ticks += 1
        if now < config.warmup_s:
            return
        ready_cap = self.ready_capacity()
        load = self.region_load()
        stretch = np.maximum(1.0, load / np.maximum(ready_cap, 1e-9))
        latency = self.rtt + config.chunk_ms * stretch[None, :]
        chunks = self.count_or * (config.tick_s / config.chunk_period_s)
        self.chunks += chunks.sum()
        self.latency_sum += float((chunks * latency).sum())
        self.rtt_sum += float((chunks * self.rtt).sum())
        self.remote_chunks += float(chunks.sum() - chunks[np.arange(self.n_origins), self.nearest].sum())
        self.slo_chunks += float(chunks[latency <= config.slo_ms].sum())
        if (self.count_or > 0).any():
            self.worst_ms = max(self.worst_ms, float(latency[self.count_or > 0].max()))
        gpus = self.ready.sum() + len(self.pending)
        self.peak_gpus = max(self.peak_gpus, int(gpus))
        self.gpu_seconds += gpus * config.tick_s
        billed = (self.ready * self.gpu_price_h).sum() + sum(
            self.gpu_price_h[r, k] for _, r, k in self.pending
        )
        self.cost_usd += billed * config.tick_s / 3600.0

    def _record_churn(self) -> None:
        """Routing churn between consecutive slots: ½‖R_t[o] − R_{t−1}[o]‖₁ of each origin's routing
        split, weighted by its arrivals (TORTA's switching cost ‖A_t − A_{t−1}‖ on realised routing)."""
        routed = self._slot_routed
        if self._previous_routed is not None:
            prev = self._previous_routed
            both = (routed.sum(axis=1) > 0) & (prev.sum(axis=1) > 0)
            if both.any():
                a = routed[both] / routed[both].sum(axis=1, keepdims=True)
                b = prev[both] / prev[both].sum(axis=1, keepdims=True)
                weight = routed[both].sum(axis=1)
                churn = 0.5 * np.abs(a - b).sum(axis=1)
                self.routing_churn.append((float(weight.sum()), float((weight * churn).sum() / weight.sum())))
        if routed.sum() > 0:
            self._previous_routed = routed
        self._slot_routed = np.zeros_like(routed)

    def run(self) -> dict[str, Any]:
        started = time.perf_counter()
        config = self.config
        self.policy.reset(self)
        ticks_per_slot = max(1, round(config.slot_s / config.tick_s))
        events = self.trace.events
        duration = self.trace.duration_s
        n_ticks = max(1, math.ceil(duration / config.tick_s - 1e-9))
        index = 0
        for tick in range(n_ticks):
            now = tick * config.tick_s
            self.now = now
            self._tick(now, slot_boundary=tick % ticks_per_slot == 0 and tick > 0)
            end = now + config.tick_s
            while index < len(events) and events[index].t < end:
                self.now = events[index].t
                self._handle(events[index])
                index += 1
        self.now = n_ticks * config.tick_s
        return self._result(time.perf_counter() - started)

    def _result(self, wall_s: float) -> dict[str, Any]:
        chunks = max(self.chunks, 1e-9)
        churn_weight = sum(w for w, _ in self.routing_churn)
        extra = self.policy.metrics(self)
        return {
            "policy": self.policy.name,
            "topology": self.topology.name,
            "trace": self.trace.meta.get("name", "trace"),
            "regions": self.n_regions,
            "sessions": sum(1 for e in self.trace.events if e.event == "arrive"),
            "chunks": round(float(self.chunks)),
            "mean_response_ms": self.latency_sum / chunks,
            "worst_chunk_latency_ms": self.worst_ms,
            "slo_ms": self.config.slo_ms,
            "slo_pass_rate": self.slo_chunks / chunks,
            "gpu_cost_usd": self.cost_usd,
            "gpu_hours": self.gpu_seconds / 3600.0,
            "peak_gpus": self.peak_gpus,
            "cross_region_moves": self.moves,
            "mean_rtt_ms": self.rtt_sum / chunks,
            "remote_share": self.remote_chunks / chunks,
            "routing_churn": (sum(w * c for w, c in self.routing_churn) / churn_weight)
            if churn_weight
            else 0.0,
            "scale_actions": self.scale_actions,
            "macro_solve_ms_p99": extra.pop("macro_solve_ms_p99", None),
            **extra,
            "config": asdict(self.config),
            "wall_s": wall_s,
        }


def simulate_regions(
    topology: Topology, trace: RegionTrace, policy: Any, config: RegionSimConfig | None = None
) -> dict[str, Any]:
    return RegionSimulator(topology, trace, policy, config or RegionSimConfig()).run()
