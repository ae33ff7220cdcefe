"""Value types of the scheduling core: GPU type specs, the cluster snapshot, events and decisions.

Everything here is immutable (frozen dataclasses, tuples, read-only mappings) so a policy can never
mutate the state it is shown, and two identical inputs give identical decisions.
"""

from __future__ import annotations

import bisect
import itertools
import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, replace
from enum import StrEnum
from types import MappingProxyType
from typing import Any

from .index import ClusterIndex
from .provisioning import ScaleOutModel
from .spares import SpareTarget

SESSION_STATES = ("executing", "suspended", "queued")
GPU_STATUSES = ("provisioning", "ready", "draining", "released", "failed")


class EventKind(StrEnum):
    """The one event vocabulary of the platform.

    The core's ``Event.kind``, ``SessionEvent.Kind`` (what happened to a session) and
    ``SchedulerDecision.Trigger`` (what started a decision) all use these members.
    """

    # What a user does (TurboServe §5.1: arrival, the activity indicator α, departure) …
    ARRIVE = "arrive"
    ACTIVE = "active"
    IDLE = "idle"
    DEPART = "depart"
    PROMPT = "prompt"
    # … and what the cluster does.
    TICK = "tick"
    GPU_READY = "gpu_ready"
    GPU_FAILED = "gpu_failed"
    WORKER = "worker"
    MANUAL = "manual"


# What a user does to a session: recorded as session events, each a scheduler trigger.
SESSION_EVENT_KINDS = (EventKind.ARRIVE, EventKind.ACTIVE, EventKind.IDLE, EventKind.DEPART, EventKind.PROMPT)
# What a workload trace records (a prompt switch does not change the load).
TRACE_EVENT_KINDS = (EventKind.ARRIVE, EventKind.ACTIVE, EventKind.IDLE, EventKind.DEPART)
# What a policy tells apart; any other trigger is decided as a tick.
POLICY_EVENT_KINDS = frozenset(
    (*TRACE_EVENT_KINDS, EventKind.TICK, EventKind.GPU_READY, EventKind.GPU_FAILED)
)

GB = 1_000_000_000


@dataclass(frozen=True)
class GpuTypeSpec:
    """One GPU type running one model: its latency curve, capacity, memory, price and delays.

    ``latency_points`` are measured ``(load, ms)`` pairs; ``latency_ms`` interpolates linearly between
    them and extrapolates with the slope of the last segment (past K a GPU still runs, only slower).
    ``capacity`` is K: the load at which one GPU still meets its chunk-latency target. The hard
    memory limit is what really bounds co-location: ``memory_limit_sessions`` resident sessions
    and/or ``memory_limit_bytes`` of resident session state.
    """

    name: str
    gpu_type: str
    capacity: float
    latency_points: tuple[tuple[float, float], ...]
    price_per_hour: float
    provisioning_delay_s: float
    memory_limit_sessions: int | None = None
    memory_limit_bytes: int | None = None
    state_bytes: int = int(3.5 * GB)
    link_gbps: float = 200.0
    host_link_gbps: float = 50.0
    migration_alpha_ms: float = 5.0
    availability: int | None = None
    slo_ms: float | None = None
    source: str = ""
    # How a GPU of this type joins (boot + weights by source, scheduling/core/provisioning.py);
    # ``None``: only the constant ``provisioning_delay_s`` is known.
    scale_out: ScaleOutModel | None = None

    def __post_init__(self) -> None:
        if self.capacity <= 0:
            raise ValueError(f"{self.name}: capacity must be > 0")
        if len(self.latency_points) < 2:
            raise ValueError(f"{self.name}: latency curve needs at least two (load, ms) points")
        points = tuple(sorted((float(x), float(y)) for x, y in self.latency_points))
        loads = [p[0] for p in points]
        if len(set(loads)) != len(loads):
            raise ValueError(f"{self.name}: duplicate loads in latency curve")
        if any(y <= 0 for _, y in points) or any(b[1] < a[1] for a, b in itertools.pairwise(points)):
            raise ValueError(f"{self.name}: latency curve must be positive and non-decreasing")
        if self.memory_limit_sessions is None and self.memory_limit_bytes is None:
            raise ValueError(f"{self.name}: give memory_limit_sessions or memory_limit_bytes")
        if self.price_per_hour < 0 or self.provisioning_delay_s < 0:
            raise ValueError(f"{self.name}: price and provisioning delay must be >= 0")
        object.__setattr__(self, "latency_points", points)
        object.__setattr__(self, "_loads", tuple(loads))

    def latency_ms(self, load: float) -> float:
        """Per-chunk latency of one coalesced step at this total load (piecewise linear)."""
        pts = self.latency_points
        loads: tuple[float, ...] = self._loads  # type: ignore[attr-defined]
        i = bisect.bisect_right(loads, load)
        if i <= 0:
            return pts[0][1]
        if i >= len(pts):
            (x0, y0), (x1, y1) = pts[-2], pts[-1]
        else:
            (x0, y0), (x1, y1) = pts[i - 1], pts[i]
        return y0 + (y1 - y0) * (load - x0) / (x1 - x0)

    @property
    def target_latency_ms(self) -> float:
        return self.latency_ms(self.capacity)

    @property
    def stall_allowance_ms(self) -> float:
        """The one-off stall a chunk may carry on top of ℓ: a resume copy or a migration's κ."""
        return max(self.resume_ms(self.state_bytes), self.kappa_ms(self.state_bytes))

    @property
    def default_slo_ms(self) -> float:
        """``slo_ms`` if set, else ℓ(K) plus one stall: K is then exactly the load that meets it."""
        if self.slo_ms is not None:
            return self.slo_ms
        return round(self.target_latency_ms + self.stall_allowance_ms, 1)

    def capacity_for_slo(self, slo_ms: float) -> float:
        """K under a given SLO: the largest load whose chunk, one stall included, still meets it.

        Inverts the (non-decreasing, piecewise-linear) latency curve. Raises ``ValueError`` when even
        an empty GPU cannot meet the SLO. A curve that stays flat past its last point gives the
        memory limit (or the last measured load when memory is unbounded in sessions).
        """
        budget = slo_ms - self.stall_allowance_ms
        pts = self.latency_points
        if pts[0][1] > budget:
            raise ValueError(
                f"{self.name}: an SLO of {slo_ms:g} ms is below one chunk on an empty GPU plus one stall "
                f"({pts[0][1] + self.stall_allowance_ms:.1f} ms)"
            )
        for (x0, y0), (x1, y1) in itertools.pairwise(pts):
            if y1 > budget:
                return x0 + (budget - y0) * (x1 - x0) / (y1 - y0)
        (x0, y0), (x1, y1) = pts[-2], pts[-1]
        if y1 == y0:
            limit = self.session_limit()
            return float(limit) if math.isfinite(limit) else x1
        return x1 + (budget - y1) * (x1 - x0) / (y1 - y0)

    def with_slo(self, slo_ms: float) -> GpuTypeSpec:
        """This spec with K derived from ``slo_ms`` (and the SLO recorded)."""
        return replace(self, capacity=self.capacity_for_slo(slo_ms), slo_ms=slo_ms)

    def kappa_ms(self, state_bytes: int) -> float:
        """α–β migration cost (Hockney): κ = α + bytes / β, β the GPU↔GPU link bandwidth."""
        return self.migration_alpha_ms + state_bytes / (self.link_gbps * GB) * 1000.0

    def resume_ms(self, state_bytes: int) -> float:
        """Copying a suspended session's state back from pinned host memory."""
        return state_bytes / (self.host_link_gbps * GB) * 1000.0

    def session_limit(self) -> float:
        return math.inf if self.memory_limit_sessions is None else self.memory_limit_sessions

    def bytes_limit(self) -> float:
        return math.inf if self.memory_limit_bytes is None else self.memory_limit_bytes

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "name": self.name,
            "gpu_type": self.gpu_type,
            "capacity": self.capacity,
            "price_per_hour": self.price_per_hour,
            "provisioning_delay_s": self.provisioning_delay_s,
            "latency_ms": [[x, y] for x, y in self.latency_points],
            "state_bytes": self.state_bytes,
            "link_gbps": self.link_gbps,
            "host_link_gbps": self.host_link_gbps,
            "migration_alpha_ms": self.migration_alpha_ms,
        }
        if self.memory_limit_sessions is not None:
            out["memory_limit_sessions"] = self.memory_limit_sessions
        if self.memory_limit_bytes is not None:
            out["memory_limit_bytes"] = self.memory_limit_bytes
        if self.availability is not None:
            out["availability"] = self.availability
        if self.slo_ms is not None:
            out["slo_ms"] = self.slo_ms
        if self.source:
            out["source"] = self.source
        if self.scale_out is not None:
            out["scale_out"] = self.scale_out.to_json()
        return out


@dataclass(frozen=True)
class SessionView:
    """One live session as the scheduler sees it. ``alpha`` is 1 while the user is interacting."""

    id: str
    alpha: int
    state: str  # executing | suspended | queued
    load: float = 1.0
    gpu: str | None = None
    state_bytes: int = int(3.5 * GB)
    since: float = 0.0  # when it entered its current state (queue order)


@dataclass(frozen=True)
class GpuView:
    id: str
    gpu_type: str  # key into Snapshot.gpu_types
    status: str  # provisioning | ready | draining | released | failed
    ready_at: float | None = None
    requested_at: float = 0.0


@dataclass(frozen=True)
class Event:
    time: float
    kind: EventKind
    session: str | None = None
    gpu: str | None = None
    # For idle/depart: whether this ended an active period (the detector counts net activations).
    was_active: bool = False

    def __post_init__(self) -> None:
        # A plain string from a trace becomes a member; an unknown kind is a ValueError here, not a
        # silently ignored event inside a policy.
        object.__setattr__(self, "kind", EventKind(self.kind))


@dataclass(frozen=True)
class Snapshot:
    """The cluster at one instant, with the per-GPU indexes the policies need.

    Build one with :meth:`Snapshot.build` (O(sessions)); the simulator maintains the same indexes
    incrementally. ``residents[g]`` lists the sessions executing on GPU ``g`` (sorted ids);
    ``pending`` lists active sessions without a GPU (queued or suspended), oldest first;
    ``idle_resident`` lists idle sessions still holding a GPU slot. A policy must not keep a
    reference to a snapshot after ``decide`` returns.

    The inputs other features give the decision are fields too, set by the decision pipeline
    (``scheduling.core.pipeline``), never attributes of the policy: the one-shot jobs' demand
    (``job_demand_gpus``, ``job_gpus``) and the predictive floor's forecast load (``floor_load``).
    """

    time: float
    sessions: Mapping[str, SessionView]
    gpus: Mapping[str, GpuView]
    gpu_types: Mapping[str, GpuTypeSpec]
    residents: Mapping[str, tuple[str, ...]]
    gpu_load: Mapping[str, float]
    gpu_bytes: Mapping[str, int]
    pending: tuple[str, ...]
    idle_resident: tuple[str, ...]
    min_gpus: int = 0
    max_gpus: int = 1_000_000
    # GPUs the one-shot jobs' backlog needs to meet its deadlines (jobs.cosim.JobSide.demand_gpus);
    # an autoscaler adds it to the streams' load (issue 14). 0 without jobs.
    job_demand_gpus: float = 0.0
    # GPUs running a job allocation now (sorted ids): placing a session there waits for the job's step.
    job_gpus: tuple[str, ...] = ()
    # The predictive floor's input (TORTA Eq. 6): the forecast active load F one provisioning delay
    # ahead that an autoscaler keeps capacity for (issue 16). None: no floor.
    floor_load: float | None = None
    # Sessions of tenants over a GPU-second quota (issue 29, ``scheduling.core.tenants``): they are
    # placed on spare capacity, after everyone else's (``pending`` is in fair-share order), and an
    # autoscaler never counts them as demand: scale-out is never triggered by a tenant over quota.
    spare_only: frozenset[str] = frozenset()
    # The delay (s) the platform predicts for its next scale-out, by GPU type: the scale plan's delay
    # of the last one (simulator) or the measured boot of the pool's newest worker (live). A type
    # without one falls back to its stated ``provisioning_delay_s``. Boot-aware spares read it.
    scale_out_delay_s: Mapping[str, float] | None = None
    # The per-GPU index its owner keeps up to date (``scheduling.core.index``): a decision then reads
    # only the GPUs it touches. None: PlacementWork builds one from the GPUs (same decisions).
    index: ClusterIndex | None = field(default=None, compare=False, repr=False)

    @classmethod
    def build(
        cls,
        *,
        time: float,
        sessions: Iterable[SessionView],
        gpus: Iterable[GpuView],
        gpu_types: Mapping[str, GpuTypeSpec],
        min_gpus: int = 0,
        max_gpus: int = 1_000_000,
    ) -> Snapshot:
        session_map = {s.id: s for s in sorted(sessions, key=lambda s: s.id)}
        gpu_map = {g.id: g for g in sorted(gpus, key=lambda g: g.id)}
        for g in gpu_map.values():
            if g.gpu_type not in gpu_types:
                raise ValueError(f"GPU {g.id}: unknown gpu_type {g.gpu_type!r}")
            if g.status not in GPU_STATUSES:
                raise ValueError(f"GPU {g.id}: unknown status {g.status!r}")
        residents: dict[str, list[str]] = {g: [] for g in gpu_map}
        load = dict.fromkeys(gpu_map, 0.0)
        used = dict.fromkeys(gpu_map, 0)
        pending: list[SessionView] = []
        idle_resident: list[str] = []
        for s in session_map.values():
            if s.state not in SESSION_STATES:
                raise ValueError(f"session {s.id}: unknown state {s.state!r}")
            if s.state == "executing":
                if s.gpu not in gpu_map:
                    raise ValueError(f"session {s.id}: executing on unknown GPU {s.gpu!r}")
                residents[s.gpu].append(s.id)
                load[s.gpu] += s.load
                used[s.gpu] += s.state_bytes
                if not s.alpha:
                    idle_resident.append(s.id)
            elif s.alpha:
                pending.append(s)
        pending.sort(key=lambda s: (s.since, s.id))
        return cls(
            time=time,
            sessions=MappingProxyType(session_map),
            gpus=MappingProxyType(gpu_map),
            gpu_types=MappingProxyType(dict(gpu_types)),
            residents=MappingProxyType({g: tuple(v) for g, v in residents.items()}),
            gpu_load=MappingProxyType(load),
            gpu_bytes=MappingProxyType(used),
            pending=tuple(s.id for s in pending),
            idle_resident=tuple(idle_resident),
            min_gpus=min_gpus,
            max_gpus=max_gpus,
        )

    def spec(self, gpu_id: str) -> GpuTypeSpec:
        return self.gpu_types[self.gpus[gpu_id].gpu_type]


@dataclass(frozen=True)
class Migration:
    session: str
    src: str
    dst: str
    kappa_ms: float


@dataclass(frozen=True)
class Signals:
    """The numbers behind a decision (TurboServe §5.2.2, Appendix A)."""

    rho_max: float = 0.0
    volatility: float = 0.0
    volatility_level: int = 0
    lam: float = 0.0
    rho_hat: float = 0.0
    n_req: float = 0.0
    headroom: float = 0.0
    bottleneck_ms: float = 0.0
    # GPUs the predictive floor asked for (None: no floor this decision). Left out of ``to_json`` so
    # recorded outputs keep their shape; the record's inputs carry the floor's F.
    floor_gpus: int | None = None
    # The spare rule's answer with its inputs (scheduling.core.spares.SpareTarget; None: headroom
    # off). Left out of ``to_json`` like ``floor_gpus``: the live record keeps it with its inputs.
    spares: SpareTarget | None = None


@dataclass(frozen=True)
class Decision:
    """What to do now. Applied in this order by the runtime and the simulator:

    1. ``add_gpus`` (request ``count`` new GPUs of a type) and ``undrain``;
    2. ``suspend`` (offload to host memory);
    3. ``migrations`` (chunk-boundary moves between ready GPUs);
    4. ``assign`` (start or resume a session on a GPU);
    5. ``queue`` (active sessions left waiting: no GPU memory);
    6. ``drain`` (no new sessions), then ``release`` (only GPUs with no resident session).
    """

    time: float
    assign: tuple[tuple[str, str], ...] = ()
    migrations: tuple[Migration, ...] = ()
    suspend: tuple[str, ...] = ()
    queue: tuple[str, ...] = ()
    target_budget: int = 0
    add_gpus: tuple[tuple[str, int], ...] = ()
    drain: tuple[str, ...] = ()
    undrain: tuple[str, ...] = ()
    release: tuple[str, ...] = ()
    signals: Signals = field(default_factory=Signals)
    scheduler_ms: float = 0.0

    def to_json(self) -> dict[str, Any]:
        return {
            "time": self.time,
            "assign": [list(a) for a in self.assign],
            "migrations": [
                {"session": m.session, "src": m.src, "dst": m.dst, "kappa_ms": m.kappa_ms}
                for m in self.migrations
            ],
            "suspend": list(self.suspend),
            "queue": list(self.queue),
            "target_budget": self.target_budget,
            "add_gpus": [list(a) for a in self.add_gpus],
            "drain": list(self.drain),
            "undrain": list(self.undrain),
            "release": list(self.release),
            "signals": {
                "rho_max": self.signals.rho_max,
                "volatility": self.signals.volatility,
                "volatility_level": self.signals.volatility_level,
                "lambda": self.signals.lam,
                "rho_hat": self.signals.rho_hat,
                "n_req": self.signals.n_req,
                "headroom": self.signals.headroom,
                "bottleneck_ms": self.signals.bottleneck_ms,
            },
            "scheduler_ms": self.scheduler_ms,
        }
