"""Stage-level serving in virtual time: TridentServe, its ablations and the paper's baselines.

The cluster is a list of GPUs (8 per machine), each with a role, the stages whose weights it holds
and the time it is next free. Policies run once per dispatch tick (clock-driven, §5.2); a dispatch
reserves the GPUs of every stage of a request at once (the runtime engine's FIFO per worker makes
that reservation exact: work planned earlier runs first). Stage times are the profiles' analytic
figures, so a run is deterministic for a trace.

* ``tridentserve`` — Alg. 2 placement bootstrapped from the first window's requests, the §5.3
  trigger with Adjust-on-Dispatch (roles change in the metadata at once; a GPU loads a stage's
  weights from a peer on its machine or the host cache when a dispatch first needs them), and the
  HiGHS dispatcher. Ablations (§8.4): ``switching=False`` (wo-switch), ``stage_level=False``
  (wo-stageAware: decode and encode held at the diffuse degree), ``dispatcher="srtf"``
  (wo-scheduler: greedy SRTF with aging).
* ``pipeline-static`` — B1, xDiT-like: every GPU hosts all stages, one global degree (half the best
  degree of the largest request, App. D.2), FIFO; all stages of a request on the same GPUs.
* ``stage-srtf`` — B6: a static disaggregated E/D/C split in inverse proportion to the stages'
  service rates (App. D.2), each stage at its profiled best degree, SRTF with aging.

A stage run whose weights plus activation exceed the GPU's memory is an out-of-memory event: the
request fails (it counts against SLO attainment, not in latency). Streams in the trace send one
encode request per session start to the GPUs hosting the encoder (the shared encoder pool).
"""

from __future__ import annotations

import heapq
import math
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from scheduling.core.stages.dispatch import Candidate, assign_machines, solve_dispatch
from scheduling.core.stages.placement import (
    PRIMARY_ROLE,
    VR_TYPES,
    ReplacementTrigger,
    RequestOption,
    plan_placement,
    preferred_type,
    request_options,
    role_weight_bytes,
)
from scheduling.core.stages.stage_profiles import (
    DEGREES,
    STAGES,
    GpuSpec,
    PipelineProfile,
    Shape,
    get_pipeline,
)
from scheduling.sim.traces import JobEvent, TraceEvent

POLICIES = ("tridentserve", "pipeline-static", "stage-srtf")
ABLATIONS = {
    "wo-switch": {"switching": False},
    "wo-stageAware": {"stage_level": False},
    "wo-scheduler": {"dispatcher": "srtf"},
}
# A job line without a model gets its kind's pipeline.
DEFAULT_PIPELINE = {"video": "wan-t2v", "image": "sd3-image"}
SLO_SCALE = 2.5  # §8.1: the SLO is 2.5x the latency at the optimal parallel strategy
MAX_CANDIDATE_REQUESTS = 256
# A new plan is built from the requests of the last STATS_WINDOWS monitor windows (the paper's request
# statistics): one 60 s window holds too few of a rare class, and plans built from it flap.
STATS_WINDOWS = 5


class StageSimulationError(ValueError):
    pass


@dataclass
class Request:
    id: str
    arrival: float
    shape: Shape
    deadline: float
    best_s: float
    stream: bool = False  # a session's prompt encode (E only), served by the encoder pool
    dispatched: bool = False
    cancelled: bool = False
    failed: bool = False
    finish: float | None = None
    # stage-srtf: the stage it waits for and when that stage may start.
    next_stage: str = "E"
    ready_at: float = 0.0


@dataclass
class Gpu:
    index: int
    machine: int
    role: str
    resident: set[str] = field(default_factory=set)
    free_at: float = 0.0


@dataclass(frozen=True)
class StageSimConfig:
    gpus: int
    gpu: GpuSpec
    tick_s: float = 0.5
    window_s: float = 60.0
    threshold: float = 1.5
    drain_s: float | None = None  # how long after the last arrival unfinished work may still finish
    # An out-of-memory kills the run at its first step and its worker processes with it (a CUDA OOM
    # inside a collective leaves the group unusable): its GPUs restart — this many seconds for the
    # process and CUDA context, the scale-out model's boot (scheduling/core/gpu_profiles.py) — and
    # then reload their stages' weights (from a peer on the machine or the host cache) when next
    # used. Not a free slot (issue 27).
    oom_restart_s: float = 2.0

    def __post_init__(self) -> None:
        if not (math.isfinite(self.oom_restart_s) and self.oom_restart_s >= 0):
            raise StageSimulationError("oom_restart_s must be a finite number >= 0")


class Cluster:
    """GPUs, their resident weights and reservations; every stage run goes through :meth:`run`."""

    def __init__(self, pipeline: PipelineProfile, config: StageSimConfig, roles: Sequence[str]):
        self.pipeline = pipeline
        self.gpu = config.gpu
        self.oom_restart_s = config.oom_restart_s
        per_machine = config.gpu.gpus_per_machine
        self.gpus = [Gpu(g, g // per_machine, role, set(role)) for g, role in enumerate(roles)]
        self.oom_events = 0
        self.stage_loads = 0
        self.ops: list[tuple[float, str]] = []  # (end, stage) heap for the monitor

    def set_roles(self, roles: Sequence[str]) -> None:
        """Adjust-on-Dispatch: only the metadata changes; weights move when a dispatch needs them."""
        for gpu, role in zip(self.gpus, roles, strict=True):
            gpu.role = role

    def idle(self, now: float, role: str | None = None) -> list[Gpu]:
        return [g for g in self.gpus if g.free_at <= now and (role is None or g.role == role)]

    def _load_s(self, gpu: Gpu, stage: str) -> float:
        if stage in gpu.resident:
            return 0.0
        peer = any(stage in g.resident for g in self.gpus if g.machine == gpu.machine and g is not gpu)
        rate = self.gpu.link_bytes_per_s if peer else self.gpu.host_load_bytes_per_s
        return self.pipeline.weight_bytes(stage) / rate

    def run(
        self,
        gpus: Sequence[Gpu],
        stage: str,
        earliest: float,
        duration: float,
        activation: float,
        monitored: bool = True,
    ) -> tuple[float, bool]:
        """Reserve ``gpus`` for one stage run; returns (end time, out of memory).

        An out-of-memory run crashes at its first step: its GPUs are busy until they have restarted
        (``oom_restart_s`` after the start) and hold no weights (the next run reloads them); the end
        returned is then that time.

        Adjust-on-Dispatch (§5.3): a GPU drops the stages its role no longer has when it next works
        (FIFO: everything planned under the old placement ran before), then loads the stage if it
        is missing — from a peer on its machine if one holds it, else from the host cache."""
        for g in gpus:
            g.resident = {s for s in g.resident if s in g.role}
        load = max(self._load_s(g, stage) for g in gpus)
        start = max([earliest] + [g.free_at for g in gpus]) + load
        oom = False
        for g in gpus:
            if stage not in g.resident:
                self.stage_loads += 1
                g.resident.add(stage)
            used = sum(self.pipeline.weight_bytes(s) for s in g.resident) + self.gpu.reserve_bytes
            oom = oom or used + activation > self.gpu.memory_bytes
        if oom:
            self.oom_events += 1
            end = start + self.oom_restart_s
            for g in gpus:
                g.free_at = end
                g.resident = set()
            return end, True
        end = start + duration
        for g in gpus:
            g.free_at = end
        if monitored:  # the §5.3 monitor sees the jobs' stages, not the streams' prompt encodes
            heapq.heappush(self.ops, (end, stage))
        return end, oom


def _pick_machine(cluster: Cluster, now: float, role: str, count: int) -> list[Gpu] | None:
    """``count`` idle GPUs of ``role`` on one machine, best fit (the fullest machine that has them)."""
    by_machine: dict[int, list[Gpu]] = {}
    for g in cluster.idle(now, role):
        by_machine.setdefault(g.machine, []).append(g)
    fitting = [gs for gs in by_machine.values() if len(gs) >= count]
    if not fitting:
        return None
    return min(fitting, key=len)[:count]


def _earliest(cluster: Cluster, stage: str, count: int, machine: int | None) -> list[Gpu]:
    """``count`` auxiliary GPUs hosting ``stage``, earliest to finish, preferring ``machine``."""
    hosts = [g for g in cluster.gpus if g.role == stage] or [g for g in cluster.gpus if stage in g.role]
    hosts.sort(key=lambda g: (g.free_at, g.machine != machine))
    return hosts[:count]


class TridentServe:
    def __init__(
        self,
        pipeline: PipelineProfile,
        config: StageSimConfig,
        bootstrap: Sequence[Shape],
        *,
        bootstrap_encode_s: float = 0.0,
        switching: bool = True,
        stage_level: bool = True,
        dispatcher: str = "milp",
    ):
        if dispatcher not in ("milp", "srtf"):
            raise StageSimulationError(f"unknown dispatcher {dispatcher!r}")
        self.pipeline = pipeline
        self.config = config
        self.switching = switching
        self.stage_level = stage_level
        self.dispatcher = dispatcher
        self.placement = plan_placement(
            pipeline,
            bootstrap,
            config.gpus,
            config.gpu,
            stage_level=stage_level,
            encode_only_s=bootstrap_encode_s,
        )
        self.cluster = Cluster(pipeline, config, self.placement.roles)
        self.trigger = ReplacementTrigger(config.window_s, config.threshold)
        self.replacements = 0
        self.solve_ms: list[float] = []
        self.vr_counts: dict[str, int] = dict.fromkeys(VR_TYPES, 0)

    def observe(self, now: float, arrivals: Sequence[Request]) -> None:
        while self.cluster.ops and self.cluster.ops[0][0] <= now:
            end, stage = heapq.heappop(self.cluster.ops)
            self.trigger.record(end, stage)

    def maybe_replace(self, now: float, pending: Sequence[Request], recent: Sequence[Request]) -> None:
        if not self.switching:
            return
        types = self.placement.types()
        unserved = any(
            preferred_type(self.pipeline, r.shape, self.config.gpu) not in types
            for r in pending
            if not r.stream
        )
        if not self.trigger.should_replace(now, len(pending), unserved):
            return
        window = {r.id: r for r in (*recent, *pending)}.values()
        shapes = [r.shape for r in window if not r.stream]
        encode_only_s = sum(r.best_s for r in window if r.stream)
        plan = plan_placement(
            self.pipeline,
            shapes,
            self.config.gpus,
            self.config.gpu,
            stage_level=self.stage_level,
            encode_only_s=encode_only_s,
        )
        if plan.roles != self.placement.roles:
            self.placement = plan
            self.cluster.set_roles(plan.roles)
            self.replacements += 1

    def _options(self, r: Request, types: Sequence[str]):
        for vr in types:
            yield from request_options(self.pipeline, r.shape, self.config.gpu, vr, self.stage_level)

    def dispatch(self, now: float, pending: Sequence[Request]) -> None:
        for r in pending:
            if r.stream:
                self._run_encode_only(now, r)
        types = self.placement.types()
        jobs = _shortlist([r for r in pending if not r.stream])
        if not jobs:
            return
        if self.dispatcher == "milp":
            chosen = self._milp(now, jobs, types)
            by_type: dict[str, list] = {}
            for r, option in chosen:
                by_type.setdefault(option.vr, []).append((r, option))
            for vr, runs in by_type.items():
                idle = self._idle_by_machine(now, vr)
                machines = assign_machines([o.degree for _, o in runs], idle)
                for (r, option), machine in zip(runs, machines, strict=True):
                    gpus = [g for g in self.cluster.idle(now, PRIMARY_ROLE[vr]) if g.machine == machine]
                    self._execute(now, r, option, gpus[: option.degree])
            return
        for r, option in _srtf_order(now, jobs, lambda r: self._options(r, types)):
            gpus = _pick_machine(self.cluster, now, PRIMARY_ROLE[option.vr], option.degree)
            if gpus is not None:  # else no machine has them together: pending for the next tick (§6.2)
                self._execute(now, r, option, gpus)

    def _idle_by_machine(self, now: float, vr: str) -> dict[int, int]:
        idle: dict[int, int] = {}
        for g in self.cluster.idle(now, PRIMARY_ROLE[vr]):
            idle[g.machine] = idle.get(g.machine, 0) + 1
        return idle

    def _milp(
        self, now: float, jobs: Sequence[Request], types: Sequence[str]
    ) -> list[tuple[Request, RequestOption]]:
        """Build and solve the tick's program: a *now* option per efficient degree of every type, and
        a *wait* option for when ``k`` primaries of one machine free up first."""
        release: dict[str, list[list[float]]] = {}
        for vr in types:
            per_machine: dict[int, list[float]] = {}
            for g in self.cluster.gpus:
                if g.role == PRIMARY_ROLE[vr]:
                    per_machine.setdefault(g.machine, []).append(max(now, g.free_at))
            release[vr] = [sorted(times) for times in per_machine.values()]
        candidates: list[Candidate] = []
        options: list[RequestOption] = []
        for index, r in enumerate(jobs):
            offers = []
            for option in self._options(r, types):
                starts = [
                    times[option.degree - 1] for times in release[option.vr] if len(times) >= option.degree
                ]
                if starts:
                    offers.append((option, min(starts)))
            # A late start is offered only once no degree can make the deadline any more: while one
            # still can, starting late now would only take GPUs an on-time run needs (aging takes
            # over from there).
            still_on_time = any(now + option.run_s <= r.deadline for option, _ in offers)
            for option, start in offers:
                begins = max(now, start)
                late = begins + option.run_s > r.deadline
                if late and (start > now or still_on_time):  # a late wait never beats a late start
                    continue
                candidates.append(
                    Candidate(
                        index,
                        option.vr,
                        option.degree,
                        begins + option.run_s,
                        r.deadline,
                        r.best_s,
                        option.run_s,
                        option.transfer_bytes,
                        now=start <= now,
                    )
                )
                options.append(option)
        idle = {vr: list(self._idle_by_machine(now, vr).values()) for vr in types}
        size = {vr: sum(len(times) for times in release[vr]) for vr in types}
        started = time.perf_counter()
        picked = solve_dispatch(candidates, idle, size)
        self.solve_ms.append((time.perf_counter() - started) * 1000)
        return [(jobs[candidates[i].request], options[i]) for i in picked]

    def _run_encode_only(self, now: float, r: Request) -> None:
        gpu = _earliest(self.cluster, "E", 1, None)
        end, oom = self.cluster.run(
            gpu,
            "E",
            now,
            self.pipeline.encode_s(r.shape, self.config.gpu),
            self.pipeline.activation_bytes("E", r.shape, 1),
            monitored=False,
        )
        r.dispatched, r.finish, r.failed = True, end, oom

    def _execute(self, now: float, r: Request, option, gpus: list[Gpu]) -> None:
        p, shape, role = self.pipeline, r.shape, PRIMARY_ROLE[option.vr]
        machine = gpus[0].machine
        # Stage-level: encode on one GPU (§3: it does not parallelise); pipeline-level (wo-stageAware)
        # holds as many GPUs for it as the diffuse stage gets.
        e_count = 1 if self.stage_level else option.degree
        e_gpus = gpus[:e_count] if "E" in role else _earliest(self.cluster, "E", e_count, machine)
        e_end, failed = self.cluster.run(e_gpus, "E", now, option.encode_s, p.activation_bytes("E", shape, 1))
        handoff = option.transfer_s / 2 if option.vr == "V3" else option.transfer_s
        d_ready = e_end + (handoff if "E" not in role else 0.0)
        d_end, oom = self.cluster.run(
            gpus, "D", d_ready, option.diffuse_s, p.activation_bytes("D", shape, option.degree)
        )
        failed |= oom
        c_activation = p.activation_bytes("C", shape, option.decode_degree)
        if "C" in role:
            c_end, oom = self.cluster.run(
                gpus[: option.decode_degree], "C", d_end, option.decode_s, c_activation
            )
        else:
            aux = _earliest(self.cluster, "C", option.decode_degree, machine)
            c_end, oom = self.cluster.run(aux, "C", d_end + handoff, option.decode_s, c_activation)
        failed |= oom
        r.dispatched, r.finish, r.failed = True, c_end, failed
        self.vr_counts[option.vr] += 1


def _shortlist(jobs: Sequence[Request]) -> list[Request]:
    """The requests that get variables this tick, earliest deadline first, at most
    ``MAX_CANDIDATE_REQUESTS`` (bounds the program's size at any backlog)."""
    return sorted(jobs, key=lambda r: r.deadline)[:MAX_CANDIDATE_REQUESTS]


def _srtf_priority(now: float, r: Request, run_s: float) -> tuple[int, float]:
    """App. D.2 (B4/B6): on-time-feasible requests first; late ones by their overtime in units of the
    profiled runtime; shortest remaining time first within a class."""
    overtime = now + run_s - r.deadline
    level = 0 if overtime <= 0 else 1 + math.ceil(overtime / max(r.best_s, 1e-9))
    return level, run_s


def _srtf_order(now: float, jobs: Sequence[Request], options_of) -> list:
    """wo-scheduler: greedy SRTF with aging; each request takes its least-communication type and the
    highest efficient degree (its profiled optimum). The caller skips those that find no GPUs."""
    ranked = []
    for r in jobs:
        options = list(options_of(r))
        if not options:
            continue
        best_type = min(VR_TYPES.index(o.vr) for o in options)
        option = max((o for o in options if VR_TYPES.index(o.vr) == best_type), key=lambda o: o.degree)
        ranked.append((_srtf_priority(now, r, option.run_s), r, option))
    ranked.sort(key=lambda item: item[0])
    return [(r, option) for _, r, option in ranked]


class StaticPlacement:
    """A baseline's fixed placement: nothing to observe, never re-placed, no solver."""

    replacements = 0
    solve_ms: tuple[float, ...] = ()

    def observe(self, now: float, arrivals: Sequence[Request]) -> None:
        pass

    def maybe_replace(self, now: float, pending: Sequence[Request], recent: Sequence[Request]) -> None:
        pass


class PipelineStatic(StaticPlacement):
    """B1: all stages on every GPU, fixed groups of ``degree`` GPUs, FIFO, one degree for all stages."""

    def __init__(self, pipeline: PipelineProfile, config: StageSimConfig, degree: int):
        self.pipeline = pipeline
        self.config = config
        self.degree = degree
        self.cluster = Cluster(pipeline, config, ["EDC"] * config.gpus)
        per_machine = config.gpu.gpus_per_machine
        groups_per_machine = max(1, per_machine // degree)
        self.groups = [
            self.cluster.gpus[m * per_machine + i * degree : m * per_machine + (i + 1) * degree]
            for m in range(math.ceil(config.gpus / per_machine))
            for i in range(groups_per_machine)
        ]
        self.groups = [g for g in self.groups if len(g) == degree]
        if not self.groups:
            raise StageSimulationError(f"{config.gpus} GPUs cannot form one degree-{degree} instance")

    def dispatch(self, now: float, pending: Sequence[Request]) -> None:
        p, gpu, k = self.pipeline, self.config.gpu, self.degree
        free = [g for g in self.groups if g[0].free_at <= now]
        for r in pending:  # FIFO
            if not free:
                return
            group = free.pop(0)
            if r.stream:
                r.finish, r.failed = self.cluster.run(
                    group, "E", now, p.encode_s(r.shape, gpu), p.activation_bytes("E", r.shape, 1)
                )
                r.dispatched = True
                continue
            e_end, oom_e = self.cluster.run(
                group, "E", now, p.encode_s(r.shape, gpu), p.activation_bytes("E", r.shape, 1)
            )
            if oom_e:  # crashed: the group restarts (Cluster.run) and the request has failed
                r.dispatched, r.failed, r.finish = True, True, e_end
                continue
            d_end, oom_d = self.cluster.run(
                group, "D", e_end, p.diffuse_s(r.shape, k, gpu), p.activation_bytes("D", r.shape, k)
            )
            if oom_d:  # the run dies at its first step and the group restarts: busy until d_end
                r.dispatched, r.failed, r.finish = True, True, d_end
                continue
            c_end, oom_c = self.cluster.run(
                group, "C", d_end, p.decode_s(r.shape, k, gpu), p.activation_bytes("C", r.shape, k)
            )
            r.dispatched, r.failed, r.finish = True, oom_e or oom_c, c_end


class StageSrtf(StaticPlacement):
    """B6: static disaggregated stage clusters, each stage at its best degree, SRTF with aging."""

    def __init__(self, pipeline: PipelineProfile, config: StageSimConfig, bootstrap: Sequence[Shape]):
        self.pipeline = pipeline
        self.config = config
        gpu = config.gpu
        # App. D.2: n_s proportional to demand / per-instance rate, i.e. to the stage's GPU-seconds;
        # each cluster holds at least the largest degree its stage runs at.
        shapes = bootstrap or [Shape(64, 64, 1, 1)]
        work = dict.fromkeys(STAGES, 0.0)
        widest = dict.fromkeys(STAGES, 1)
        for shape in shapes:
            for stage in STAGES:
                k = _stage_degree(pipeline, shape, gpu, stage)
                work[stage] += k * pipeline.stage_s(stage, shape, k, gpu)
                widest[stage] = max(widest[stage], k)
        counts = {s: max(widest[s], round(config.gpus * work[s] / sum(work.values()))) for s in ("E", "C")}
        counts["D"] = config.gpus - counts["E"] - counts["C"]
        if counts["D"] < widest["D"]:
            raise StageSimulationError(f"{config.gpus} GPUs are too few for separate E, D and C clusters")
        roles = ["D"] * counts["D"] + ["E"] * counts["E"] + ["C"] * counts["C"]
        self.cluster = Cluster(pipeline, config, roles)

    def dispatch(self, now: float, pending: Sequence[Request]) -> None:
        p, gpu = self.pipeline, self.config.gpu
        queue = [r for r in pending if r.ready_at <= now]
        ranked = []
        for r in queue:
            k = _stage_degree(p, r.shape, gpu, r.next_stage)
            remaining = sum(
                p.stage_s(s, r.shape, _stage_degree(p, r.shape, gpu, s), gpu)
                for s in STAGES[STAGES.index(r.next_stage) :]
            )
            ranked.append((_srtf_priority(now, r, remaining), r, k))
        ranked.sort(key=lambda item: item[0])
        for _, r, k in ranked:
            stage = r.next_stage
            gpus = _pick_machine(self.cluster, now, stage, k)
            if gpus is None:
                continue
            end, oom = self.cluster.run(
                gpus, stage, now, p.stage_s(stage, r.shape, k, gpu), p.activation_bytes(stage, r.shape, k)
            )
            if r.stream or stage == "C" or oom:
                r.dispatched, r.finish, r.failed = True, end, oom
            else:
                r.next_stage = STAGES[STAGES.index(stage) + 1]
                transfer = (
                    p.text_len * p.encoder_hidden * p.bytes_per_param if stage == "E" else 0.0
                ) / gpu.link_bytes_per_s
                r.ready_at = end + transfer


def _stage_degree(pipeline: PipelineProfile, shape: Shape, gpu: GpuSpec, stage: str) -> int:
    """A stage's best degree on a GPU hosting only that stage, raised until it fits in memory."""
    best = pipeline.best_degree(stage, shape, gpu)
    for k in DEGREES:
        fits = (
            role_weight_bytes(pipeline, stage)
            + gpu.reserve_bytes
            + pipeline.activation_bytes(stage, shape, k)
            <= gpu.memory_bytes
        )
        if k >= best and fits:
            return k
    return max(DEGREES)


def static_degree(pipeline: PipelineProfile, shapes: Sequence[Shape], gpu: GpuSpec) -> int:
    """App. D.2: half the optimal diffuse degree of the largest request (at least 1)."""
    largest = max(shapes, key=pipeline.tokens)
    return max(1, pipeline.best_degree("D", largest, gpu) // 2)


def _requests(
    pipeline: PipelineProfile,
    jobs: Sequence[JobEvent],
    sessions: Sequence[TraceEvent],
    gpu: GpuSpec,
    stream_pipeline: PipelineProfile | None,
) -> tuple[list[Request], dict[str, float]]:
    requests: list[Request] = []
    cancels: dict[str, float] = {}
    for job in jobs:
        if job.event == "cancel":
            cancels[job.job] = job.t
            continue
        wanted = job.model or DEFAULT_PIPELINE[job.kind]
        if wanted != pipeline.name:
            raise StageSimulationError(
                f"job {job.job!r} needs pipeline {wanted!r}; this run serves {pipeline.name!r} "
                "(one pipeline per run: a trace of images and videos is two runs)"
            )
        shape = Shape(job.width, job.height, job.frames or 1, job.steps)
        preferred_type(pipeline, shape, gpu)  # raises if it fits under no placement
        best = pipeline.best_latency_s(shape, gpu)
        slo = job.slo_s if job.slo_s is not None else SLO_SCALE * best
        requests.append(Request(job.job, job.t, shape, job.t + slo, best))
    for event in sessions:
        if event.event != "arrive":
            continue
        if stream_pipeline is None or stream_pipeline.encoder_params != pipeline.encoder_params:
            raise StageSimulationError(
                f"session {event.session!r}: the {pipeline.name!r} encoder pool cannot serve streams"
            )
        shape = Shape(832, 480, 1, 1)
        best = stream_pipeline.encode_s(shape, gpu)
        requests.append(
            Request(f"session:{event.session}", event.t, shape, event.t + SLO_SCALE * best, best, stream=True)
        )
    requests.sort(key=lambda r: r.arrival)
    return requests, cancels


def make_policy(
    name: str,
    pipeline: PipelineProfile,
    config: StageSimConfig,
    bootstrap: Sequence[Shape],
    all_shapes: Sequence[Shape],
    bootstrap_encode_s: float = 0.0,
    **options: Any,
):
    if name == "tridentserve":
        return TridentServe(pipeline, config, bootstrap, bootstrap_encode_s=bootstrap_encode_s, **options)
    if options:
        raise StageSimulationError(f"policy {name!r} takes no options, got {sorted(options)}")
    if name == "pipeline-static":
        return PipelineStatic(
            pipeline, config, static_degree(pipeline, all_shapes or [Shape(64, 64, 1, 1)], config.gpu)
        )
    if name == "stage-srtf":
        return StageSrtf(pipeline, config, bootstrap)
    raise StageSimulationError(f"unknown policy {name!r} (expected one of {list(POLICIES)})")


def simulate_stages(
    jobs: Sequence[JobEvent],
    sessions: Sequence[TraceEvent],
    policy: str,
    config: StageSimConfig,
    *,
    pipeline: str | None = None,
    options: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Run one policy over a mixed trace; returns the result dictionary of ``simulate_stages --json``."""
    submits = [j for j in jobs if j.event == "submit"]
    if not submits:
        raise StageSimulationError("the trace has no job submits")
    profile = get_pipeline(pipeline or submits[0].model or DEFAULT_PIPELINE[submits[0].kind])
    stream_profile = get_pipeline("wan-1.3b") if sessions else None
    requests, cancels = _requests(profile, jobs, sessions, config.gpu, stream_profile)
    job_shapes = [r.shape for r in requests if not r.stream]
    # The bootstrap placement sees the first window's requests, as the paper's offline statistics.
    first_window = [r for r in requests if r.arrival <= requests[0].arrival + config.window_s]
    bootstrap = [r.shape for r in first_window if not r.stream]
    encode_s = sum(r.best_s for r in first_window if r.stream)
    engine = make_policy(policy, profile, config, bootstrap, job_shapes, encode_s, **(options or {}))
    last_arrival = requests[-1].arrival
    drain = (
        config.drain_s if config.drain_s is not None else 4 * max(r.deadline - r.arrival for r in requests)
    )
    horizon = last_arrival + drain
    pending: list[Request] = []
    recent: list[Request] = []
    by_id = {r.id: r for r in requests}
    cancel_queue = sorted((t, job) for job, t in cancels.items())
    next_arrival = 0
    now = 0.0
    while now <= horizon:
        arrived = []
        while next_arrival < len(requests) and requests[next_arrival].arrival <= now:
            arrived.append(requests[next_arrival])
            next_arrival += 1
        while cancel_queue and cancel_queue[0][0] <= now:
            target = by_id.get(cancel_queue.pop(0)[1])
            if target is not None and not target.dispatched:
                target.cancelled = True
        pending = [r for r in pending + arrived if not r.dispatched and not r.cancelled]
        recent = [r for r in recent + arrived if r.arrival > now - STATS_WINDOWS * config.window_s]
        engine.observe(now, arrived)
        engine.maybe_replace(now, pending, recent)
        if pending:
            engine.dispatch(now, pending)
            pending = [r for r in pending if not r.dispatched]
        if next_arrival >= len(requests) and not pending:
            break
        now = _next_tick(now, config.tick_s, pending, requests, next_arrival, engine.cluster)
    return _result(policy, requests, engine, config, horizon)


def _next_tick(now: float, tick: float, pending, requests, next_arrival: int, cluster: Cluster) -> float:
    """Skip ticks where nothing can change: no arrival, no GPU becoming free, no stage becoming ready."""
    wake = [requests[next_arrival].arrival] if next_arrival < len(requests) else []
    if pending:
        wake += [g.free_at for g in cluster.gpus if g.free_at > now]
        wake += [r.ready_at for r in pending if r.ready_at > now]
        if any(g.free_at <= now for g in cluster.gpus):
            wake.append(now + tick)
    target = min(wake) if wake else now + tick
    return max(now + tick, math.ceil(target / tick - 1e-9) * tick)


def _result(
    policy: str, requests: Sequence[Request], engine, config: StageSimConfig, horizon: float
) -> dict[str, Any]:
    jobs = [r for r in requests if not r.stream and not r.cancelled]
    streams = [r for r in requests if r.stream]
    done = [r for r in jobs if r.finish is not None and not r.failed and r.finish <= horizon]
    latencies = np.array([r.finish - r.arrival for r in done]) if done else np.array([math.nan])
    on_time = sum(1 for r in done if r.finish <= r.deadline + 1e-9)
    end = max([r.finish for r in requests if r.finish is not None] + [requests[-1].arrival])
    stream_waits = [r.finish - r.arrival for r in streams if r.finish is not None]
    solve = np.array(engine.solve_ms) if engine.solve_ms else np.array([0.0])
    result = {
        "policy": policy,
        "slo_attainment": on_time / len(jobs) if jobs else 0.0,
        "mean_latency_s": float(np.mean(latencies)),
        "p95_latency_s": float(np.percentile(latencies, 95)),
        "oom_events": engine.cluster.oom_events,
        "replacements": engine.replacements,
        "gpu_cost_usd": config.gpus * config.gpu.price_per_hour * end / 3600,
        "jobs": len(jobs),
        "finished": len(done),
        "failed": sum(1 for r in jobs if r.failed),
        "stage_loads": engine.cluster.stage_loads,
        "solve_ms_p50": float(np.percentile(solve, 50)),
        "solve_ms_p99": float(np.percentile(solve, 99)),
        "streams": len(streams),
        "stream_encode_p95_s": float(np.percentile(stream_waits, 95)) if stream_waits else None,
    }
    if isinstance(engine, TridentServe):
        result["virtual_replicas"] = dict(engine.vr_counts)
        result["final_roles"] = {
            role: engine.placement.count(role) for role in sorted(set(engine.placement.roles))
        }
    return result
