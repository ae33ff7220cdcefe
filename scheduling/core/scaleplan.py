"""The scale planner: how a model's weights reach new GPUs (BlitzScale §5.1, Fig. 11).

Given where the weights already are (``sources``: serving GPUs, host-memory caches, local disks),
the GPUs that must load them (``targets``) and a model of the network (:class:`Topology`),
:func:`plan_scale_out` builds multicast chains ``S → T1 → T2 → …``. In a chain each receiver
forwards block *i* while it receives block *i + 1*, so the whole chain finishes in about the time of
its slowest hop, whatever the number of receivers (§5.1, Fig. 13 a):

    ready(T_k) = bytes / B_k + (k − 1) · bytes / (L · B_k) + k · hop_latency

with ``B_k`` the slowest link from the source to ``T_k`` (the chain's bottleneck so far) and ``L``
the number of blocks the weights are streamed in (the pipeline fills in k − 1 blocks).

The network model is BlitzScale's scale-up/scale-out hybrid (§5.1, Fig. 10 a): GPUs of one host
talk over NVLink (or PCIe without it); every GPU and every host cache has its own NIC into a leaf
switch; endpoints under one leaf (one ``domain``) have full bisection at the NIC speed; crossing
leaves goes through the spine at the NIC speed divided by its oversubscription. A local disk feeds
only the GPUs of its own host. Every link is full duplex (RDMA is bi-directional, §5.1), so what
must never happen is two flows in the same direction of one endpoint's link: in a plan every
endpoint sends at most once and receives at most once, and links already carrying session
migrations (``Topology.busy``) are charged a share of their bandwidth so the planner routes around
them when it can (§5.1, "prune the sources to avoid interference").

The greedy (§5.1, lines 3–10 of Fig. 11) repeatedly takes, among every free sender (an unused
source, or the last receiver of a chain) and every target still waiting, the pair whose target is
ready earliest, and appends it. A receiver then becomes a sender, so chains grow from the fastest
sources and links to the slowest: along a chain the bottleneck never rises and ready times never
fall. Disk is the last resort: a target's own host disk is always a candidate source, chosen only
when no pool copy reaches the target sooner (it loses ties). With a heap and per-host and
per-domain indexes of waiting targets a plan for 64 GPUs takes well under a millisecond.

Units: bandwidths are GB/s (10⁹ bytes per second), the unit of ``link_gbps`` in the GPU profiles;
times are seconds. Pure Python: no Django (docs/scheduling.md, the core's purity contract).
"""

from __future__ import annotations

import heapq
import itertools
import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from types import MappingProxyType
from typing import Any

GB = 1_000_000_000

ENDPOINT_KINDS = ("gpu", "host_cache", "disk")
# The JSON ``fallback``: where a receiver goes when its chain fails (the worker's own safetensors).
FALLBACK = "disk"


class ScalePlanError(ValueError):
    """Bad planner input; the message names the field."""


@dataclass(frozen=True)
class Endpoint:
    """A place weights can come from or go to.

    ``host`` is the machine, ``domain`` the scale-out domain it hangs off (leaf switch / rail);
    ``kind`` is ``gpu`` (a serving or new worker's GPU memory), ``host_cache`` (a pinned host-memory
    copy served by the host-cache process) or ``disk`` (the host's local safetensors).
    """

    id: str
    host: str
    domain: str
    kind: str = "gpu"

    def __post_init__(self) -> None:
        if not self.id:
            raise ScalePlanError("endpoint id must be non-empty")
        if not self.host:
            raise ScalePlanError(f"endpoint {self.id!r}: host must be non-empty")
        if self.kind not in ENDPOINT_KINDS:
            raise ScalePlanError(
                f"endpoint {self.id!r}: kind must be one of {', '.join(ENDPOINT_KINDS)}, got {self.kind!r}"
            )


def disk_endpoint(host: str, domain: str) -> Endpoint:
    """The local-storage source of ``host`` (what the planner adds for every target's host)."""
    return Endpoint(id=f"disk@{host}", host=host, domain=domain, kind="disk")


@dataclass(frozen=True)
class Topology:
    """Link bandwidths (GB/s) by where two endpoints sit, and the links busy with migrations.

    * same host, GPU↔GPU: ``nvlink_gbps`` (``None``: no NVLink, peer-to-peer over ``pcie_gbps``);
    * same host, host cache → GPU: ``pcie_gbps``;
    * same ``domain`` (leaf switch), different hosts: ``rdma_gbps`` (one NIC per GPU / host cache);
    * different domains: ``rdma_gbps / spine_oversubscription``;
    * disk → a GPU of its own host: ``nvme_gbps`` (no other host can read it).

    ``busy`` holds directed ``(sender_id, receiver_id)`` pairs carrying session migrations: the
    sender's outbound and the receiver's inbound direction are taken, and a planned flow that
    needs either gets ``busy_share`` of its bandwidth. ``hop_latency_s`` is the fixed cost of one
    hop (a pooled connection's first block, the receiver's set-up); ``pipeline_blocks`` is how many
    blocks the weights stream in (the chain's pipeline fill).
    """

    rdma_gbps: float
    nvlink_gbps: float | None = None
    pcie_gbps: float = 25.0
    nvme_gbps: float = 3.0
    spine_oversubscription: float = 1.0
    hop_latency_s: float = 0.01
    pipeline_blocks: int = 32
    busy: frozenset[tuple[str, str]] = frozenset()
    busy_share: float = 0.5
    source: str = ""

    def __post_init__(self) -> None:
        for name in ("rdma_gbps", "pcie_gbps", "nvme_gbps"):
            value = getattr(self, name)
            if not (isinstance(value, int | float) and math.isfinite(value) and value > 0):
                raise ScalePlanError(f"topology.{name} must be a positive number, got {value!r}")
        if self.nvlink_gbps is not None and not (math.isfinite(self.nvlink_gbps) and self.nvlink_gbps > 0):
            raise ScalePlanError(f"topology.nvlink_gbps must be positive or None, got {self.nvlink_gbps!r}")
        if not self.spine_oversubscription >= 1.0:
            raise ScalePlanError("topology.spine_oversubscription must be >= 1")
        if not self.hop_latency_s >= 0:
            raise ScalePlanError("topology.hop_latency_s must be >= 0")
        if not (isinstance(self.pipeline_blocks, int) and self.pipeline_blocks >= 1):
            raise ScalePlanError("topology.pipeline_blocks must be an integer >= 1")
        if not 0.0 < self.busy_share <= 1.0:
            raise ScalePlanError("topology.busy_share must be in (0, 1]")
        busy = frozenset(self.busy)
        for pair in busy:
            if not (isinstance(pair, tuple) and len(pair) == 2 and all(isinstance(x, str) for x in pair)):
                raise ScalePlanError(f"topology.busy entries must be (sender_id, receiver_id), got {pair!r}")
        object.__setattr__(self, "busy", busy)
        object.__setattr__(self, "_busy_out", frozenset(a for a, _ in busy))
        object.__setattr__(self, "_busy_in", frozenset(b for _, b in busy))

    # --- constructors for the simple cases ----------------------------------------------------

    @classmethod
    def flat(cls, gbps: float, **kwargs: Any) -> Topology:
        """Every pair of hosts at ``gbps`` (one leaf, no NVLink); e.g. paced loopback links."""
        return cls(rdma_gbps=gbps, **kwargs)

    @classmethod
    def cluster(
        cls,
        *,
        nvlink_gbps: float | None,
        rdma_gbps: float,
        pcie_gbps: float = 25.0,
        nvme_gbps: float = 3.0,
        spine_oversubscription: float = 1.0,
        **kwargs: Any,
    ) -> Topology:
        """An NVLink-host, leaf-spine cluster (BlitzScale's testbed shape)."""
        return cls(
            rdma_gbps=rdma_gbps,
            nvlink_gbps=nvlink_gbps,
            pcie_gbps=pcie_gbps,
            nvme_gbps=nvme_gbps,
            spine_oversubscription=spine_oversubscription,
            **kwargs,
        )

    def with_busy(self, busy: Iterable[tuple[str, str]]) -> Topology:
        """This topology with ``busy`` as the links carrying migrations."""
        return replace(self, busy=frozenset(busy))

    # --- the model ----------------------------------------------------------------------------

    def link_gbps(self, sender: Endpoint, receiver: Endpoint) -> float | None:
        """Raw bandwidth of one flow ``sender → receiver`` (``None``: no path), busy links ignored."""
        if receiver.kind != "gpu":
            return None
        if sender.kind == "disk":
            return self.nvme_gbps if sender.host == receiver.host else None
        if sender.host == receiver.host:
            if sender.kind == "host_cache" or self.nvlink_gbps is None:
                return self.pcie_gbps
            return self.nvlink_gbps
        if sender.domain == receiver.domain:
            return self.rdma_gbps
        return self.rdma_gbps / self.spine_oversubscription

    def flow_gbps(self, sender: Endpoint, receiver: Endpoint) -> float | None:
        """Bandwidth a planned flow gets: the raw link, charged ``busy_share`` per busy direction."""
        raw = self.link_gbps(sender, receiver)
        if raw is None:
            return None
        if sender.id in self._busy_out:  # type: ignore[attr-defined]
            raw *= self.busy_share
        if receiver.id in self._busy_in:  # type: ignore[attr-defined]
            raw *= self.busy_share
        return raw

    def ready_s(self, weights_bytes: int, bottleneck_gbps: float, depth: int) -> float:
        """When the ``depth``-th receiver of a chain whose bottleneck so far is ``bottleneck_gbps``
        holds every block (the module docstring's formula)."""
        full = weights_bytes / (bottleneck_gbps * GB)
        return full + (depth - 1) * full / self.pipeline_blocks + depth * self.hop_latency_s

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "rdma_gbps": self.rdma_gbps,
            "nvlink_gbps": self.nvlink_gbps,
            "pcie_gbps": self.pcie_gbps,
            "nvme_gbps": self.nvme_gbps,
            "spine_oversubscription": self.spine_oversubscription,
            "hop_latency_s": self.hop_latency_s,
            "pipeline_blocks": self.pipeline_blocks,
            "busy": sorted([a, b] for a, b in self.busy),
            "busy_share": self.busy_share,
        }
        if self.source:
            out["source"] = self.source
        return out

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> Topology:
        if not isinstance(data, Mapping):
            raise ScalePlanError("topology must be a JSON object")
        known = {
            "rdma_gbps",
            "nvlink_gbps",
            "pcie_gbps",
            "nvme_gbps",
            "spine_oversubscription",
            "hop_latency_s",
            "pipeline_blocks",
            "busy",
            "busy_share",
            "source",
        }
        unknown = sorted(set(data) - known)
        if unknown:
            raise ScalePlanError(f"topology has unknown field(s) {', '.join(unknown)}")
        if "rdma_gbps" not in data:
            raise ScalePlanError("topology is missing rdma_gbps")
        kwargs = dict(data)
        kwargs["busy"] = frozenset(tuple(pair) for pair in data.get("busy", ()))
        try:
            return cls(**kwargs)
        except TypeError as exc:
            raise ScalePlanError(f"topology: {exc}") from exc


@dataclass(frozen=True)
class Chain:
    """``source → targets[0] → targets[1] → …``, pipelined.

    ``gbps`` is the chain's bottleneck (its slowest flow, GB/s), ``expected_seconds`` when its last
    receiver holds every block, ``ready_s[i]`` when ``targets[i]`` does. ``source_kind`` says what
    the source is (a receiver of a ``disk`` chain reads its own host's storage first).
    """

    source: str
    targets: tuple[str, ...]
    gbps: float
    expected_seconds: float
    source_kind: str = "gpu"
    ready_s: tuple[float, ...] = ()

    def __post_init__(self) -> None:
        object.__setattr__(self, "targets", tuple(self.targets))
        if not self.targets:
            raise ScalePlanError(f"chain from {self.source!r} has no targets")
        if self.source_kind not in ENDPOINT_KINDS:
            raise ScalePlanError(f"chain from {self.source!r}: unknown source_kind {self.source_kind!r}")
        ready = tuple(float(x) for x in self.ready_s) or (float(self.expected_seconds),) * len(self.targets)
        if len(ready) != len(self.targets):
            raise ScalePlanError(f"chain from {self.source!r}: ready_s must give one time per target")
        object.__setattr__(self, "ready_s", ready)

    @property
    def hops(self) -> tuple[tuple[str, str], ...]:
        """The directed flows of the chain, in order."""
        nodes = (self.source, *self.targets)
        return tuple(itertools.pairwise(nodes))

    def to_json(self) -> dict[str, Any]:
        return {
            "source": self.source,
            "source_kind": self.source_kind,
            "targets": list(self.targets),
            "gbps": self.gbps,
            "expected_seconds": self.expected_seconds,
            "ready_s": list(self.ready_s),
        }


@dataclass(frozen=True)
class ScalePlan:
    """The chains, fastest first, and when each target is expected to hold the weights."""

    chains: tuple[Chain, ...]
    weights_bytes: int = 0
    fallback: str = FALLBACK
    # Derived from the chains: target id → seconds until it holds every block.
    expected_ready_s: Mapping[str, float] = field(init=False, compare=False, hash=False, repr=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "chains", tuple(self.chains))
        ready: dict[str, float] = {}
        for chain in self.chains:
            for target, t in zip(chain.targets, chain.ready_s, strict=True):
                if target in ready:
                    raise ScalePlanError(f"target {target!r} appears in more than one chain")
                ready[target] = t
        object.__setattr__(self, "expected_ready_s", MappingProxyType(ready))

    @property
    def targets(self) -> tuple[str, ...]:
        return tuple(t for chain in self.chains for t in chain.targets)

    @property
    def expected_seconds(self) -> float:
        """When the last target is ready (0 for an empty plan)."""
        return max((c.expected_seconds for c in self.chains), default=0.0)

    def chain_of(self, target: str) -> Chain:
        for chain in self.chains:
            if target in chain.targets:
                return chain
        raise KeyError(target)

    def upstream_of(self, target: str) -> str:
        """Who sends the weights to ``target`` (the previous node of its chain)."""
        chain = self.chain_of(target)
        i = chain.targets.index(target)
        return chain.source if i == 0 else chain.targets[i - 1]

    def to_json(self) -> dict[str, Any]:
        return {
            "chains": [c.to_json() for c in self.chains],
            "fallback": self.fallback,
            "weights_bytes": self.weights_bytes,
            "expected_seconds": self.expected_seconds,
        }

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> ScalePlan:
        if not isinstance(data, Mapping) or not isinstance(data.get("chains"), list):
            raise ScalePlanError("scale plan must be a JSON object with a 'chains' list")
        chains = []
        for i, raw in enumerate(data["chains"]):
            if not isinstance(raw, Mapping):
                raise ScalePlanError(f"chains[{i}] must be an object")
            missing = [k for k in ("source", "targets", "gbps", "expected_seconds") if k not in raw]
            if missing:
                raise ScalePlanError(f"chains[{i}] is missing {', '.join(missing)}")
            chains.append(
                Chain(
                    source=str(raw["source"]),
                    targets=tuple(str(t) for t in raw["targets"]),
                    gbps=float(raw["gbps"]),
                    expected_seconds=float(raw["expected_seconds"]),
                    source_kind=str(raw.get("source_kind", "gpu")),
                    ready_s=tuple(float(x) for x in raw.get("ready_s", ())),
                )
            )
        return cls(
            chains=tuple(chains),
            weights_bytes=int(data.get("weights_bytes", 0)),
            fallback=str(data.get("fallback", FALLBACK)),
        )


# --- the greedy -----------------------------------------------------------------------------------

_KIND_RANK = {"gpu": 0, "host_cache": 1, "disk": 2}  # ties: GPU copies first, disk last (§5.3)


class _Waiting:
    """Targets still waiting, indexed by host and by domain; each index keeps id order.

    Dicts keep insertion order, so the first key of each is the smallest id still waiting and a
    removal is O(1). Split by whether the target's inbound direction is busy: a busy one is slower
    from every sender, so each index's best candidate is the first non-busy one, else the first
    busy one.
    """

    def __init__(self, targets: Sequence[Endpoint], busy_in: frozenset[str]) -> None:
        self.by_host: dict[tuple[bool, str], dict[str, Endpoint]] = {}
        self.by_domain: dict[tuple[bool, str], dict[str, Endpoint]] = {}
        self.everywhere: dict[bool, dict[str, Endpoint]] = {False: {}, True: {}}
        for t in sorted(targets, key=lambda e: e.id):
            busy = t.id in busy_in
            self.by_host.setdefault((busy, t.host), {})[t.id] = t
            self.by_domain.setdefault((busy, t.domain), {})[t.id] = t
            self.everywhere[busy][t.id] = t
        self.count = len(targets)

    def remove(self, t: Endpoint, busy: bool) -> None:
        del self.by_host[(busy, t.host)][t.id]
        del self.by_domain[(busy, t.domain)][t.id]
        del self.everywhere[busy][t.id]
        self.count -= 1

    def candidates(self, sender: Endpoint) -> Iterable[Endpoint]:
        """A few targets among which the best one for ``sender`` always is (see module docstring)."""
        for busy in (False, True):
            same_host = self.by_host.get((busy, sender.host))
            if same_host:
                yield next(iter(same_host.values()))
            if sender.kind == "disk":
                continue
            same_domain = self.by_domain.get((busy, sender.domain))
            if same_domain:
                yield next(iter(same_domain.values()))
            anywhere = self.everywhere[busy]
            if anywhere:
                yield next(iter(anywhere.values()))


@dataclass
class _Sender:
    endpoint: Endpoint
    root: int  # index of the chain this sender would extend (or start)
    upstream_gbps: float  # the chain's bottleneck so far (inf for a source)
    depth: int  # receivers already in the chain up to and including this sender


def _check_inputs(sources: Sequence[Endpoint], targets: Sequence[Endpoint], weights_bytes: int) -> None:
    if not isinstance(weights_bytes, int) or isinstance(weights_bytes, bool) or weights_bytes <= 0:
        raise ScalePlanError(f"weights_bytes must be a positive integer, got {weights_bytes!r}")
    seen: set[str] = set()
    for role, group in (("sources", sources), ("targets", targets)):
        for e in group:
            if not isinstance(e, Endpoint):
                raise ScalePlanError(f"{role} must be Endpoint objects, got {e!r}")
            if e.id in seen:
                raise ScalePlanError(f"endpoint id {e.id!r} is given twice (sources and targets must differ)")
            seen.add(e.id)
    for t in targets:
        if t.kind != "gpu":
            raise ScalePlanError(f"target {t.id!r} must be a gpu endpoint, got kind {t.kind!r}")


def plan_scale_out(
    *,
    sources: Sequence[Endpoint],
    targets: Sequence[Endpoint],
    topology: Topology,
    weights_bytes: int,
) -> ScalePlan:
    """Multicast chains that bring ``weights_bytes`` from ``sources`` to every target.

    Every target appears in exactly one chain; every endpoint sends at most once and receives at
    most once (no two planned flows in one direction of a link); each target's host disk is an
    implicit last-resort source. Deterministic: the same inputs give the same plan.
    """
    _check_inputs(sources, targets, weights_bytes)
    if not isinstance(topology, Topology):
        raise ScalePlanError("topology must be a Topology")
    if not targets:
        return ScalePlan(chains=(), weights_bytes=weights_bytes)

    all_sources = list(sources)
    have_disk = {e.host for e in sources if e.kind == "disk"}
    for t in sorted(targets, key=lambda e: e.id):
        if t.host not in have_disk:
            all_sources.append(disk_endpoint(t.host, t.domain))
            have_disk.add(t.host)
    # Sources in a fixed order (kind, id) so ties resolve the same way every time.
    all_sources.sort(key=lambda e: (_KIND_RANK[e.kind], e.id))

    busy_in: frozenset[str] = topology._busy_in  # type: ignore[attr-defined]
    waiting = _Waiting(targets, busy_in)
    senders: list[_Sender] = [_Sender(e, i, math.inf, 0) for i, e in enumerate(all_sources)]
    chains: list[list[tuple[Endpoint, float, float]]] = [[] for _ in all_sources]  # (target, gbps, ready)

    def best(sender_index: int) -> tuple[float, int, str, Endpoint, float] | None:
        s = senders[sender_index]
        found: tuple[float, int, str, Endpoint, float] | None = None
        for t in waiting.candidates(s.endpoint):
            gbps = topology.flow_gbps(s.endpoint, t)
            if gbps is None:
                continue
            gbps = min(gbps, s.upstream_gbps)
            ready = topology.ready_s(weights_bytes, gbps, s.depth + 1)
            key = (ready, _KIND_RANK[all_sources[s.root].kind], t.id, t, gbps)
            if found is None or key[:3] < found[:3]:
                found = key
        return found

    # Heap of (ready, kind rank of the chain's source, target id, sender index): lazy — an entry is
    # re-checked when popped, since its target may have been taken by a faster sender meanwhile.
    # A sender's best option only gets worse as targets are taken, so a re-check that still agrees
    # is the global best.
    heap: list[tuple[float, int, str, int]] = []

    def push(sender_index: int) -> None:
        option = best(sender_index)
        if option is not None:
            heapq.heappush(heap, (option[0], option[1], option[2], sender_index))

    for i in range(len(senders)):
        push(i)
    while waiting.count and heap:
        ready, rank, target_id, i = heapq.heappop(heap)
        option = best(i)
        if option is None:
            continue
        if option[:3] != (ready, rank, target_id):
            heapq.heappush(heap, (option[0], option[1], option[2], i))
            continue
        _, _, _, target, gbps = option
        waiting.remove(target, target.id in busy_in)
        s = senders[i]
        chains[s.root].append((target, gbps, ready))
        # The sender's outbound direction is now taken; the receiver becomes the chain's tail.
        senders.append(_Sender(target, s.root, gbps, s.depth + 1))
        push(len(senders) - 1)
    if waiting.count:  # pragma: no cover - every target's own disk is a candidate
        raise ScalePlanError("some targets have no source")

    built = []
    for root, members in enumerate(chains):
        if not members:
            continue
        src = all_sources[root]
        built.append(
            Chain(
                source=src.id,
                source_kind=src.kind,
                targets=tuple(t.id for t, _, _ in members),
                gbps=members[-1][1],
                expected_seconds=members[-1][2],
                ready_s=tuple(r for _, _, r in members),
            )
        )
    built.sort(key=lambda c: (-c.gbps, c.ready_s[0], c.source))
    return ScalePlan(chains=tuple(built), weights_bytes=weights_bytes)


# --- helpers for simple clusters (benchmarks, the simulator, tests) -------------------------------


def cluster_endpoints(
    *, hosts: int, gpus_per_host: int, hosts_per_domain: int = 1, prefix: str = "h"
) -> list[list[Endpoint]]:
    """GPU endpoints of ``hosts`` hosts, grouped per host: ids ``h<host>g<gpu>``, domains ``d<n>``."""
    if hosts < 1 or gpus_per_host < 1 or hosts_per_domain < 1:
        raise ScalePlanError("hosts, gpus_per_host and hosts_per_domain must be >= 1")
    return [
        [
            Endpoint(id=f"{prefix}{h}g{g}", host=f"{prefix}{h}", domain=f"d{h // hosts_per_domain}")
            for g in range(gpus_per_host)
        ]
        for h in range(hosts)
    ]


def host_cache_endpoint(host: str, domain: str) -> Endpoint:
    return Endpoint(id=f"cache@{host}", host=host, domain=domain, kind="host_cache")
