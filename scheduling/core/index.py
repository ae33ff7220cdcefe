"""Cluster index: what a decision needs about every GPU, kept up to date by whoever owns the state.

A decision touches a few GPUs (the event's session, the bottleneck, the least-loaded targets), but
building its working copy from a bare :class:`~scheduling.core.types.Snapshot` reads every GPU:
the per-type heaps, the pool census (GPUs per status and type, capacity) and the total load. At
10,000 GPUs that was most of a decision. The owner of the state (the simulator, the live loop)
updates this index when a GPU changes — O(log M) per change — and hands it to the policy in
``Snapshot.index``; :class:`~scheduling.core.placement.PlacementWork` and the TurboServe census then
read only what the decision touches. Without an index (a snapshot built by ``Snapshot.build``) one
is built from the snapshot, O(M log M), with the same results.

Decisions are identical with and without the index (tests/scheduling_core/test_index.py replays
traces both ways): orders are the snapshot's (``position``), and the two sums a decision takes over
all GPUs — capacity and total load — are taken exactly (integers of 2⁻²⁰ units) only when every
term is such a multiple, where a float sum in any order gives the same bits; otherwise the caller
falls back to the float sum in snapshot order.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping

from sortedcontainers import SortedList

# Loads and capacities that are whole multiples of 2⁻²⁰ (1.0, 0.5, 16, …) below 2³⁰ add exactly in
# floating point in any order; the index sums those as integers of this unit.
UNIT = 1 << 20
_LIMIT = 1 << 30
LIVE = ("ready", "provisioning")
HELD = ("ready", "provisioning", "draining")


def exact_units(value: float) -> int | None:
    """``value`` in integer units of 2⁻²⁰ if it is a whole number of them (and small), else None."""
    scaled = value * UNIT
    if abs(value) < _LIMIT and scaled.is_integer():
        return int(scaled)
    return None


class ClusterIndex:
    """Per GPU: type, status and load; per type: the ready GPUs ordered by load (ascending and
    descending, ties by id), GPUs held and live; the total load. Mutate only through
    :meth:`set_gpu` and :meth:`drop_gpu`; a policy reads it and never writes."""

    def __init__(self) -> None:
        self.position: dict[str, int] = {}
        self.gpu_type: dict[str, str] = {}
        self.status: dict[str, str] = {}
        self.load: dict[str, float] = {}
        self.ready: dict[str, None] = {}
        self.provisioning: dict[str, None] = {}
        self.draining: dict[str, None] = {}
        self.held: dict[str, int] = {}  # type -> GPUs ready, booting or draining
        self.live: dict[str, int] = {}  # type -> GPUs ready or booting
        self.ascending: dict[str, SortedList] = {}  # type -> (load, gid) over ready GPUs
        self.descending: dict[str, SortedList] = {}  # type -> (-load, gid) over ready GPUs
        self.load_units = 0
        self.inexact_loads = 0
        self._next = 0

    @classmethod
    def of(cls, gpus: Mapping[str, object], gpu_load: Mapping[str, float]) -> ClusterIndex:
        """An index of a snapshot's GPUs (``GpuView``s) and loads, in the snapshot's order."""
        index = cls()
        index.position = dict(zip(gpus, range(len(gpus)), strict=True))
        index._next = len(gpus)
        index.gpu_type = {g: v.gpu_type for g, v in gpus.items()}  # type: ignore[attr-defined]
        index.status = {g: v.status for g, v in gpus.items()}  # type: ignore[attr-defined]
        index.load = {g: gpu_load.get(g, 0.0) for g in gpus}
        status, gpu_type, load = index.status, index.gpu_type, index.load
        index.ready = {g: None for g, st in status.items() if st == "ready"}
        index.provisioning = {g: None for g, st in status.items() if st == "provisioning"}
        index.draining = {g: None for g, st in status.items() if st == "draining"}
        index.held = dict(Counter(gpu_type[g] for g, st in status.items() if st in HELD))
        index.live = dict(Counter(gpu_type[g] for g, st in status.items() if st in LIVE))
        ready: dict[str, list[tuple[float, str]]] = {}
        for g in index.ready:
            ready.setdefault(gpu_type[g], []).append((load[g], g))
        # One sort per type (a decision on a snapshot without an index pays O(M log M) in C).
        for t, rows in ready.items():
            index.ascending[t] = SortedList(rows)
            index.descending[t] = SortedList([(-x, g) for x, g in rows])
        for value in load.values():
            units = exact_units(value)
            if units is None:
                index.inexact_loads += 1
            else:
                index.load_units += units
        return index

    def _forget(self, gid: str) -> None:
        t, status, load = self.gpu_type[gid], self.status[gid], self.load[gid]
        if status == "ready":
            del self.ready[gid]
            self.ascending[t].remove((load, gid))
            self.descending[t].remove((-load, gid))
        elif status == "provisioning":
            del self.provisioning[gid]
        elif status == "draining":
            del self.draining[gid]
        if status in HELD:
            self.held[t] -= 1
        if status in LIVE:
            self.live[t] -= 1
        units = exact_units(load)
        if units is None:
            self.inexact_loads -= 1
        else:
            self.load_units -= units

    def set_gpu(self, gid: str, gpu_type: str, status: str, load: float) -> None:
        """Record a GPU's type, status and load (a new GPU takes the next position)."""
        if gid in self.status:
            if (self.gpu_type[gid], self.status[gid], self.load[gid]) == (gpu_type, status, load):
                return
            self._forget(gid)
        else:
            self.position[gid] = self._next
            self._next += 1
        self.gpu_type[gid], self.status[gid], self.load[gid] = gpu_type, status, load
        if status == "ready":
            self.ready[gid] = None
            self.ascending.setdefault(gpu_type, SortedList()).add((load, gid))
            self.descending.setdefault(gpu_type, SortedList()).add((-load, gid))
        elif status == "provisioning":
            self.provisioning[gid] = None
        elif status == "draining":
            self.draining[gid] = None
        if status in HELD:
            self.held[gpu_type] = self.held.get(gpu_type, 0) + 1
        if status in LIVE:
            self.live[gpu_type] = self.live.get(gpu_type, 0) + 1
        units = exact_units(load)
        if units is None:
            self.inexact_loads += 1
        else:
            self.load_units += units

    def drop_gpu(self, gid: str) -> None:
        """Forget a GPU (released): it leaves the snapshot."""
        if gid in self.status:
            self._forget(gid)
            for table in (self.position, self.gpu_type, self.status, self.load):
                del table[gid]

    def in_order(self, gids: Mapping[str, None] | list[str]) -> list[str]:
        """``gids`` in the snapshot's order."""
        return sorted(gids, key=self.position.__getitem__)

    def ready_types(self) -> list[str]:
        """Types with at least one ready GPU, sorted."""
        return sorted(t for t, rows in self.ascending.items() if rows)

    def total_load(self) -> float | None:
        """The sum of every GPU's load, exact, or None where some load is not a whole number of
        2⁻²⁰ units (then the caller sums the floats in snapshot order)."""
        if self.inexact_loads:
            return None
        return self.load_units / UNIT
