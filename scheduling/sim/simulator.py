"""Discrete-event simulator: replays a session trace in virtual time through a policy.

Model (docs/scheduling.md has the full description):
* every trace event, every ``tick_s`` and every GPU becoming ready runs the decision pipeline the live
  loop runs (``scheduling.core.pipeline.decision_run``: the pool is one region, so its policy's
  ``decide`` on a snapshot kept incrementally, O(changed) per event, with the jobs' demand as an
  input), and the decision is validated and applied;
* each ready GPU runs coalesced steps back to back while it has resident sessions; a step's
  duration is the GPU type's ``latency_ms(load)`` at the load co-located when the step starts, and
  each session resident at that moment gets one chunk at its end; a session that joins mid-step
  starts at the next step. With ``stream_period_ms`` set, steps are paced as a live worker paces
  its streams: a GPU's next step starts one chunk period after its previous one started (or when
  it ends, if later; a session joining an idle GPU starts one at once), and one-shot jobs may step
  in the gap when ``contracts.coserve`` says the step fits the slack (``stream_demands``);
* a chunk's latency is the step duration plus the session's pending stall: κ after a migration,
  the host→GPU copy after a resume, and the queue wait before its first chunk;
* GPUs serve only after their provisioning delay; cost = price × (release or end − request).
  The delay is the profile's constant ``provisioning_delay_s`` (scale-out path ``fixed``) or, with
  ``scale_out`` set to ``disk``/``host-cache``/``peer``, boot plus the weight load the scale planner
  gives each new GPU from the pool's state at that moment (scheduling/core/provisioning.py);
* the simulator, not the policy, is the judge of the contract (docs/scheduling.md, "The contract
  an external policy is held to"): a session may be queued only while no ready GPU has memory for
  it, and a migration's stall is κ computed from the session's state bytes and the link, whatever
  κ the policy reported;
* one-shot jobs (issue 14), when the trace has any, run on the GPUs the streams leave through
  ``jobs.cosim.JobSide``: the simulator hands it job events, its timers and every decision, adds
  the wait for the job step in flight (abandoned at its next block boundary, ``JobSide.claim``) to
  the stall of a session placed on a job's GPU, and gives the pipeline the open jobs
  (``JobSide.demand``), whose job step shows the policy their GPU demand (``Snapshot.job_demand_gpus``).
"""

from __future__ import annotations

import heapq
import math
import time as wallclock
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from types import MappingProxyType
from typing import Any

import numpy as np

from contracts.coserve import StreamDemand
from scheduling.core.index import ClusterIndex
from scheduling.core.pipeline import ONE_REGION, DecisionInputs, decision_run
from scheduling.core.policy import Policy
from scheduling.core.provisioning import FIXED, SCALE_OUT_PATHS
from scheduling.core.scaleplan import ScalePlanError
from scheduling.core.tenants import DEFAULT_TENANT, TenantShares
from scheduling.core.types import Decision, Event, GpuTypeSpec, GpuView, SessionView, Snapshot

from .jobs.cosim import JobConfig, JobSide
from .traces import JobEvent, TraceEvent, merge_by_time


class SimulationError(RuntimeError):
    """A policy produced a decision that violates the scheduling contract."""


@dataclass
class SimConfig:
    profiles: Sequence[GpuTypeSpec]
    initial_gpus: int = 4
    min_gpus: int = 1
    max_gpus: int = 64
    slo_ms: float | None = None
    tick_s: float = 5.0
    window_s: float = 10.0
    duration_s: float | None = None
    validate: bool = True
    # Latency, cost and GPU-seconds count only from here (profiling segments have a warm-up).
    measure_from_s: float = 0.0
    # How new GPUs get their weights: None = each profile's own path (its scale_out.path, or the
    # constant provisioning_delay_s when it has no scale-out model); else one of SCALE_OUT_PATHS.
    scale_out: str | None = None
    # A chunk period (ms): a GPU starts a coalesced step at most once per period, as a live worker
    # paces its streams, so the time a step leaves is there for one-shot jobs beside the streams
    # (contracts.coserve). None: steps back to back (every chunk as early as the GPU can make it;
    # the stream-only model, whose chunk latencies are the same either way).
    stream_period_ms: float | None = None
    # With paced streams: how much later than its paced start plus its generation a step may end
    # because a job step ran first — the part of a live worker's look-ahead its jobs may take (its
    # chunks are made up to 1.25 periods ahead and due to be done half a period before they play).
    # 0: none, every chunk exactly when it would be without jobs.
    stream_lead_ms: float = 0.0
    # Tenants (issue 29): each tenant's fair-share weight (missing: 1) and the window of GPU-seconds
    # the fair share weighs, as the live loop's TENANT_FAIR_SHARE_WINDOW_S. Fair share runs when the
    # trace names tenants (``tenant`` on ``arrive``) or weights are given.
    tenant_weights: Mapping[str, float] | None = None
    tenant_window_s: float = 3600.0


@dataclass
class SimResult:
    policy: str
    trace: str
    chunks: int
    worst_chunk_latency_ms: float
    p99_chunk_latency_ms: float
    mean_chunk_latency_ms: float
    slo_ms: float
    slo_pass_rate: float
    gpu_cost_usd: float
    gpu_seconds: float
    peak_gpus: int
    migrations: int
    scale_actions: int
    max_wait_ms: float
    scheduler_ms_mean: float
    scheduler_ms_p99: float
    scheduler_ms_max: float
    decisions: int
    initial_gpus: int
    profile: str
    duration_s: float
    queued_sessions: int
    timeline: list[dict[str, float]] = field(default_factory=list)
    policy_config: dict[str, Any] = field(default_factory=dict)
    # Every GPU requested: its path and the delay it got (summary; per scale-out in the events).
    scale_out: dict[str, Any] = field(default_factory=dict)
    scale_out_events: list[dict[str, Any]] = field(default_factory=list)
    # One-shot jobs' figures (jobs.cosim.JobSide.result); None (and absent from JSON) without jobs.
    jobs: dict[str, Any] | None = None
    # Per tenant: GPU-seconds charged (each chunk its batch share of the step), its share of all
    # charged and its weight's share; None (and absent from JSON) without tenants.
    tenants: dict[str, Any] | None = None

    def to_json(self, timeline: bool = True) -> dict[str, Any]:
        detail = ("timeline", "scale_out_events")
        optional = ("jobs", "tenants")
        out = {k: v for k, v in self.__dict__.items() if (k not in detail or timeline) and k not in optional}
        for name in optional:
            if getattr(self, name) is not None:
                out[name] = getattr(self, name)
        return out


class _Session:
    __slots__ = (
        "alpha",
        "bytes",
        "gpu",
        "id",
        "load",
        "queued_at",
        "resident_before",
        "since",
        "stall_ms",
        "state",
    )

    def __init__(self, sid: str, load: float, state_bytes: int, now: float):
        self.id = sid
        self.alpha = 0
        self.state = "suspended"  # arrives idle, with no GPU state yet
        self.gpu: str | None = None
        self.load = load
        self.bytes = state_bytes
        self.since = now
        self.stall_ms = 0.0
        self.queued_at: float | None = None
        self.resident_before = False

    def view(self) -> SessionView:
        return SessionView(self.id, self.alpha, self.state, self.load, self.gpu, self.bytes, self.since)


class _Gpu:
    __slots__ = (
        "busy",
        "bytes",
        "id",
        "load",
        "members",
        "next_start",
        "overdue",
        "pace_epoch",
        "ready_at",
        "released_at",
        "requested_at",
        "slot",
        "spec",
        "status",
        "step_extra",
        "step_members",
        "step_nominal",
        "step_started",
        "step_tenants",
        "type_key",
    )

    def __init__(self, gid: str, spec: GpuTypeSpec, now: float, ready: bool):
        self.id = gid
        self.spec = spec
        self.type_key = spec.name
        self.status = "ready" if ready else "provisioning"
        self.requested_at = now
        self.ready_at = now if ready else now + spec.provisioning_delay_s
        self.released_at: float | None = None
        self.slot = -1
        self.members: dict[str, None] = {}
        self.load = 0.0
        self.bytes = 0
        self.busy = False
        self.step_members = 0
        self.step_extra: list[float] = []
        self.step_tenants: list[str] = []
        # Paced streams (SimConfig.stream_period_ms): when the running or next step starts; the
        # epoch invalidates a scheduled start that an earlier one (a session joining) replaced.
        self.step_started = 0.0
        self.next_start = 0.0
        self.pace_epoch = 0
        # With a stream lead: the paced start of the running step, and whether the next one is
        # past its paced start, waiting for a job step beside it to end.
        self.step_nominal = 0.0
        self.overdue = False

    def view(self) -> GpuView:
        return GpuView(self.id, self.type_key, self.status, self.ready_at, self.requested_at)


def _scale_out_paths(config: SimConfig) -> dict[str, str]:
    """Each profile's scale-out path: ``config.scale_out`` for all, else the profile's own."""
    paths: dict[str, str] = {}
    for p in config.profiles:
        if config.scale_out is None:
            paths[p.name] = p.scale_out.path if p.scale_out is not None else FIXED
            continue
        if config.scale_out not in SCALE_OUT_PATHS:
            raise ScalePlanError(
                f"scale_out must be one of {', '.join(SCALE_OUT_PATHS)}, got {config.scale_out!r}"
            )
        if p.scale_out is None:
            raise ScalePlanError(
                f"profile {p.name!r} has no scale_out model (boot, weights, links): "
                f"scale-out path {config.scale_out!r} cannot be computed for it"
            )
        paths[p.name] = config.scale_out
    return paths


# internal event priorities at equal time: chunk completions, then GPUs becoming ready, then the
# trace, then ticks — so a decision sees every chunk that finished at that instant.
_STEP, _READY, _TRACE, _TICK, _JOB = 0, 1, 2, 3, 4


class Simulator:
    def __init__(
        self, policy: Policy, config: SimConfig, trace_name: str = "trace", jobs: JobConfig | None = None
    ):
        if not config.profiles:
            raise ValueError("at least one GPU profile is needed")
        self.policy = policy
        self.cfg = config
        self.trace_name = trace_name
        self.paths = _scale_out_paths(config)
        # A policy plans with the delay it can expect on this path (one GPU joining); each GPU's
        # actual delay comes from the scale plan of its own scale-out.
        self.types = {
            p.name: p
            if self.paths[p.name] == FIXED
            else replace(p, provisioning_delay_s=round(p.scale_out.nominal_delay_s(self.paths[p.name]), 6))  # type: ignore[union-attr]
            for p in config.profiles
        }
        self.primary = self.types[config.profiles[0].name]
        self.slo_ms = config.slo_ms if config.slo_ms is not None else self.primary.default_slo_ms
        self.now = 0.0
        self.sessions: dict[str, _Session] = {}
        self.session_views: dict[str, SessionView] = {}
        self.gpus: dict[str, _Gpu] = {}
        self.gpu_views: dict[str, GpuView] = {}
        self.residents: dict[str, tuple[str, ...]] = {}
        self.gpu_load: dict[str, float] = {}
        self.gpu_bytes: dict[str, int] = {}
        self.pending: dict[str, None] = {}
        self.idle_resident: dict[str, None] = {}
        # Kept with the per-GPU maps above so a decision reads only the GPUs it touches.
        self.index = ClusterIndex()
        self.all_gpus: list[_Gpu] = []
        self.heap: list[tuple[float, int, int, Any]] = []
        self.seq = 0
        self.gpu_counter = 0
        # Host slots per GPU type (provisioning.ScaleOutModel.endpoint): the lowest free one is taken.
        self.free_slots: dict[str, list[int]] = {name: [] for name in self.types}
        self.next_slot: dict[str, int] = dict.fromkeys(self.types, 0)
        # Flows of scale plans still streaming, (until, sender, receiver): busy for later plans.
        self.inflight_flows: list[tuple[float, str, str]] = []
        self.scale_out_events: list[dict[str, Any]] = []
        # The delay the platform predicts for its next scale-out of each type: its last one's, from
        # the scale plan (its slowest GPU: the capacity asked for is all there only then).
        self.predicted_delay: dict[str, float] = {}
        self.predicted_delay_view = MappingProxyType(self.predicted_delay)
        # metrics
        self.step_dur: list[float] = []
        self.step_n: list[int] = []
        self.step_t: list[float] = []
        self.extra_lat: list[float] = []
        self.extra_t: list[float] = []
        self.sched_ms: list[float] = []
        self.sched_cpu_ms: list[float] = []
        self.migrations = 0
        self.scale_actions = 0
        self.max_wait_ms = 0.0
        self.queued_sessions = 0
        self.peak_gpus = 0
        self.active_samples: list[tuple[float, int]] = []
        self.budget_samples: list[tuple[float, int]] = []
        self.n_active = 0
        self.jobs = JobSide(self, jobs, lambda t, payload: self._push(t, _JOB, payload)) if jobs else None
        # Tenants (issue 29): who each session is charged to, GPU-seconds charged (measured part),
        # and the fair share's window of charges, oldest first.
        self.tenants_on = config.tenant_weights is not None
        self.session_tenant: dict[str, str] = {}
        self.tenant_seconds: dict[str, float] = {}
        self.tenant_recent: deque[tuple[float, str, float]] = deque()
        self.tenant_window: dict[str, float] = {}

    # -- bookkeeping -----------------------------------------------------------------------------
    def _push(self, t: float, prio: int, payload: Any) -> None:
        self.seq += 1
        heapq.heappush(self.heap, (t, prio, self.seq, payload))

    def _touch_session(self, s: _Session) -> None:
        self.session_views[s.id] = s.view()
        if s.alpha and s.state != "executing":
            self.pending.setdefault(s.id, None)
        else:
            self.pending.pop(s.id, None)
        if not s.alpha and s.state == "executing":
            self.idle_resident.setdefault(s.id, None)
        else:
            self.idle_resident.pop(s.id, None)

    def _touch_gpu(self, g: _Gpu) -> None:
        self.gpu_views[g.id] = g.view()
        self.residents[g.id] = tuple(sorted(g.members))
        self.gpu_load[g.id] = g.load
        self.gpu_bytes[g.id] = g.bytes
        self.index.set_gpu(g.id, g.type_key, g.status, g.load)

    def _drop_gpu(self, g: _Gpu) -> None:
        for index in (self.gpu_views, self.residents, self.gpu_load, self.gpu_bytes):
            index.pop(g.id, None)
        self.index.drop_gpu(g.id)
        self.gpus.pop(g.id, None)
        if g.slot >= 0:
            heapq.heappush(self.free_slots[g.type_key], g.slot)

    def _new_gpu(self, spec: GpuTypeSpec, ready: bool, schedule: bool = True) -> _Gpu:
        """A GPU in the lowest free slot; a provisioning one becomes ready after the profile's
        constant delay, unless ``schedule`` is False (its scale-out plan sets ``ready_at``)."""
        self.gpu_counter += 1
        g = _Gpu(f"g{self.gpu_counter:04d}", spec, self.now, ready)
        free = self.free_slots.setdefault(spec.name, [])
        if free:
            g.slot = heapq.heappop(free)
        else:
            g.slot = self.next_slot.get(spec.name, 0)
            self.next_slot[spec.name] = g.slot + 1
        self.gpus[g.id] = g
        self.all_gpus.append(g)
        self._touch_gpu(g)
        if not ready and schedule:
            self._push(g.ready_at, _READY, ("ready", g.id))
        return g

    def _scale_out(self, spec: GpuTypeSpec, new: list[_Gpu]) -> None:
        """Set when each GPU of one scale-out is ready: the constant delay, or boot plus the load
        time the scale plan gives it from the pool as it is now."""
        path = self.paths[spec.name]
        sources: dict[str, int] = {}
        if path == FIXED:
            delays = [spec.provisioning_delay_s] * len(new)
            sources["fixed"] = len(new)
        else:
            model = spec.scale_out
            assert model is not None
            serving = [
                model.endpoint(spec.name, g.slot)
                for g in self.gpus.values()
                if g.type_key == spec.name and g.status in ("ready", "draining")
            ]
            targets = [model.endpoint(spec.name, g.slot) for g in new]
            self.inflight_flows = [f for f in self.inflight_flows if f[0] > self.now]
            busy = frozenset((a, b) for _, a, b in self.inflight_flows)
            plan = model.plan(path, spec.name, serving=serving, targets=targets, busy=busy)
            ready = plan.expected_ready_s
            delays = [model.boot_s + ready[t.id] for t in targets]
            for chain in plan.chains:
                sources[chain.source_kind] = sources.get(chain.source_kind, 0) + len(chain.targets)
                for (a, b), t in zip(chain.hops, chain.ready_s, strict=True):
                    self.inflight_flows.append((self.now + model.boot_s + t, a, b))
        if delays:
            self.predicted_delay[spec.name] = max(delays)
        for g, delay in zip(new, delays, strict=True):
            g.ready_at = self.now + delay
            self._touch_gpu(g)
            self._push(g.ready_at, _READY, ("ready", g.id))
        self.scale_out_events.append(
            {
                "t": round(self.now, 6),
                "profile": spec.name,
                "path": path,
                "gpus": len(new),
                "delay_s": [round(d, 6) for d in delays],
                "sources": sources,
            }
        )

    def _provisioned(self) -> int:
        return len(self.gpus)  # released GPUs are dropped from the index

    def snapshot(self) -> Snapshot:
        return Snapshot(
            time=self.now,
            sessions=MappingProxyType(self.session_views),
            gpus=MappingProxyType(self.gpu_views),
            gpu_types=MappingProxyType(self.types),
            residents=MappingProxyType(self.residents),
            gpu_load=MappingProxyType(self.gpu_load),
            gpu_bytes=MappingProxyType(self.gpu_bytes),
            pending=tuple(self.pending),
            idle_resident=tuple(self.idle_resident),
            min_gpus=self.cfg.min_gpus,
            max_gpus=self.cfg.max_gpus,
            scale_out_delay_s=self.predicted_delay_view,
            index=self.index,
        )

    # -- placement mechanics ---------------------------------------------------------------------
    def _attach(self, s: _Session, g: _Gpu) -> None:
        if self.jobs is not None:
            # Streams first: a job step in flight is abandoned at its next block boundary, and the
            # chunk waits for that boundary (jobs.cosim.JobSide.claim).
            s.stall_ms += self.jobs.claim(g.id)
        g.members[s.id] = None
        g.load += s.load
        g.bytes += s.bytes
        s.gpu = g.id
        s.state = "executing"
        s.since = self.now
        self._touch_gpu(g)
        self._touch_session(s)
        if not g.busy:
            self._start_step(g)

    def _detach(self, s: _Session) -> _Gpu | None:
        if s.gpu is None:
            return None
        g = self.gpus[s.gpu]
        del g.members[s.id]
        g.load -= s.load
        if abs(g.load) < 1e-9:
            g.load = 0.0
        g.bytes -= s.bytes
        s.gpu = None
        self._touch_gpu(g)
        return g

    def _start_step(self, g: _Gpu, nominal: float | None = None) -> None:
        if not g.members or g.status not in ("ready", "draining"):
            g.busy = False
            return
        dur = g.spec.latency_ms(g.load)
        extra: list[float] = []
        for sid in g.members:
            s = self.sessions[sid]
            if s.stall_ms > 0:
                extra.append(dur + s.stall_ms)
                s.stall_ms = 0.0
        g.busy = True
        g.step_members = len(g.members)
        g.step_extra = extra
        if self.tenants_on:
            g.step_tenants = [self.session_tenant.get(sid, DEFAULT_TENANT) for sid in g.members]
        g.step_started = g.next_start = self.now
        g.step_nominal = self.now if nominal is None else nominal
        g.overdue = False
        g.pace_epoch += 1
        self._push(self.now + dur / 1000.0, _STEP, ("step", g.id, dur))

    def _end_step(self, gid: str, dur: float) -> None:
        g = self.gpus.get(gid)
        if g is None:
            return
        n_plain = g.step_members - len(g.step_extra)
        if n_plain > 0:
            self.step_dur.append(dur)
            self.step_n.append(n_plain)
            self.step_t.append(self.now)
        for lat in g.step_extra:
            self.extra_lat.append(lat)
            self.extra_t.append(self.now)
        g.busy = False
        g.step_extra = []
        if self.tenants_on and g.step_tenants:
            self._charge(g.step_tenants, dur / 1000.0)
        period = self.cfg.stream_period_ms
        if period is None or not g.members:
            self._start_step(g)
            return
        g.next_start = max(self.now, g.step_nominal + period / 1000.0)
        if g.next_start <= self.now:
            self._start_step(g)
            return
        self._push(g.next_start, _STEP, ("due", g.id, g.pace_epoch))
        if self.jobs is not None:
            self.jobs.fill_beside(g.id)  # the gap until then is the streams' slack

    def _due(self, gid: str, epoch: int) -> None:
        """A paced GPU's next step is due (unless a session joining started one already)."""
        g = self.gpus.get(gid)
        if g is None or g.busy or g.pace_epoch != epoch:
            return
        if self.cfg.stream_lead_ms > 0 and self.jobs is not None and self.jobs.beside_on(gid):
            g.overdue = True  # the job step beside it ends within the lead: then (`beside_ended`)
            return
        self._start_step(g, nominal=g.next_start)

    def beside_ended(self, gid: str) -> None:
        """A job step beside the streams of ``gid`` ended (or stopped): their step, if overdue, now."""
        g = self.gpus.get(gid)
        if g is not None and g.overdue and not g.busy:
            self._start_step(g, nominal=g.next_start)

    def stream_demands(self, gid: str) -> list[StreamDemand]:
        """What the streams of ``gid`` need of it next (``contracts.coserve``), for a GPU between two
        paced steps: one coalesced step, to start at its paced time (so it ends no later than
        without a job beside it) and take ``latency_ms`` at the load resident now. Empty when the
        GPU has no session; a GPU whose step is running has no slack until it ends."""
        g = self.gpus[gid]
        if not g.members:
            return []
        generation_s = g.spec.latency_ms(g.load) / 1000.0
        if g.busy:
            return [StreamDemand(finish_by=self.now + generation_s, generation_s=generation_s)]
        lead_s = self.cfg.stream_lead_ms / 1000.0
        return [StreamDemand(finish_by=g.next_start + generation_s + lead_s, generation_s=generation_s)]

    def _charge(self, tenants: list[str], step_s: float) -> None:
        """A step's GPU time, each chunk its share of it (batch-aware, as ``sessions.usage`` charges)."""
        share = step_s / len(tenants)
        measured = self.now >= self.cfg.measure_from_s
        for tenant in tenants:
            self.tenant_window[tenant] = self.tenant_window.get(tenant, 0.0) + share
            self.tenant_recent.append((self.now, tenant, share))
            if measured:
                self.tenant_seconds[tenant] = self.tenant_seconds.get(tenant, 0.0) + share

    def _tenant_shares(self) -> TenantShares:
        horizon = self.now - self.cfg.tenant_window_s
        recent, window = self.tenant_recent, self.tenant_window
        while recent and recent[0][0] < horizon:
            _, tenant, share = recent.popleft()
            window[tenant] -= share
        return TenantShares(
            session_tenant=self.session_tenant, weights=self.cfg.tenant_weights or {}, usage=window
        )

    # -- decisions -------------------------------------------------------------------------------
    def _decide(self, event: Event) -> None:
        """One decision: the live loop's pipeline (``scheduling.core.pipeline.decision_run``) on the
        pool in one region, the jobs' demand its input; its one region's decision is applied."""
        inputs = DecisionInputs(
            snapshot=self.snapshot(),
            event=event,
            jobs=self.jobs.demand() if self.jobs is not None else None,
            tenants=self._tenant_shares() if self.tenants_on else None,
        )
        c0 = wallclock.process_time()
        t0 = wallclock.perf_counter()
        decision = decision_run(inputs, self._policies).regions[ONE_REGION.default].decision
        self.sched_ms.append((wallclock.perf_counter() - t0) * 1000.0)
        # CPU time as well: on a shared machine wall time includes preemption by other processes.
        self.sched_cpu_ms.append((wallclock.process_time() - c0) * 1000.0)
        self._apply(decision)
        if self.jobs is not None:
            self.jobs.after_decision()

    def _policies(self, regions: Sequence[str]) -> dict[str, Policy]:
        """The pipeline's policy provider: the simulated pool is one region, with the one policy."""
        return dict.fromkeys(regions, self.policy)

    def _decide_tick(self) -> None:
        self._decide(Event(self.now, "tick"))

    def _fail(self, message: str) -> None:
        raise SimulationError(f"t={self.now:.3f}s policy {self.policy.name}: {message}")

    def _apply(self, d: Decision) -> None:
        before = self._provisioned()
        for type_key, count in d.add_gpus:
            if type_key not in self.types:
                self._fail(f"unknown GPU type {type_key!r}")
            new: list[_Gpu] = []
            for _ in range(count):
                if self._provisioned() >= self.cfg.max_gpus:
                    break
                new.append(self._new_gpu(self.types[type_key], ready=False, schedule=False))
            if new:
                self._scale_out(self.types[type_key], new)
        for gid in d.undrain:
            g = self.gpus.get(gid)
            if g is not None and g.status == "draining":
                g.status = "ready"
                self._touch_gpu(g)
        for sid in d.suspend:
            s = self.sessions.get(sid)
            if s is None or s.state != "executing":
                self._fail(f"suspend of non-executing session {sid}")
            self._detach(s)
            s.state = "suspended"
            s.since = self.now
            s.resident_before = True
            # A stall still pending (a resume copy or κ whose chunk was never generated) does not
            # carry over: the next resume pays its own copy, once.
            s.stall_ms = 0.0
            self._touch_session(s)
        for m in d.migrations:
            s = self.sessions.get(m.session)
            dst = self.gpus.get(m.dst)
            if s is None or s.gpu != m.src or dst is None or dst.status != "ready":
                self._fail(f"invalid migration {m}")
            src = self.gpus[m.src]
            self._detach(s)
            # κ from the state bytes and the slower end's link (α–β), not the policy's own figure.
            s.stall_ms += max(src.spec.kappa_ms(s.bytes), dst.spec.kappa_ms(s.bytes))
            self._check_memory(dst, s)
            self._attach(s, dst)
            self.migrations += 1
        for sid, gid in d.assign:
            s = self.sessions.get(sid)
            g = self.gpus.get(gid)
            if s is None or g is None or g.status != "ready":
                self._fail(f"assign of {sid} to non-ready GPU {gid}")
            if s.state == "executing":
                self._fail(f"assign of already executing session {sid}")
            if s.queued_at is not None:
                wait = (self.now - s.queued_at) * 1000.0
                self.max_wait_ms = max(self.max_wait_ms, wait)
                s.stall_ms += wait
                s.queued_at = None
            if s.resident_before:
                s.stall_ms += g.spec.resume_ms(s.bytes)
            self._check_memory(g, s)
            self._attach(s, g)
        for sid in d.queue:
            s = self.sessions.get(sid)
            if s is None or not s.alpha or s.state == "executing":
                self._fail(f"queue of session {sid} that is not an unplaced active session")
            if s.state != "queued":
                s.state = "queued"
                s.queued_at = self.now
                s.since = self.now
                self.queued_sessions += 1
                self._touch_session(s)
        for gid in d.drain:
            g = self.gpus.get(gid)
            if g is None or g.status != "ready":
                self._fail(f"drain of non-ready GPU {gid}")
            g.status = "draining"
            self._touch_gpu(g)
        for gid in d.release:
            g = self.gpus.get(gid)
            if g is None or g.status not in ("provisioning", "ready", "draining"):
                self._fail(f"release of unknown GPU {gid}")
            if g.members:
                self._fail(f"release of GPU {gid} with {len(g.members)} resident sessions")
            g.status = "released"
            g.released_at = self.now
            self._drop_gpu(g)
        if self.cfg.validate:
            queued: list[_Session] = []
            for sid in self.pending:
                s = self.sessions[sid]
                if s.state != "queued":
                    self._fail(f"active session {sid} neither placed nor queued")
                queued.append(s)
            if queued:
                self._check_queue_only_when_full(queued)
        after = self._provisioned()
        if after != before:
            self.scale_actions += 1
            self.budget_samples.append((self.now, after))
        self.peak_gpus = max(self.peak_gpus, after)

    def _check_queue_only_when_full(self, queued: list[_Session]) -> None:
        """A session may wait only while no ready GPU has memory for it (after the decision)."""
        smallest = min(s.bytes for s in queued)
        for g in self.gpus.values():
            if g.status != "ready" or len(g.members) + 1 > g.spec.session_limit():
                continue
            room = g.spec.bytes_limit() - g.bytes
            if room < smallest:
                continue
            s = next(s for s in queued if s.bytes <= room)
            self._fail(
                f"session {s.id} left queued while ready GPU {g.id} has memory for it "
                f"({len(g.members)} resident sessions; queue only when no ready GPU has memory)"
            )

    def _check_memory(self, g: _Gpu, s: _Session) -> None:
        if len(g.members) + 1 > g.spec.session_limit() or g.bytes + s.bytes > g.spec.bytes_limit():
            self._fail(f"GPU {g.id} memory limit exceeded by {s.id}")

    # -- main loop -------------------------------------------------------------------------------
    def run(self, events: Sequence[Any], progress: Callable[[int], None] | None = None) -> SimResult:
        cfg = self.cfg
        duration = cfg.duration_s if cfg.duration_s is not None else (events[-1].t if events else 0.0)
        for _ in range(cfg.initial_gpus):
            self._new_gpu(self.primary, ready=True)
        self.peak_gpus = self._provisioned()
        self.budget_samples.append((0.0, self.peak_gpus))
        if cfg.tick_s > 0:
            self._push(cfg.tick_s, _TICK, ("tick",))
        i = 0
        n = len(events)
        while True:
            next_trace = events[i].t if i < n else math.inf
            next_internal = self.heap[0][0] if self.heap else math.inf
            if next_trace == math.inf and next_internal > duration:
                break
            if next_internal < next_trace or (next_internal == next_trace and self.heap[0][1] < _TRACE):
                t, _, _, payload = heapq.heappop(self.heap)
                if t > duration:
                    break
                self.now = t
                kind = payload[0]
                if kind == "step":
                    self._end_step(payload[1], payload[2])
                elif kind == "due":
                    self._due(payload[1], payload[2])
                elif kind == "ready":
                    g = self.gpus.get(payload[1])
                    if g is not None and g.status == "provisioning":
                        g.status = "ready"
                        self._touch_gpu(g)
                        self._decide(Event(t, "gpu_ready", gpu=g.id))
                elif kind == "job":
                    self.jobs.on_timer(payload)  # type: ignore[union-attr]
                elif kind == "tick":
                    self._decide(Event(t, "tick"))
                    if t + cfg.tick_s <= duration:
                        self._push(t + cfg.tick_s, _TICK, ("tick",))
                continue
            ev = events[i]
            i += 1
            if ev.t > duration:
                continue
            self.now = ev.t
            self._trace_event(ev)
            if progress is not None and i % 1000 == 0:
                progress(1000)
        self.now = duration
        return self._result(duration)

    def _trace_event(self, ev: Any) -> None:
        if isinstance(ev, JobEvent):
            if self.jobs is None:
                raise SimulationError(f"t={ev.t}: job event {ev.job} but no job policy configured")
            self.jobs.on_trace(ev)
            return
        was_active = self._trace_event_bookkeeping(ev)
        self._decide(Event(self.now, ev.event, session=ev.session, was_active=was_active))

    def _trace_event_bookkeeping(self, ev: TraceEvent) -> bool:
        """A session event's bookkeeping before its decision; returns whether it ended an active
        period. (The scheduler benchmark builds its warm state with it, deciding nothing.)"""
        kind = ev.event
        was_active = False
        if kind == "arrive":
            s = _Session(ev.session, float(ev.load), int(self.primary.state_bytes * float(ev.load)), self.now)
            self.sessions[s.id] = s
            if getattr(ev, "tenant", None) is not None:
                self.session_tenant[s.id] = ev.tenant
                self.tenants_on = True
            self._touch_session(s)
        else:
            s = self.sessions.get(ev.session)
            if s is None:
                raise SimulationError(f"t={ev.t}: event for unknown session {ev.session}")
            was_active = bool(s.alpha)
            if kind == "active":
                if not s.alpha:
                    s.alpha = 1
                    self.n_active += 1
                self._touch_session(s)
            elif kind == "idle":
                if s.alpha:
                    s.alpha = 0
                    self.n_active -= 1
                if s.state == "queued":
                    s.state = "suspended"
                    s.queued_at = None
                self._touch_session(s)
            elif kind == "depart":
                if s.alpha:
                    self.n_active -= 1
                self._detach(s)
                del self.sessions[s.id]
                self.session_views.pop(s.id, None)
                self.pending.pop(s.id, None)
                self.idle_resident.pop(s.id, None)
        self.active_samples.append((self.now, self.n_active))
        return was_active

    # -- results ---------------------------------------------------------------------------------
    def _result(self, duration: float) -> SimResult:
        dur = np.asarray(self.step_dur, dtype=float)
        cnt = np.asarray(self.step_n, dtype=float)
        extra = np.asarray(self.extra_lat, dtype=float)
        t0 = self.cfg.measure_from_s
        if t0 > 0:
            keep = np.asarray(self.step_t, dtype=float) >= t0
            dur, cnt = dur[keep], cnt[keep]
            extra = extra[np.asarray(self.extra_t, dtype=float) >= t0]
        values = np.concatenate([dur, extra])
        weights = np.concatenate([cnt, np.ones_like(extra)])
        chunks = int(weights.sum())
        if chunks:
            order = np.argsort(values, kind="stable")
            v, w = values[order], weights[order]
            cum = np.cumsum(w)
            p99 = float(v[np.searchsorted(cum, 0.99 * chunks - 1e-9)])
            worst = float(v[-1])
            mean = float((v * w).sum() / chunks)
            pass_rate = float(w[v <= self.slo_ms + 1e-9].sum() / chunks)
        else:
            p99 = worst = mean = 0.0
            pass_rate = 1.0
        gpu_seconds = 0.0
        cost = 0.0
        for g in self.all_gpus:
            end = g.released_at if g.released_at is not None else duration
            secs = max(0.0, min(end, duration) - max(g.requested_at, t0))
            gpu_seconds += secs
            cost += secs / 3600.0 * g.spec.price_per_hour
        sched = np.asarray(self.sched_ms, dtype=float)
        return SimResult(
            policy=self.policy.name,
            trace=self.trace_name,
            chunks=chunks,
            worst_chunk_latency_ms=round(worst, 3),
            p99_chunk_latency_ms=round(p99, 3),
            mean_chunk_latency_ms=round(mean, 3),
            slo_ms=self.slo_ms,
            slo_pass_rate=round(pass_rate, 6),
            gpu_cost_usd=round(cost, 4),
            gpu_seconds=round(gpu_seconds, 3),
            peak_gpus=self.peak_gpus,
            migrations=self.migrations,
            scale_actions=self.scale_actions,
            max_wait_ms=round(self.max_wait_ms, 3),
            scheduler_ms_mean=round(float(sched.mean()), 4) if sched.size else 0.0,
            scheduler_ms_p99=round(float(np.percentile(sched, 99)), 4) if sched.size else 0.0,
            scheduler_ms_max=round(float(sched.max()), 4) if sched.size else 0.0,
            decisions=int(sched.size),
            initial_gpus=self.cfg.initial_gpus,
            profile=",".join(self.types),
            duration_s=duration,
            queued_sessions=self.queued_sessions,
            timeline=self._timeline(duration),
            jobs=self.jobs.result(duration) if self.jobs is not None else None,
            tenants=self._tenants_result() if self.tenants_on else None,
            policy_config=self.policy.describe(),
            scale_out=self._scale_out_summary(),
            scale_out_events=self.scale_out_events,
        )

    def _tenants_result(self) -> dict[str, Any]:
        weights = dict(self.cfg.tenant_weights or {})
        names = sorted(set(self.tenant_seconds) | set(weights))
        total = sum(self.tenant_seconds.values())
        weight_sum = sum(weights.get(t, 1.0) for t in names)
        return {
            t: {
                "gpu_seconds": round(self.tenant_seconds.get(t, 0.0), 3),
                "share": round(self.tenant_seconds.get(t, 0.0) / total, 4) if total else 0.0,
                "weight_share": round(weights.get(t, 1.0) / weight_sum, 4),
            }
            for t in names
        }

    def _scale_out_summary(self) -> dict[str, Any]:
        delays = [d for e in self.scale_out_events for d in e["delay_s"]]
        by_source: dict[str, int] = {}
        for e in self.scale_out_events:
            for kind, n in e["sources"].items():
                by_source[kind] = by_source.get(kind, 0) + n
        return {
            "path": dict(self.paths),
            "expected_delay_s": {name: spec.provisioning_delay_s for name, spec in self.types.items()},
            "scale_outs": len(self.scale_out_events),
            "gpus": len(delays),
            "delay_s_mean": round(float(np.mean(delays)), 6) if delays else None,
            "delay_s_min": round(min(delays), 6) if delays else None,
            "delay_s_max": round(max(delays), 6) if delays else None,
            "by_source": by_source,
        }

    def _timeline(self, duration: float) -> list[dict[str, float]]:
        w = self.cfg.window_s
        nwin = max(1, math.ceil(duration / w)) if duration > 0 else 1
        rows = [
            {
                "t0": k * w,
                "t1": min((k + 1) * w, duration),
                "active_max": 0,
                "budget_max": 0,
                "worst_ms": 0.0,
                "cost_usd": 0.0,
            }
            for k in range(nwin)
        ]

        def idx(t: float) -> int:
            return min(nwin - 1, max(0, int(t // w)))

        # Step functions (active sessions, provisioned GPUs): the value entering each window and
        # every change inside it; one pass over the samples each.
        for key, samples in (("active_max", self.active_samples), ("budget_max", self.budget_samples)):
            value = 0
            j = 0
            for k, row in enumerate(rows):
                peak = value
                end = (k + 1) * w if k < nwin - 1 else math.inf
                while j < len(samples) and samples[j][0] < end:
                    value = samples[j][1]
                    peak = max(peak, value)
                    j += 1
                row[key] = peak
        for t, d in zip(self.step_t, self.step_dur, strict=True):
            r = rows[idx(t)]
            r["worst_ms"] = max(r["worst_ms"], d)
        for t, d in zip(self.extra_t, self.extra_lat, strict=True):
            r = rows[idx(t)]
            r["worst_ms"] = max(r["worst_ms"], d)
        for g in self.all_gpus:
            end = min(g.released_at if g.released_at is not None else duration, duration)
            start = g.requested_at
            k = idx(start)
            while k < nwin and start < end:
                seg_end = min(end, (k + 1) * w)
                rows[k]["cost_usd"] += (seg_end - start) / 3600.0 * g.spec.price_per_hour
                start = seg_end
                k += 1
        for row in rows:
            row["worst_ms"] = round(row["worst_ms"], 3)
            row["cost_usd"] = round(row["cost_usd"], 5)
        return rows


def simulate(
    events: Sequence[Any],
    policy: Policy,
    config: SimConfig,
    trace_name: str = "trace",
    progress: Callable[[int], None] | None = None,
    job_events: Sequence[JobEvent] = (),
    jobs: JobConfig | None = None,
) -> SimResult:
    """Replay ``events`` (``TraceEvent``s sorted by ``t``) through ``policy``; see module docstring.

    ``job_events`` (one-shot jobs) need ``jobs`` (the job policy and cost profiles); the result then
    carries ``jobs``. Without job events the run is exactly the stream-only simulation."""
    if job_events and jobs is None:
        raise ValueError("job events need a JobConfig (the job policy and cost profiles)")
    merged = merge_by_time(events, job_events) if job_events else events
    return Simulator(policy, config, trace_name, jobs if job_events else None).run(merged, progress)
