"""Region topologies: GPU pools in several regions, user origins, and the RTT between them.

The JSON format (``docs/regions.md``)::

    {
      "name": "two-coasts",
      "rtt_budget_ms": 60,                       # a session's RTT must stay within it
      "gpu_types": {"H100": {"sessions_per_gpu": 4, "usd_per_hour": 2.5}},   # optional, else built-in
      "regions": [{"name": "east", "price_multiplier": 1.0, "gpus": {"H100": 8}}, ...],
      "origins": [{"name": "nyc", "weight": 1.0, "utc_offset_h": -5}, ...],
      "rtt_ms": [[2, 70], [70, 2]],              # origins × regions
      "transfer_usd_per_gb": 0.02                # optional WAN egress price
    }

Every validation error names the offending field (``regions[2].gpus.H100: ...``). The four built-in
topologies are synthesised from TORTA's Table 1.a (node count and latency scale) with networkx; how
is written in :func:`builtin_topology` and ``docs/regions.md``.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np


class TopologyError(ValueError):
    """A malformed topology; ``field`` is the JSON path of the offending value."""

    def __init__(self, field_path: str, message: str):
        super().__init__(f"{field_path}: {message}")
        self.field = field_path


@dataclass(frozen=True)
class GpuType:
    name: str
    sessions_per_gpu: float  # load units one GPU serves at the chunk SLO (C in TORTA Eq. 6)
    usd_per_hour: float


# TORTA Table 1.b's GPU mix. Capacities are our assumption for a ~1.3B streaming model (an H100 holds
# four sessions at the chunk SLO, docs/scheduling.md); prices are typical on-demand rates per hour.
DEFAULT_GPU_TYPES: dict[str, GpuType] = {
    "H100": GpuType("H100", 4.0, 2.50),
    "A100": GpuType("A100", 3.0, 1.60),
    "4090": GpuType("4090", 2.0, 0.70),
    "V100": GpuType("V100", 1.0, 0.90),
    "T4": GpuType("T4", 1.0, 0.35),
}


@dataclass(frozen=True)
class Region:
    name: str
    price_multiplier: float
    gpus: dict[str, int]  # GPU type -> capacity limit (GPUs)


@dataclass(frozen=True)
class Origin:
    name: str
    weight: float  # share of the demand (normalised by the demand generator)
    utc_offset_h: float = 0.0


@dataclass(frozen=True)
class Topology:
    name: str
    regions: tuple[Region, ...]
    origins: tuple[Origin, ...]
    rtt_ms: np.ndarray  # origins × regions
    rtt_budget_ms: float
    gpu_types: dict[str, GpuType] = field(default_factory=lambda: dict(DEFAULT_GPU_TYPES))
    transfer_usd_per_gb: float = 0.02

    @property
    def region_names(self) -> list[str]:
        return [r.name for r in self.regions]

    @property
    def origin_names(self) -> list[str]:
        return [o.name for o in self.origins]

    def allowed(self) -> np.ndarray:
        """Boolean origins × regions: the regions within each origin's RTT budget."""
        return self.rtt_ms <= self.rtt_budget_ms

    def max_capacity(self) -> np.ndarray:
        """Load units each region serves with every GPU it may hold."""
        return np.array(
            [sum(self.gpu_types[k].sessions_per_gpu * n for k, n in r.gpus.items()) for r in self.regions]
        )

    def to_json(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "rtt_budget_ms": self.rtt_budget_ms,
            "transfer_usd_per_gb": self.transfer_usd_per_gb,
            "gpu_types": {
                k: {"sessions_per_gpu": g.sessions_per_gpu, "usd_per_hour": g.usd_per_hour}
                for k, g in self.gpu_types.items()
            },
            "regions": [
                {"name": r.name, "price_multiplier": r.price_multiplier, "gpus": dict(r.gpus)}
                for r in self.regions
            ],
            "origins": [
                {"name": o.name, "weight": o.weight, "utc_offset_h": o.utc_offset_h} for o in self.origins
            ],
            "rtt_ms": [[round(float(v), 3) for v in row] for row in self.rtt_ms],
        }


# --------------------------------------------------------------------------------------------------
# Parsing and validation.


def _number(value: Any, path: str, *, minimum: float | None = None, strict: bool = False) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise TopologyError(path, f"must be a finite number, got {value!r}")
    if minimum is not None and (value <= minimum if strict else value < minimum):
        raise TopologyError(path, f"must be {'>' if strict else '>='} {minimum}, got {value!r}")
    return float(value)


def _name(value: Any, path: str) -> str:
    if not isinstance(value, str) or not value:
        raise TopologyError(path, f"must be a non-empty string, got {value!r}")
    return value


def _object(value: Any, path: str) -> dict:
    if not isinstance(value, dict):
        raise TopologyError(path, f"must be an object, got {type(value).__name__}")
    return value


def _list(value: Any, path: str) -> list:
    if not isinstance(value, list) or not value:
        raise TopologyError(path, "must be a non-empty list")
    return value


def _unknown(record: dict, allowed: set[str], path: str) -> None:
    extra = set(record) - allowed
    if extra:
        raise TopologyError(f"{path}.{sorted(extra)[0]}" if path else sorted(extra)[0], "unknown field")


def parse_topology(data: Any) -> Topology:
    """Validate a topology document; raise :class:`TopologyError` naming the first bad field."""
    data = _object(data, "topology")
    _unknown(
        data,
        {"name", "rtt_budget_ms", "gpu_types", "regions", "origins", "rtt_ms", "transfer_usd_per_gb"},
        "",
    )
    name = _name(data.get("name", "custom"), "name")
    if "rtt_budget_ms" not in data:
        raise TopologyError("rtt_budget_ms", "missing")
    budget = _number(data["rtt_budget_ms"], "rtt_budget_ms", minimum=0, strict=True)
    transfer = _number(data.get("transfer_usd_per_gb", 0.02), "transfer_usd_per_gb", minimum=0)

    gpu_types = dict(DEFAULT_GPU_TYPES)
    if "gpu_types" in data:
        gpu_types = {}
        for key, spec in _object(data["gpu_types"], "gpu_types").items():
            path = f"gpu_types.{key}"
            spec = _object(spec, path)
            _unknown(spec, {"sessions_per_gpu", "usd_per_hour"}, path)
            for required in ("sessions_per_gpu", "usd_per_hour"):
                if required not in spec:
                    raise TopologyError(f"{path}.{required}", "missing")
            gpu_types[key] = GpuType(
                key,
                _number(spec["sessions_per_gpu"], f"{path}.sessions_per_gpu", minimum=0, strict=True),
                _number(spec["usd_per_hour"], f"{path}.usd_per_hour", minimum=0),
            )
        if not gpu_types:
            raise TopologyError("gpu_types", "must name at least one GPU type")

    regions: list[Region] = []
    for i, raw in enumerate(_list(data.get("regions"), "regions")):
        path = f"regions[{i}]"
        raw = _object(raw, path)
        _unknown(raw, {"name", "price_multiplier", "gpus"}, path)
        region_name = _name(raw.get("name"), f"{path}.name")
        multiplier = _number(
            raw.get("price_multiplier", 1.0), f"{path}.price_multiplier", minimum=0, strict=True
        )
        gpus: dict[str, int] = {}
        for key, count in _object(raw.get("gpus"), f"{path}.gpus").items():
            if key not in gpu_types:
                raise TopologyError(f"{path}.gpus.{key}", f"unknown GPU type (known: {sorted(gpu_types)})")
            if isinstance(count, bool) or not isinstance(count, int) or count < 0:
                raise TopologyError(f"{path}.gpus.{key}", f"must be an integer >= 0, got {count!r}")
            gpus[key] = count
        if sum(gpus.values()) < 1:
            raise TopologyError(f"{path}.gpus", "a region must allow at least one GPU")
        regions.append(Region(region_name, multiplier, gpus))
    _unique([r.name for r in regions], "regions")

    origins: list[Origin] = []
    for i, raw in enumerate(_list(data.get("origins"), "origins")):
        path = f"origins[{i}]"
        raw = _object(raw, path)
        _unknown(raw, {"name", "weight", "utc_offset_h"}, path)
        origins.append(
            Origin(
                _name(raw.get("name"), f"{path}.name"),
                _number(raw.get("weight", 1.0), f"{path}.weight", minimum=0),
                _number(raw.get("utc_offset_h", 0.0), f"{path}.utc_offset_h"),
            )
        )
    _unique([o.name for o in origins], "origins")
    if sum(o.weight for o in origins) <= 0:
        raise TopologyError("origins", "at least one origin needs a weight > 0")

    rows = _list(data.get("rtt_ms"), "rtt_ms")
    if len(rows) != len(origins):
        raise TopologyError("rtt_ms", f"needs one row per origin ({len(origins)}), got {len(rows)}")
    matrix = np.zeros((len(origins), len(regions)))
    for i, row in enumerate(rows):
        if not isinstance(row, list) or len(row) != len(regions):
            raise TopologyError(f"rtt_ms[{i}]", f"needs one value per region ({len(regions)})")
        for j, value in enumerate(row):
            matrix[i, j] = _number(value, f"rtt_ms[{i}][{j}]", minimum=0)
    unreachable = [origins[i].name for i in range(len(origins)) if not (matrix[i] <= budget).any()]
    if unreachable:
        raise TopologyError("rtt_budget_ms", f"no region within {budget} ms of origin {unreachable[0]!r}")
    return Topology(name, tuple(regions), tuple(origins), matrix, budget, gpu_types, transfer)


def _unique(names: list[str], path: str) -> None:
    seen: set[str] = set()
    for i, n in enumerate(names):
        if n in seen:
            raise TopologyError(f"{path}[{i}].name", f"duplicate name {n!r}")
        seen.add(n)


def read_topology(path: str | Path) -> Topology:
    try:
        text = Path(path).read_text(encoding="utf-8")
    except OSError as exc:
        raise TopologyError("topology", f"cannot read {path}: {exc.strerror}") from None
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise TopologyError("topology", f"bad JSON at line {exc.lineno}: {exc.msg}") from None
    return parse_topology(data)


# --------------------------------------------------------------------------------------------------
# Built-in topologies (TORTA Table 1.a).

# name -> (nodes, latency scale ms = mean RTT between distinct nodes, width:height of the map, time-zone
# span in hours across the map's width, UTC offset of its centre). The node counts and latency scales
# are Table 1.a's; the geography (aspect, zones) is ours: Abilene and Gabriel spread over the US,
# Polska over Poland, Cost2 over Europe.
BUILTIN_SHAPES: dict[str, tuple[int, float, float, float, float]] = {
    "abilene": (12, 25.0, 2.0, 3.0, -6.5),
    "polska": (12, 45.0, 1.2, 0.0, 1.0),
    "gabriel": (25, 80.0, 2.0, 4.0, -6.0),
    "cost2": (32, 150.0, 1.5, 3.0, 1.0),
}
# Capacity limit ranges per region: Table 1.b's counts divided by ten (the paper's counts are per
# cluster; a tenth keeps a 6-hour run cheap while leaving several GPUs per region).
_GPU_LIMITS = {"A100": (4, 6), "H100": (2, 4), "4090": (4, 6), "V100": (6, 8), "T4": (4, 6)}
_INTRA_REGION_RTT_MS = 2.0
_ROUTER_HOP_MS = 0.5


def builtin_topology(name: str, seed: int = 0) -> Topology:
    """Synthesise one of TORTA's topologies (seeded, so a name and seed always give the same one).

    Nodes are placed uniformly on a ``width × 1`` map; links are a random geometric graph (radius
    0.35) united with the Euclidean minimum spanning tree, so the graph is connected and meshy like a
    backbone. A link's one-way latency is its length plus a fixed per-hop cost; RTTs are twice the
    shortest-path latency, then scaled so the mean RTT over distinct node pairs equals Table 1.a's
    latency. Every node is both a user origin and a GPU region (2 ms RTT to itself). Each region holds
    two GPU types drawn from Table 1.b with limits in its ranges / 10 and an electricity price
    multiplier uniform in [0.6, 1.6]; origins weigh lognormal(0, 0.5) and take the time zone of their
    longitude. The RTT budget is 1.5 × the latency scale.
    """
    import networkx as nx

    key = name.lower()
    if key not in BUILTIN_SHAPES:
        raise TopologyError("topology", f"unknown built-in {name!r} (known: {sorted(BUILTIN_SHAPES)})")
    nodes, scale_ms, width, tz_span, tz_centre = BUILTIN_SHAPES[key]
    rng = np.random.default_rng([seed, nodes, int(scale_ms)])
    pos = {i: (float(rng.uniform(0, width)), float(rng.uniform(0, 1))) for i in range(nodes)}
    graph = nx.random_geometric_graph(nodes, 0.35, pos=pos, seed=int(rng.integers(2**31)))
    complete = nx.Graph()
    for i in range(nodes):
        for j in range(i + 1, nodes):
            complete.add_edge(i, j, weight=math.dist(pos[i], pos[j]))
    graph.add_edges_from(nx.minimum_spanning_edges(complete, data=False))
    for u, v in graph.edges:
        graph.edges[u, v]["latency"] = math.dist(pos[u], pos[v]) + _ROUTER_HOP_MS / scale_ms
    paths = dict(nx.all_pairs_dijkstra_path_length(graph, weight="latency"))
    one_way = np.array([[paths[i][j] for j in range(nodes)] for i in range(nodes)])
    mean_pair = one_way[~np.eye(nodes, dtype=bool)].mean() * 2
    rtt = one_way * 2 * (scale_ms / mean_pair)
    np.fill_diagonal(rtt, _INTRA_REGION_RTT_MS)

    kinds = list(DEFAULT_GPU_TYPES)
    regions = []
    origins = []
    for i in range(nodes):
        chosen = rng.choice(len(kinds), size=2, replace=False)
        gpus = {}
        for c in sorted(chosen):
            lo, hi = _GPU_LIMITS[kinds[c]]
            gpus[kinds[c]] = int(rng.integers(lo, hi + 1))
        regions.append(Region(f"{key}-{i}", round(float(rng.uniform(0.6, 1.6)), 3), gpus))
        tz = tz_centre + (pos[i][0] / width - 0.5) * tz_span
        origins.append(Origin(f"{key}-{i}", round(float(rng.lognormal(0.0, 0.5)), 3), round(tz, 2)))
    return Topology(key, tuple(regions), tuple(origins), rtt, 1.5 * scale_ms)


def load_topology(spec: str, seed: int = 0) -> Topology:
    """A built-in name (``abilene``, ``polska``, ``gabriel``, ``cost2``) or a JSON file path."""
    if spec.lower() in BUILTIN_SHAPES:
        return builtin_topology(spec, seed)
    if spec.endswith(".json") or Path(spec).exists():
        return read_topology(spec)
    raise TopologyError(
        "topology", f"unknown built-in {spec!r} and no such file (known: {sorted(BUILTIN_SHAPES)})"
    )
