"""Placement controller (TurboServe §5.2.1): incremental assignment and migration-aware min-max
rebalancing, on a working copy of the snapshot's per-GPU loads.

Data structures keep one event's work near O((|U| + moves) · (types + log M)):

* per GPU type, a lazy min-heap of ``(load, gpu)`` over eligible GPUs (ready, not draining) gives
  the least-loaded GPU of that type — under a monotone latency curve, the best target for any
  session among GPUs of that type;
* a lazy max-heap of ``(-latency, gpu)`` over eligible GPUs gives the bottleneck GPU.

Stale heap entries are skipped by comparing against the current load.

Rebalancing is judged on the cluster objective (bottleneck + η·Σκ): single moves off the bottleneck
GPU, swaps when no single move helps (a bounded search over a few least-loaded partners per type),
then the steps after the best prefix are undone and migrated sessions are sent home where a cheaper
move gives the same loads (:meth:`PlacementWork.unwind`).
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass

from .index import UNIT, ClusterIndex, exact_units
from .types import GpuTypeSpec, Migration, Snapshot

_EPS = 1e-9


@dataclass
class Move:
    session: str
    src: str
    dst: str
    kappa_ms: float
    gain_ms: float


def migration_gain(
    bottleneck_ms: float, src_after_ms: float, dst_after_ms: float, kappa_ms: float, eta: float
) -> float:
    """Γ = L − L′ − η·κ (Eq. 4), with L′ the worse of the two GPUs the move touches.

    ``dst_after_ms`` includes the moved session's κ stall: its next chunk is that slow.

    Taking L′ over the two touched GPUs (rather than the whole cluster) relieves GPUs that tie at the
    bottleneck one at a time; every accepted move still strictly lowers the sorted vector of GPU
    latencies, so rebalancing terminates.
    """
    return bottleneck_ms - max(src_after_ms, dst_after_ms) - eta * kappa_ms


class _LazySpec(dict):
    """gpu id -> GpuTypeSpec, filled on first use (most GPUs are never touched by a decision)."""

    def __init__(self, snapshot: Snapshot):
        super().__init__()
        self._gpus = snapshot.gpus
        self._types = snapshot.gpu_types

    def __missing__(self, gid: str) -> GpuTypeSpec:
        spec = self._types[self._gpus[gid].gpu_type]
        self[gid] = spec
        return spec


class _LazyCount(dict):
    def __init__(self, snapshot: Snapshot):
        super().__init__()
        self._residents = snapshot.residents

    def __missing__(self, gid: str) -> int:
        n = len(self._residents.get(gid, ()))
        self[gid] = n
        return n


class _Overlay(dict):
    """A decision's per-GPU figures: its own changes, else the snapshot's (read on first use, so a
    decision copies only the GPUs it touches)."""

    def __init__(self, base: Mapping[str, float] | Mapping[str, int], default: float):
        super().__init__()
        self.base = base
        self.default = default

    def __missing__(self, gid: str) -> float:
        return self.base.get(gid, self.default)  # type: ignore[return-value]

    def __contains__(self, gid: object) -> bool:
        # A GPU is in the overlay whether or not this decision changed it (as in the full copy it
        # replaced: ``gid in work.load`` asks "is this a GPU of the snapshot").
        return dict.__contains__(self, gid) or gid in self.base

    def get(self, gid: str, default: float | None = None) -> float | None:  # type: ignore[override]
        if dict.__contains__(self, gid):
            return dict.__getitem__(self, gid)
        return self.base.get(gid, default)  # type: ignore[return-value]


class _Eligible:
    """GPUs a decision may place on: the snapshot's ready GPUs (the index's, shared, read-only) less
    those this decision took out, plus those it put back."""

    def __init__(self, base: Mapping[str, None]):
        self.base = base
        self.removed: set[str] = set()
        self.added: dict[str, None] = {}
        self.size = len(base)

    def __contains__(self, gid: object) -> bool:
        return gid in self.added or (gid in self.base and gid not in self.removed)

    def __len__(self) -> int:
        return self.size

    def discard(self, gid: str) -> None:
        if gid in self.added:
            del self.added[gid]
        else:
            self.removed.add(gid)
        self.size -= 1

    def include(self, gid: str) -> None:
        if gid in self.base:
            self.removed.discard(gid)
        else:
            self.added[gid] = None
        self.size += 1


class PlacementWork:
    """Mutable working copy of a snapshot's placement for one decision.

    Construction reads no GPU: per-GPU loads, bytes, counts and specs are read from the snapshot on
    first use, and the least/most-loaded GPU of a type comes from the cluster index's ordered sets
    (``Snapshot.index``, kept by the state's owner; built here when absent) merged with this
    decision's own lazy heaps of the GPUs it changed. An index entry is valid while its GPU is still
    eligible and its load unchanged, exactly as a heap entry is.
    """

    def __init__(self, snapshot: Snapshot, *, eta: float = 0.5, min_residency_s: float = 2.0):
        self.snap = snapshot
        self.eta = eta
        self.min_residency_s = min_residency_s
        index = snapshot.index
        if index is None:
            index = ClusterIndex.of(snapshot.gpus, snapshot.gpu_load)
        self.index = index
        self.spec: dict[str, GpuTypeSpec] = _LazySpec(snapshot)
        self.load: dict[str, float] = _Overlay(snapshot.gpu_load, 0.0)
        self.bytes: dict[str, int] = _Overlay(snapshot.gpu_bytes, 0)  # type: ignore[assignment]
        self.count: dict[str, int] = _LazyCount(snapshot)
        self.members: dict[str, dict[str, None]] = {}
        self.location: dict[str, str] = {}  # session -> gpu, only for sessions touched in this decision
        self.origin: dict[str, str | None] = {}  # session -> GPU it had in the snapshot (None: unplaced)
        self.type_spec: dict[str, GpuTypeSpec] = {}
        self.eligible_set = _Eligible(index.ready)
        # The eligible GPUs as a list, built only when a step needs them all (jobs, scale-in): in
        # the snapshot's order, sorted by id once a GPU was made eligible (as it always was).
        self._eligible: list[str] | None = None
        # GPUs set aside by relieve_overflow (above K, nothing fits elsewhere) while it looks further.
        self._aside: set[str] = set()
        types = index.ready_types()
        self.by_type: dict[str, list[tuple[float, str]]] = {t: [] for t in types}
        self.max_by_type: dict[str, list[tuple[float, str]]] = {t: [] for t in types}
        for t in types:
            self.type_spec[t] = snapshot.gpu_types[t]
        self.type_order = types

    @property
    def eligible(self) -> list[str]:
        """The eligible GPUs (O(M) on first use: only jobs and scale-in need them all)."""
        if self._eligible is None:
            self._eligible = [g for g in self.snap.gpus if g in self.eligible_set]
        return self._eligible

    @property
    def n_eligible(self) -> int:
        return len(self.eligible_set)

    def total_load(self) -> float:
        """The sum of every GPU's load now (N_req before the queue): from the index's exact total and
        this decision's changes where every term is exact, else the float sum in snapshot order."""
        total = self.index.total_load()
        if total is not None:
            units = self.index.load_units
            base = self.snap.gpu_load
            for gid in dict.keys(self.load):
                now, before = exact_units(dict.__getitem__(self.load, gid)), exact_units(base.get(gid, 0.0))
                if now is None or before is None:
                    break
                units += now - before
            else:
                return units / UNIT
        return sum(self.load[g] for g in self.snap.gpu_load)

    def _type(self, gid: str) -> str:
        return self.snap.gpus[gid].gpu_type

    # -- membership ------------------------------------------------------------------------------
    def residents(self, gid: str) -> list[str]:
        """Sessions on ``gid`` now (snapshot residents adjusted by this decision's moves), sorted."""
        if gid in self.members:
            return sorted(self.members[gid])
        return list(self.snap.residents.get(gid, ()))

    def _members(self, gid: str) -> dict[str, None]:
        if gid not in self.members:
            self.members[gid] = dict.fromkeys(self.snap.residents.get(gid, ()))
        return self.members[gid]

    def session_load(self, sid: str) -> float:
        return self.snap.sessions[sid].load

    def fits(self, gid: str, sid: str) -> bool:
        spec = self.spec[gid]
        s = self.snap.sessions[sid]
        return (
            self.count[gid] + 1 <= spec.session_limit()
            and self.bytes[gid] + s.state_bytes <= spec.bytes_limit()
        )

    def latency(self, gid: str, extra: float = 0.0) -> float:
        return self.spec[gid].latency_ms(self.load[gid] + extra)

    def rho(self, gid: str) -> float:
        return self.load[gid] / self.spec[gid].capacity

    def _push(self, gid: str) -> None:
        if gid in self.eligible_set:
            t = self._type(gid)
            heapq.heappush(self.by_type[t], (self.load[gid], gid))
            heapq.heappush(self.max_by_type[t], (-self.load[gid], gid))

    def add(self, sid: str, gid: str) -> None:
        s = self.snap.sessions[sid]
        self._members(gid)[sid] = None
        self.load[gid] = self.load.get(gid, 0.0) + s.load
        self.count[gid] += 1
        self.bytes[gid] = self.bytes.get(gid, 0) + s.state_bytes
        self.location[sid] = gid
        self._push(gid)

    def remove(self, sid: str, gid: str) -> None:
        s = self.snap.sessions[sid]
        del self._members(gid)[sid]
        self.load[gid] -= s.load
        if abs(self.load[gid]) < _EPS:
            self.load[gid] = 0.0
        self.count[gid] -= 1
        self.bytes[gid] -= s.state_bytes
        self._push(gid)

    def note_origin(self, sid: str) -> None:
        if sid not in self.origin:
            s = self.snap.sessions[sid]
            self.origin[sid] = s.gpu if s.state == "executing" else None

    def move(self, sid: str, src: str, dst: str) -> None:
        self.note_origin(sid)
        self.remove(sid, src)
        self.add(sid, dst)

    # -- queries ---------------------------------------------------------------------------------
    def _valid(self, load: float, gid: str) -> bool:
        """Whether an ordered entry still stands: its GPU eligible and its load unchanged."""
        return gid in self.eligible_set and abs(load - self.load[gid]) <= _EPS

    def _ascending(self, gpu_type: str) -> Iterator[tuple[float, str]]:
        """Valid ``(load, gid)`` entries of a type's eligible GPUs in ascending order (duplicates
        possible): the index's ordered set merged with this decision's heap (sorted copy)."""
        base = self.index.ascending.get(gpu_type, ())
        local = sorted(self.by_type.get(gpu_type, ()))
        for load, gid in heapq.merge(base, local):
            if self._valid(load, gid):
                yield load, gid

    def least_loaded(self, gpu_type: str, sid: str, exclude: str | None = None) -> str | None:
        """Least-loaded eligible GPU of a type that has memory for ``sid`` (ties by id)."""
        if gpu_type not in self.by_type:
            return None
        found: tuple[float, str] | None = None
        # The first fitting entry of the index (a bounded walk: past 64 full GPUs, a scan) …
        skipped = 0
        for load, gid in self.index.ascending.get(gpu_type, ()):
            if not self._valid(load, gid):
                continue
            if gid != exclude and self.fits(gid, sid):
                found = (load, gid)
                break
            skipped += 1
            if skipped > 64:
                # Memory-full GPUs at the top: fall back to a scan of this type (rare).
                return self._scan_least_loaded(gpu_type, sid, exclude)
        # … against the first fitting entry of this decision's heap (stale entries dropped).
        heap = self.by_type[gpu_type]
        popped: list[tuple[float, str]] = []
        while heap:
            load, gid = heap[0]
            if not self._valid(load, gid):
                heapq.heappop(heap)
                continue
            if found is not None and (load, gid) >= found:
                break
            if gid != exclude and self.fits(gid, sid):
                found = (load, gid)
                break
            popped.append(heapq.heappop(heap))
            if len(popped) > 64:
                for entry in popped:
                    heapq.heappush(heap, entry)
                return self._scan_least_loaded(gpu_type, sid, exclude)
        for entry in popped:
            heapq.heappush(heap, entry)
        return found[1] if found else None

    def _scan_least_loaded(self, gpu_type: str, sid: str, exclude: str | None) -> str | None:
        best = None
        for gid in self.eligible:
            if gid == exclude or self._type(gid) != gpu_type or not self.fits(gid, sid):
                continue
            key = (self.load[gid], gid)
            if best is None or key < best:
                best = key
        return best[1] if best else None

    def _most_loaded(self, gpu_type: str) -> str | None:
        """Most-loaded eligible GPU of a type (ties by id), GPUs set aside left out."""
        heap = self.max_by_type.get(gpu_type)
        if heap is None:
            return None
        found: tuple[float, str] | None = None
        for neg, gid in self.index.descending.get(gpu_type, ()):
            if gid not in self._aside and self._valid(-neg, gid):
                found = (neg, gid)
                break
        while heap and not self._valid(-heap[0][0], heap[0][1]):
            heapq.heappop(heap)
        if heap and (found is None or heap[0] < found):
            if heap[0][1] not in self._aside:
                found = heap[0]
            else:
                for neg, gid in sorted(heap):
                    if found is not None and (neg, gid) >= found:
                        break
                    if gid not in self._aside and self._valid(-neg, gid):
                        found = (neg, gid)
                        break
        return found[1] if found else None

    def bottleneck(self) -> tuple[str | None, float]:
        """The eligible GPU with the highest latency (per type: the most loaded one)."""
        best: tuple[float, str] | None = None
        for t in self.type_order:
            gid = self._most_loaded(t)
            if gid is None:
                continue
            lat = self.type_spec[t].latency_ms(self.load[gid])
            if best is None or lat > best[0] or (lat == best[0] and gid < best[1]):
                best = (lat, gid)
        return (best[1], best[0]) if best else (None, 0.0)

    def bottleneck_ms(self) -> float:
        return self.bottleneck()[1]

    def rho_max(self) -> float:
        out = 0.0
        for t in self.type_order:
            gid = self._most_loaded(t)
            if gid is not None:
                out = max(out, self.load[gid] / self.type_spec[t].capacity)
        return out

    # -- §5.2.1 session assignment ---------------------------------------------------------------
    def best_gpu(self, sid: str, exclude: str | None = None) -> str | None:
        """GPU minimising the resulting bottleneck latency; room below K first, then less loaded."""
        w = self.session_load(sid)
        current = self.bottleneck_ms()
        best_key = None
        best = None
        for t in self.type_order:
            gid = self.least_loaded(t, sid, exclude)
            if gid is None:
                continue
            spec = self.type_spec[t]
            after = spec.latency_ms(self.load[gid] + w)
            over_k = 0 if self.load[gid] + w <= spec.capacity + _EPS else 1
            key = (over_k, max(current, after), after, (self.load[gid] + w) / spec.capacity, gid)
            if best_key is None or key < best_key:
                best_key, best = key, gid
        return best

    # -- §5.2.1 migration-aware min-max rebalancing ------------------------------------------------
    def kappa(self, sid: str, src: str, dst: str) -> float:
        if self.snap.sessions[sid].state != "executing":
            return 0.0  # assigned in this very decision: it has not started anywhere yet
        b = self.snap.sessions[sid].state_bytes
        return max(self.spec[src].kappa_ms(b), self.spec[dst].kappa_ms(b))

    def best_move(self, src: str) -> Move | None:
        bottleneck = self.latency(src)
        seen: set[tuple[float, int, bool]] = set()
        best: Move | None = None
        sessions = self.snap.sessions
        # Longest-resident first: among identical sessions move the one that has run there longest,
        # and leave a session that just arrived on this GPU alone for ``min_residency_s`` — each
        # extra move before its next chunk would stack another κ on that chunk.
        for sid in sorted(self.residents(src), key=lambda x: (sessions[x].since, x)):
            if not self._movable(sid):
                continue
            s = sessions[sid]
            fresh = s.state != "executing"  # assigned in this decision: moving it is free
            key = (s.load, s.state_bytes, fresh)
            if key in seen:
                continue  # identical sessions give identical moves; take the first
            seen.add(key)
            src_after = self.spec[src].latency_ms(self.load[src] - s.load)
            for t in self.type_order:
                dst = self.least_loaded(t, sid, exclude=src)
                if dst is None:
                    continue
                kappa = self.kappa(sid, src, dst)
                # The moved session's next chunk carries the κ stall (§5.1: ℓ_i spikes during
                # migration), so it is part of the new bottleneck L′.
                dst_after = self.latency(dst, s.load) + kappa
                gain = migration_gain(bottleneck, src_after, dst_after, kappa, self.eta)
                if best is None or gain > best.gain_ms + _EPS:
                    best = Move(sid, src, dst, kappa, gain)
        return best

    def _movable(self, sid: str) -> bool:
        """Whether rebalancing may move ``sid`` now: assigned or already moved in this decision, or
        resident for at least ``min_residency_s``."""
        s = self.snap.sessions[sid]
        if s.state != "executing" or sid in self.origin:
            return True
        return self.snap.time - s.since >= self.min_residency_s

    def _swap_sides(self, gid: str, below: float | None = None) -> dict[float, str]:
        """Per distinct session load on ``gid`` (below ``below`` if given), the movable session with
        the least state (smallest κ, least memory), ties by id."""
        sessions = self.snap.sessions
        out: dict[float, str] = {}
        for sid in self.residents(gid):
            s = sessions[sid]
            if (below is not None and s.load >= below - _EPS) or not self._movable(sid):
                continue
            cur = out.get(s.load)
            if cur is None or (s.state_bytes, sid) < (sessions[cur].state_bytes, cur):
                out[s.load] = sid
        return out

    def _least_loaded_few(self, gpu_type: str, exclude: str, n: int) -> list[str]:
        """Up to ``n`` least-loaded eligible GPUs of a type, ``exclude`` left out."""
        out: list[str] = []
        seen: set[str] = set()
        if n <= 0:
            return out
        for _, gid in self._ascending(gpu_type):
            if gid in seen:
                continue
            seen.add(gid)
            if gid != exclude:
                out.append(gid)
                if len(out) >= n:
                    break
        return out

    def best_swap(self, src: str) -> tuple[Move, Move] | None:
        """Best exchange of a session on the bottleneck GPU ``src`` with a lighter one elsewhere.

        A swap shifts load by the difference of the two sessions and leaves both GPUs' session
        counts unchanged, so it still works when no single move helps: the load step of a move is
        too coarse (the target would end above the current bottleneck) or the targets are full in
        session count. Γ is Eq. 4 with both migrations: L − max(ℓ_src′ + κ_b, ℓ_dst′ + κ_a) −
        η·(κ_a + κ_b), each moved session's next chunk carrying its own κ stall. Bounded: per type
        the ``SWAP_PARTNERS`` least-loaded GPUs, and per GPU one session per distinct load. The
        partner GPU may not end above K.
        """
        bottleneck = self.latency(src)
        mine = self._swap_sides(src)
        if not mine:
            return None
        sessions = self.snap.sessions
        src_spec = self.spec[src]
        best: tuple[float, Move, Move] | None = None
        for t in self.type_order:
            for dst in self._least_loaded_few(t, src, self.SWAP_PARTNERS):
                dst_spec = self.spec[dst]
                theirs = self._swap_sides(dst, below=max(mine))
                for la, a in sorted(mine.items()):
                    sa = sessions[a]
                    for lb, b in sorted(theirs.items()):
                        if lb >= la - _EPS:
                            continue
                        sb = sessions[b]
                        if self.load[dst] - lb + la > dst_spec.capacity + _EPS:
                            continue  # never push the partner above K (the K rule of assignment)
                        if (
                            self.bytes[src] - sa.state_bytes + sb.state_bytes > src_spec.bytes_limit()
                            or self.bytes[dst] - sb.state_bytes + sa.state_bytes > dst_spec.bytes_limit()
                        ):
                            continue
                        ka = self.kappa(a, src, dst)
                        kb = self.kappa(b, dst, src)
                        src_after = src_spec.latency_ms(self.load[src] - la + lb) + kb
                        dst_after = dst_spec.latency_ms(self.load[dst] - lb + la) + ka
                        gain = bottleneck - max(src_after, dst_after) - self.eta * (ka + kb)
                        if best is None or gain > best[0] + _EPS:
                            best = (gain, Move(a, src, dst, ka, gain), Move(b, dst, src, kb, gain))
        return (best[1], best[2]) if best else None

    SWAP_PARTNERS = 4

    def _moved_cost(self, sid: str) -> float:
        """κ this decision has committed ``sid`` to so far (0 if it is back where it started)."""
        src = self.origin.get(sid)
        dst = self.location.get(sid)
        if src is None or dst is None or src == dst:
            return 0.0
        return self.kappa(sid, src, dst)

    def rebalance(self, max_moves: int | None = None) -> int:
        """Min-max rebalancing (Eq. 4), judged on the cluster objective.

        Repeat the best positive-gain move off the bottleneck GPU, or, when no single move has
        positive gain, the best swap with a lighter session elsewhere. Γ is local to the GPUs a
        step touches, which lets GPUs tied at the bottleneck be relieved one at a time — but if one
        of them cannot be relieved, the κ spent on the others buys nothing. So the steps are logged
        with the cluster objective (bottleneck + η·Σκ) after each, and the steps after the best
        prefix are undone at the end. Returns the number of moves kept.
        """
        limit = max_moves if max_moves is not None else 4 * self.n_eligible + 16
        log: list[tuple[str, str, str]] = []  # (session, from, to), in order
        spent = 0.0
        best_obj = self.bottleneck_ms()
        best_len = 0
        while len(log) < limit:
            src, _ = self.bottleneck()
            if src is None:
                break
            move = self.best_move(src)
            if move is not None and move.gain_ms > 0:
                steps: tuple[Move, ...] = (move,)
            else:
                swap = self.best_swap(src) if len(log) + 2 <= limit else None
                if swap is None or swap[0].gain_ms <= 0:
                    break
                steps = swap
            for step in steps:
                before = self._moved_cost(step.session)
                self.move(step.session, step.src, step.dst)
                spent += self._moved_cost(step.session) - before
                log.append((step.session, step.src, step.dst))
            objective = self.bottleneck_ms() + self.eta * spent
            if objective < best_obj - _EPS:
                best_obj, best_len = objective, len(log)
        for sid, src, dst in reversed(log[best_len:]):
            self.move(sid, dst, src)
        return best_len - self.unwind(sid for sid, _, _ in log[:best_len])

    def _within_k_rule(self, gid: str, old_load: float) -> bool:
        """A step may not newly push ``gid`` above K (it may leave it as far above as it was)."""
        new = self.load[gid]
        return new <= self.spec[gid].capacity + _EPS or new <= old_load + _EPS

    def unwind(self, moved: Iterable[str]) -> int:
        """Send migrated sessions home where that does not cost more than the κ it saves.

        Greedy rebalancing reaches its bottleneck through a chain of moves; some of them only made
        room that a cheaper move would also have made. For each migrated session (in id order), try
        moving it back to the GPU it started on, alone or in exchange for one session there that is
        cheaper to move (assigned in this decision, so κ 0, or started there with less state); per
        distinct load only the cheapest such partner. Keep the best change if the cluster objective,
        bottleneck + η·Σκ, drops; never push a GPU newly above K. Returns how many went home.
        """
        sessions = self.snap.sessions
        home = 0
        for sid in sorted(set(moved)):
            origin = self.origin.get(sid)
            at = self.location.get(sid)
            if origin is None or at is None or origin == at or origin not in self.eligible_set:
                continue
            base = self.bottleneck_ms()
            saved = self.eta * self.kappa(sid, origin, at)
            # Per distinct load, the partner that is cheapest to send instead: a session assigned in
            # this decision (κ 0) or one still where it started, with the least state.
            partners: dict[float, tuple[float, str | None]] = {-1.0: (0.0, None)}
            for fid in self.residents(origin):
                f = sessions[fid]
                if (f.state == "executing" and f.gpu != origin) or not self._movable(fid):
                    continue  # arrived here in this decision, or too recently placed to move
                cost = self.eta * self.kappa(fid, origin, at)
                if cost >= saved - _EPS:
                    continue  # swapping it in saves nothing
                cur = partners.get(f.load)
                if cur is None or (cost, fid) < cur:  # type: ignore[operator]
                    partners[f.load] = (cost, fid)
            best: tuple[float, str | None] | None = None
            for _, (cost, fid) in sorted(partners.items()):
                if fid is not None:
                    self.note_origin(fid)  # the trial below touches it: keep it a non-move if kept
                load_o, load_d = self.load[origin], self.load[at]
                self.remove(sid, at)
                if fid is not None:
                    self.remove(fid, origin)
                ok = self.fits(origin, sid) and (fid is None or self.fits(at, fid))
                self.add(sid, origin)
                if fid is not None:
                    self.add(fid, at)
                if ok and self._within_k_rule(origin, load_o) and self._within_k_rule(at, load_d):
                    delta = self.bottleneck_ms() - base - saved + cost
                    if delta < -_EPS and (best is None or delta < best[0] - _EPS):
                        best = (delta, fid)
                if fid is not None:
                    self.remove(fid, at)
                    self.add(fid, origin)
                self.remove(sid, origin)
                self.add(sid, at)
            if best is not None:
                fid = best[1]
                self.move(sid, at, origin)
                if fid is not None:
                    self.move(fid, origin, at)
                home += 1
        return home

    def relieve_overflow(self) -> int:
        """Move sessions off GPUs above K to GPUs with room below K (latency target first)."""
        moves = 0
        for t in self.type_order:
            stuck: list[str] = []
            while True:
                gid = self._most_loaded(t)
                if gid is None or self.load[gid] <= self.type_spec[t].capacity + _EPS:
                    break
                moved = False
                for sid in sorted(self.residents(gid), key=lambda x: (-self.session_load(x), x)):
                    dst = self.best_gpu(sid, exclude=gid)
                    if dst is None:
                        continue
                    w = self.session_load(sid)
                    if self.load[dst] + w > self.spec[dst].capacity + _EPS:
                        continue
                    self.move(sid, gid, dst)
                    moves += 1
                    moved = True
                    break
                if not moved:
                    # Nothing fits below K elsewhere: set it aside so the loop can look further.
                    stuck.append(gid)
                    self._aside.add(gid)
            self._aside.clear()
        return moves

    def evacuate(self, gid: str) -> int:
        """Consolidation before scale-in: move every resident of a draining GPU elsewhere if possible."""
        moved = 0
        for sid in sorted(self.residents(gid), key=lambda x: (-self.session_load(x), x)):
            dst = self.best_gpu(sid, exclude=gid)
            if dst is None:
                continue
            self.move(sid, gid, dst)
            moved += 1
        return moved

    def make_ineligible(self, gid: str) -> None:
        """Stop using a GPU as a target (draining). Its ordered entries become stale lazily."""
        if gid in self.eligible_set:
            self.eligible_set.discard(gid)
            if self._eligible is not None:
                self._eligible.remove(gid)

    def make_eligible(self, gid: str) -> None:
        if gid not in self.eligible_set and self.snap.gpus[gid].status in ("ready", "draining"):
            eligible = self.eligible
            self.eligible_set.include(gid)
            eligible.append(gid)
            eligible.sort()
            t = self._type(gid)
            self.by_type.setdefault(t, [])
            self.max_by_type.setdefault(t, [])
            self.type_spec[t] = self.snap.gpu_types[t]
            self.type_order = sorted(self.by_type)
            self._push(gid)

    def migrations(self) -> tuple[tuple[Migration, ...], tuple[tuple[str, str], ...]]:
        """Collapse this decision's moves into migrations (placed sessions) and assignments."""
        migrations: list[Migration] = []
        assigns: list[tuple[str, str]] = []
        for sid in sorted(self.location):
            dst = self.location[sid]
            src = self.origin.get(sid)
            if sid not in self.origin or src is None:
                assigns.append((sid, dst))
            elif src != dst:
                b = self.snap.sessions[sid].state_bytes
                kappa = max(self.spec[src].kappa_ms(b), self.spec[dst].kappa_ms(b))
                migrations.append(Migration(sid, src, dst, round(kappa, 3)))
        return tuple(migrations), tuple(assigns)


def capacity_needed(n_req: float, rho_hat: float) -> float:
    """Capacity (in load units) the proportional rule targets: N_req / ρ̂ (§5.2.2)."""
    return n_req / rho_hat if rho_hat > 0 else math.inf
