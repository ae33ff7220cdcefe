"""Placement plans (TridentServe §6.1, Alg. 2, App. C.1) and the re-placement trigger (§5.3).

A GPU's *role* is the set of stages it hosts: ``EDC``, ``ED``, ``DC``, ``D`` hold the diffusion model
(primary replicas P0–P3), ``E`` and ``C`` are auxiliary (A0, A1). A request runs on a *virtual
replica* — a primary of its type plus the auxiliaries for the stages the primary lacks::

    V0: EDC          V1: ED + C          V2: DC + E          V3: D + E + C

Inter-stage traffic grows with the index, so each request's preferred type is the first one that
fits in memory (single-request solution). Alg. 2 then gives each type GPUs in proportion to the
work of the requests preferring it, splits each type's budget between primary and auxiliaries in
inverse proportion to their service rates (App. C.1 Split), aligns D-carrying primaries to the
largest parallel degree and packs homogeneous blocks per 8-GPU machine (PackPerMachine).

Memory feasibility is by construction: a request is only ever offered a type and degree for which
:func:`request_options` found the stage weights of the role plus the largest activation within the
GPU (the dispatcher filters on the same function, constraint C0), so no plan can run out of memory.

Where the extracted paper lost a formula we took the authors' code (PKU-DAIR/Hetu-DiT) or wrote
down our own reading; docs/stages.md lists each choice.
"""

from __future__ import annotations

import math
from collections import Counter, deque
from collections.abc import Sequence
from dataclasses import dataclass
from functools import lru_cache

from .stage_profiles import DEGREES, GpuSpec, PipelineProfile, Shape

VR_TYPES = ("V0", "V1", "V2", "V3")
PRIMARY_ROLE = {"V0": "EDC", "V1": "ED", "V2": "DC", "V3": "D"}
AUX_STAGES = {"V0": "", "V1": "C", "V2": "E", "V3": "EC"}
ROLES = ("EDC", "ED", "DC", "D", "E", "C")
# The types whose primary holds D and C together. A live stream needs its decoder next to its
# diffusion model (the causal decoder's per-session cache), so ``plan_placement``'s
# ``stream_shapes`` only ever go to these (docs/stages.md, "Live placement").
STREAM_TYPES = ("V0", "V2")


class PlacementError(ValueError):
    pass


@dataclass(frozen=True)
class RequestOption:
    """One way to run a request: virtual replica type, diffuse degree, and what it costs."""

    vr: str
    degree: int
    decode_degree: int
    encode_s: float
    diffuse_s: float
    decode_s: float
    transfer_s: float  # inter-stage hand-offs this type adds (Table 3 "Comm.")
    transfer_bytes: float

    @property
    def run_s(self) -> float:
        return self.encode_s + self.diffuse_s + self.decode_s + self.transfer_s


def role_weight_bytes(pipeline: PipelineProfile, role: str) -> float:
    return sum(pipeline.weight_bytes(stage) for stage in role)


def _fits(pipeline: PipelineProfile, gpu: GpuSpec, role: str, activation: float) -> bool:
    return role_weight_bytes(pipeline, role) + gpu.reserve_bytes + activation <= gpu.memory_bytes


def _decode_degree(
    pipeline: PipelineProfile, shape: Shape, gpu: GpuSpec, role: str, limit: int, floor: int | None = None
) -> int | None:
    """The profiled best decode degree (or ``floor``), raised to the smallest that fits; ``None`` if
    none does up to ``limit``."""
    best = pipeline.best_degree("C", shape, gpu) if floor is None else floor
    for degree in DEGREES:
        if (
            degree >= best
            and degree <= limit
            and _fits(pipeline, gpu, role, pipeline.activation_bytes("C", shape, degree))
        ):
            return degree
    return None


def _handoff_bytes(pipeline: PipelineProfile, shape: Shape, vr: str) -> float:
    embeddings = pipeline.text_len * pipeline.encoder_hidden * pipeline.bytes_per_param
    latents = pipeline.tokens(shape) * pipeline.patch * pipeline.patch * 16 * 4  # 16 latent channels, fp32
    return {"V0": 0.0, "V1": latents, "V2": embeddings, "V3": embeddings + latents}[vr]


@lru_cache(maxsize=65536)
def request_options(
    pipeline: PipelineProfile, shape: Shape, gpu: GpuSpec, vr: str, stage_level: bool = True
) -> tuple[RequestOption, ...]:
    """Every memory-feasible, efficient way to run ``shape`` on virtual replica ``vr`` (C0 of §6.2).

    Diffuse degrees pass the 0.8 efficiency filter; when none of them fits in memory the smallest
    degree that fits is offered instead (a request is never unplaceable while some degree fits).
    Encode and decode take their profiled best degree (§6.2); with ``stage_level=False`` (the
    wo-stageAware ablation) decode takes the diffuse degree instead, as a pipeline-level system does.
    """
    role = PRIMARY_ROLE[vr]
    aux = AUX_STAGES[vr]
    if "E" in aux and not _fits(pipeline, gpu, "E", pipeline.activation_bytes("E", shape, 1)):
        return ()
    if "E" in role and not _fits(pipeline, gpu, role, pipeline.activation_bytes("E", shape, 1)):
        return ()
    if "C" in aux and _decode_degree(pipeline, shape, gpu, "C", max(DEGREES)) is None:
        return ()
    fitting = [k for k in DEGREES if _fits(pipeline, gpu, role, pipeline.activation_bytes("D", shape, k))]
    efficient = [k for k in fitting if k in pipeline.efficient_degrees("D", shape, gpu)]
    degrees = efficient or fitting[:1]
    transfer_bytes = _handoff_bytes(pipeline, shape, vr)
    transfer_s = transfer_bytes / gpu.link_bytes_per_s
    options = []
    for k in degrees:
        floor = None if stage_level else k
        decode_role, limit = ("C", max(DEGREES)) if "C" in aux else (role, k)
        decode_degree = _decode_degree(pipeline, shape, gpu, decode_role, limit, floor)
        if decode_degree is None:
            continue
        options.append(
            RequestOption(
                vr=vr,
                degree=k,
                decode_degree=decode_degree,
                encode_s=pipeline.encode_s(shape, gpu),
                diffuse_s=pipeline.diffuse_s(shape, k, gpu),
                decode_s=pipeline.decode_s(shape, decode_degree, gpu),
                transfer_s=transfer_s,
                transfer_bytes=transfer_bytes,
            )
        )
    return tuple(options)


def preferred_type(pipeline: PipelineProfile, shape: Shape, gpu: GpuSpec) -> str:
    """Single-request solution: the first feasible type in V0 < V1 < V2 < V3 (least communication)."""
    for vr in VR_TYPES:
        if request_options(pipeline, shape, gpu, vr):
            return vr
    raise PlacementError(f"{pipeline.name} {shape} does not fit a {gpu.name} under any placement type")


@dataclass(frozen=True)
class Placement:
    """A placement plan: the role of every GPU (machine of GPU g = g // gpus_per_machine)."""

    roles: tuple[str, ...]
    gpus_per_machine: int = 8

    def count(self, role: str) -> int:
        return sum(1 for r in self.roles if r == role)

    def types(self) -> list[str]:
        """Virtual-replica types this plan can serve (the primary is there, and so are its auxiliaries)."""
        present = set(self.roles)
        return [
            vr
            for vr in VR_TYPES
            if PRIMARY_ROLE[vr] in present
            and all(any(s in r and "D" not in r for r in present) for s in AUX_STAGES[vr])
        ]


def _work(
    pipeline: PipelineProfile, shape: Shape, gpu: GpuSpec, vr: str, stage_level: bool
) -> tuple[float, float, float]:
    """GPU-seconds one request of type ``vr`` puts on its primary, its E auxiliary and its C auxiliary."""
    option = max(request_options(pipeline, shape, gpu, vr, stage_level), key=lambda o: o.degree)
    primary = option.degree * option.diffuse_s
    aux_e = aux_c = 0.0
    decode = option.decode_degree * option.decode_s
    # Pipeline-level allocation holds the diffuse degree's GPUs for the encode too.
    encode = option.encode_s * (1 if stage_level else option.degree)
    if "E" in PRIMARY_ROLE[vr]:
        primary += encode
    else:
        aux_e = encode
    if "C" in PRIMARY_ROLE[vr]:
        primary += decode
    else:
        aux_c = decode
    return primary, aux_e, aux_c


def _apportion(total: int, weights: dict[str, float], minimum: dict[str, int]) -> dict[str, int]:
    """Largest-remainder rounding of ``total`` units in proportion to ``weights``, respecting minimums."""
    keys = [k for k, w in weights.items() if w > 0]
    counts = {k: minimum.get(k, 0) for k in keys}
    left = total - sum(counts.values())
    if left < 0:
        raise PlacementError(f"{total} GPUs cannot hold the minimum of {sum(counts.values())}")
    weight_sum = sum(weights[k] for k in keys)
    ideal = {k: total * weights[k] / weight_sum for k in keys}
    extra = {k: max(0.0, ideal[k] - counts[k]) for k in keys}
    extra_sum = sum(extra.values())
    if extra_sum > 0:
        share = {k: left * extra[k] / extra_sum for k in keys}
        for k in keys:
            counts[k] += int(share[k])
        rest = left - sum(int(share[k]) for k in keys)
        for k in sorted(keys, key=lambda k: share[k] - int(share[k]), reverse=True)[:rest]:
            counts[k] += 1
    elif keys:
        counts[keys[0]] += left
    return counts


def split_type(
    vr: str, budget: int, primary_work: float, aux_work: dict[str, float], primary_min: int = 1
) -> dict[str, int]:
    """App. C.1 Split: the type's GPUs between primary and auxiliaries, inverse to their service rates.

    A role's service rate is the inverse of the GPU-seconds it spends per request, so "inverse to the
    rates" is "in proportion to the work". Each auxiliary keeps at least one GPU and the primary at
    least ``primary_min`` (the smallest degree its requests run at) when the budget allows; tiny
    budgets go to the primary first (feasibility over proportionality)."""
    roles = {PRIMARY_ROLE[vr]: primary_work} | {stage: aux_work[stage] for stage in AUX_STAGES[vr]}
    minimum = dict.fromkeys(roles, 1) | {PRIMARY_ROLE[vr]: primary_min}
    if budget < sum(minimum.values()):
        return {PRIMARY_ROLE[vr]: budget}
    weights = {role: max(work, 1e-9) for role, work in roles.items()}
    return _apportion(budget, weights, minimum)


def _align_primaries(counts: Counter[str], block: int) -> None:
    """PackPerMachine step 1: round each D-carrying primary up to a multiple of ``block`` by borrowing
    from the auxiliaries, never taking an auxiliary below one GPU."""
    for role in ("EDC", "ED", "DC", "D"):
        have = counts[role]
        if have == 0 or have % block == 0:
            continue
        need = block - have % block
        spare = sum(max(0, counts[a] - 1) for a in ("E", "C"))
        if spare < need:
            continue
        for _ in range(need):
            donor = max(("E", "C"), key=lambda a: counts[a])
            counts[donor] -= 1
            counts[role] += 1


def pack_per_machine(counts: Counter[str], gpus_per_machine: int) -> tuple[str, ...]:
    """PackPerMachine step 2: whole machines of one role first, then first-fit of the remainders
    preferring machines that already host the same role."""
    total = sum(counts.values())
    machines = math.ceil(total / gpus_per_machine)
    slots: list[list[str]] = [[] for _ in range(machines)]
    capacity = [min(gpus_per_machine, total - m * gpus_per_machine) for m in range(machines)]
    remainders: list[tuple[str, int]] = []
    free_machine = 0
    for role in ROLES:
        whole, rest = divmod(counts[role], gpus_per_machine)
        for _ in range(whole):
            while free_machine < machines and (
                slots[free_machine] or capacity[free_machine] < gpus_per_machine
            ):
                free_machine += 1
            if free_machine == machines:
                rest += gpus_per_machine
                continue
            slots[free_machine] = [role] * gpus_per_machine
        if rest:
            remainders.append((role, rest))
    for role, rest in sorted(remainders, key=lambda item: -item[1]):
        for _ in range(rest):
            open_machines = [m for m in range(machines) if len(slots[m]) < capacity[m]]
            same = [m for m in open_machines if role in slots[m]]
            target = (same or open_machines)[0]
            slots[target].append(role)
    return tuple(role for machine in slots for role in machine)


def plan_placement(
    pipeline: PipelineProfile,
    shapes: Sequence[Shape],
    gpus: int,
    gpu: GpuSpec,
    *,
    stage_level: bool = True,
    encode_only_s: float = 0.0,
    stream_shapes: Sequence[Shape] = (),
) -> Placement:
    """Alg. 2: a placement for ``gpus`` GPUs from the recent request mix ``shapes``.

    ``stream_shapes``: requests that must run where D and C share a GPU (a stream's chunks: its
    causal decoder's cache lives next to its diffusion model), i.e. only on the ``STREAM_TYPES``
    (V0, V2); they weigh in every step like ``shapes`` but never create a D, ED or C GPU. Empty (the
    default), the plan is Alg. 2 unchanged.

    ``encode_only_s``: GPU-seconds of encode-only work in the same window (streams' prompt encodes):
    it gets encoder GPUs of its own in proportion (at least one), the shared encoder pool, so a
    session's prompt never queues behind a diffusion run.

    With ``stage_level=False`` (the wo-stageAware ablation) encode and decode are sized at the
    diffuse degree, as a pipeline-level system runs them."""
    if gpus < 1:
        raise PlacementError("a placement needs at least one GPU")
    if not shapes and not stream_shapes:
        shapes = [Shape(64, 64, 1, 1)]
    for shape in stream_shapes:
        if not stream_fits(pipeline, shape, gpu):
            raise PlacementError(f"{pipeline.name} {shape} does not fit a {gpu.name} with D and C together")
    pool = 0
    if encode_only_s > 0 and gpus > 1:
        job_work = sum(
            sum(_work(pipeline, s, gpu, preferred_type(pipeline, s, gpu), stage_level)) for s in shapes
        ) + sum(
            sum(_work(pipeline, s, gpu, _preferred_stream_type(pipeline, s, gpu), False))
            for s in stream_shapes
        )
        # At least one GPU for the pool and at least one left for the diffusion model.
        pool = min(gpus - 1, max(1, round(gpus * encode_only_s / (job_work + encode_only_s))))
    gpus -= pool
    allowed = list(VR_TYPES)
    while True:
        preferred = _group_all(pipeline, shapes, stream_shapes, gpu, allowed, stage_level)
        # Lines 5-6: GPUs per type in proportion to the work of the requests preferring it.
        work = {
            vr: [_work(pipeline, s, gpu, vr, level) for s, level in group] for vr, group in preferred.items()
        }
        type_weight = {vr: sum(sum(w) for w in items) for vr, items in work.items()}
        primary_min = {vr: _min_degree(pipeline, group, gpu, vr) for vr, group in preferred.items()}
        minimum = {vr: primary_min[vr] + len(AUX_STAGES[vr]) for vr in preferred}
        if sum(minimum.values()) <= gpus:
            break
        # A type whose replicas cannot even host one of its runs is useless: fold the type with the
        # least work into the next feasible types of its requests, while that leaves every request a type.
        foldable = [
            vr
            for vr in sorted(type_weight, key=type_weight.get)
            if _group_all(
                pipeline,
                shapes,
                stream_shapes,
                gpu,
                [t for t in allowed if t != vr],
                stage_level,
                strict=False,
            )
        ]
        if not foldable:
            minimum, primary_min = {}, dict.fromkeys(preferred, 1)
            break
        allowed.remove(foldable[0])
    budgets = _apportion(gpus, type_weight, minimum)
    counts: Counter[str] = Counter()
    for vr, budget in budgets.items():
        primary = sum(w[0] for w in work[vr])
        aux = {"E": sum(w[1] for w in work[vr]), "C": sum(w[2] for w in work[vr])}
        for role, n in split_type(vr, budget, primary, aux, primary_min[vr]).items():
            counts[role] += n
    _align_primaries(counts, max(DEGREES))
    counts["E"] += pool
    return Placement(pack_per_machine(counts, gpu.gpus_per_machine), gpu.gpus_per_machine)


def stream_fits(pipeline: PipelineProfile, shape: Shape, gpu: GpuSpec) -> bool:
    """Whether ``shape`` can run with D and C on one GPU (a type of ``STREAM_TYPES``). A stream's
    decode runs where its diffusion does, at the diffuse degree (``stage_level=False`` options)."""
    return any(request_options(pipeline, shape, gpu, vr, False) for vr in STREAM_TYPES)


def _preferred_stream_type(pipeline: PipelineProfile, shape: Shape, gpu: GpuSpec) -> str:
    return next(vr for vr in STREAM_TYPES if request_options(pipeline, shape, gpu, vr, False))


def _group_all(
    pipeline: PipelineProfile,
    shapes: Sequence[Shape],
    stream_shapes: Sequence[Shape],
    gpu: GpuSpec,
    allowed: Sequence[str],
    stage_level: bool,
    strict: bool = True,
) -> dict[str, list[tuple[Shape, bool]]]:
    """`_group` of the jobs among ``allowed`` and of the streams among ``allowed`` ∩ ``STREAM_TYPES``
    (their decode at the diffuse degree), each request with the ``stage_level`` its work is sized at;
    with ``strict=False`` an empty result says some request has no type."""
    jobs = _group(pipeline, shapes, gpu, allowed, strict) if shapes else {}
    if shapes and not jobs:
        return {}
    groups = {vr: [(s, stage_level) for s in group] for vr, group in jobs.items()}
    if not stream_shapes:
        return groups
    stream_allowed = [t for t in allowed if t in STREAM_TYPES]
    streams = _group(pipeline, stream_shapes, gpu, stream_allowed, strict=False, stage_level=False)
    if not streams:
        if strict:
            raise PlacementError("a stream request has no type with D and C together left")
        return {}
    for vr, group in streams.items():
        groups.setdefault(vr, []).extend((s, False) for s in group)
    return groups


def _group(
    pipeline: PipelineProfile,
    shapes: Sequence[Shape],
    gpu: GpuSpec,
    allowed: Sequence[str],
    strict: bool = True,
    stage_level: bool = True,
) -> dict[str, list[Shape]]:
    """Each request under its first feasible type among ``allowed`` (Alg. 2 lines 3-4); with
    ``strict=False`` an empty result says some request has none."""
    groups: dict[str, list[Shape]] = {}
    for shape in shapes:
        vr = next((t for t in allowed if request_options(pipeline, shape, gpu, t, stage_level)), None)
        if vr is None:
            if strict:
                preferred_type(pipeline, shape, gpu)  # raises with the reason
            return {}
        groups.setdefault(vr, []).append(shape)
    return groups


def _min_degree(
    pipeline: PipelineProfile, requests: Sequence[tuple[Shape, bool]], gpu: GpuSpec, vr: str
) -> int:
    """Primaries a type needs to run every one of its requests (shape, stage_level) at their smallest
    offered degree."""
    return max(min(o.degree for o in request_options(pipeline, s, gpu, vr, level)) for s, level in requests)


class ReplacementTrigger:
    """§5.3: re-place when the fastest stage's throughput over a sliding window is at least
    ``threshold`` times the slowest's.

    The paper's threshold value was lost in extraction; ours is a parameter (default 1.5). Nothing
    fires without a backlog, within one window of the last re-placement, or before the fastest stage
    completed ``min_ops`` ops in the window: stage completions are close to Poisson counts, whose
    relative noise is 1/√n, so a 1.5x skew means something only from about 25 ops on (with 8, a
    steady video workload re-placed a dozen times in 30 min on noise alone). One addition: a pending request whose preferred type has no
    replica (``unserved``) fires too — a mix that needs a type the plan lacks leaves E, D and C
    equally slow, so the stages' skew never shows it. (Counting arrivals as a stage 0 caught that
    as well, but on noise: it re-placed 16 times in 30 min of a steady workload.)
    """

    def __init__(self, window_s: float, threshold: float = 1.5, min_ops: int = 25):
        if window_s <= 0 or threshold <= 1 or min_ops < 1:
            raise PlacementError("the trigger needs window_s > 0, threshold > 1 and min_ops >= 1")
        self.window_s = window_s
        self.threshold = threshold
        self.min_ops = min_ops
        self._events: deque[tuple[float, str]] = deque()
        self._last_fire = -math.inf

    def record(self, t: float, stage: str) -> None:
        """One op of ``stage`` (E, D or C) completed at ``t``."""
        self._events.append((t, stage))

    def throughputs(self, now: float) -> dict[str, float]:
        while self._events and self._events[0][0] < now - self.window_s:
            self._events.popleft()
        counts = Counter(stage for _, stage in self._events)
        return {stage: counts.get(stage, 0) / self.window_s for stage in ("E", "D", "C")}

    def state_dict(self) -> dict:
        """What must survive between two live scheduler runs (the ops are re-read from the database)."""
        return {"last_fire": None if self._last_fire == -math.inf else self._last_fire}

    def load_state_dict(self, state: dict) -> None:
        last = state.get("last_fire")
        self._last_fire = -math.inf if last is None else float(last)

    def should_replace(self, now: float, backlog: int, unserved: bool = False) -> bool:
        if backlog == 0 or now - self._last_fire < self.window_s:
            return False
        if not unserved:
            rates = self.throughputs(now)
            fastest, slowest = max(rates.values()), min(rates.values())
            if fastest * self.window_s < self.min_ops or fastest < self.threshold * max(slowest, 1e-12):
                return False
        self._last_fire = now
        return True


def role_changes(
    current: dict[str, str], target: Sequence[str], busy: frozenset[str] | set[str] = frozenset()
) -> list[tuple[str, str, str]]:
    """Which live workers change role so that the pool's roles become the multiset ``target``.

    ``current``: worker → role; ``busy``: workers holding sessions or jobs. A live pool has no fixed
    machine layout, so only the role counts of the plan matter. Fewest changes: a worker keeps its
    role while the plan still has a slot of that role, busy workers first (their residents need D).
    Roles without the diffusion model (E, C) go to idle workers first, since a worker with residents
    refuses to drop a stage they need. Returns ``(worker, from, to)`` in the order to apply them, one
    at a time: to the auxiliary roles first (an encoder is up before a worker drops its own), then
    idle workers (nothing waits on them), then by name.
    """
    if len(target) != len(current):
        raise PlacementError(f"a plan of {len(target)} roles for {len(current)} workers")
    slots = Counter(target)
    order = sorted(current, key=lambda w: (w not in busy, w))
    keep: dict[str, str] = {}
    for worker in order:
        if slots[current[worker]] > 0:
            slots[current[worker]] -= 1
            keep[worker] = current[worker]
    moving = [w for w in order if w not in keep]
    left = sorted(slots.elements(), key=lambda role: ("D" in role, role))
    idle_first = sorted(moving, key=lambda w: (w in busy, w))
    changes = [(worker, current[worker], role) for worker, role in zip(idle_first, left, strict=True)]
    return sorted(changes, key=lambda change: ("D" in change[2], change[0] in busy, change[0]))
