"""Exact min-max placement with migration cost, for small instances (TurboServe §7.4, Fig. 9 right).

Problem: place every active session on one GPU so that

    bottleneck L = max over non-empty GPUs g of ℓ_g(total load on g)   +   η · Σ κ_i over moved sessions

is minimal, where ℓ_g is the GPU's per-chunk latency curve (non-decreasing), a session is *moved* when
it had a GPU and ends on another one (κ_i from the caller, e.g. the α–β model), and every GPU honours
its hard memory limit (resident sessions and/or resident state bytes). K (``capacity``) is the
scheduler's target, not a constraint here: past K a GPU runs slower, which ℓ_g already says.

Two solvers, cross-checked in the tests:

* :func:`solve_placement_milp` — a MILP for HiGHS (``scipy.optimize.milp``). The latency of a GPU is
  the piecewise-linear interpolation of ℓ_g on breakpoints that include every load the GPU can take
  when session loads share a quantum (or the spec's own ``latency_points``, where ℓ_g is exactly
  piecewise linear), so the optimum is exact. An empty GPU counts 0. A convex curve is written as
  its supporting lines, switched off by a "GPU is used" binary; a non-convex one uses one binary per
  segment (SOS2-style).
* :func:`solve_placement_exhaustive` — enumerates every placement; for tiny instances only.

Inputs follow a minimal protocol so the other scheduling code's GPU type specs work unchanged: a GPU's
``spec`` needs ``latency_ms(load) -> float``, ``capacity`` and ``memory_limit_sessions`` (``None`` =
no limit); ``memory_limit_bytes`` and ``latency_points`` are used when present.
"""

from __future__ import annotations

import contextlib
import itertools
import math
import os
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from fractions import Fraction
from typing import Any, Protocol

import numpy as np
from scipy.optimize import Bounds, LinearConstraint, milp
from scipy.sparse import coo_matrix


class LatencySpec(Protocol):
    capacity: float
    memory_limit_sessions: int | None

    def latency_ms(self, load: float) -> float: ...


@dataclass(frozen=True)
class OracleSession:
    id: str
    load: float = 1.0
    gpu: str | None = None  # where it runs now (None: not placed yet, e.g. newly active)
    state_bytes: int = 0


@dataclass(frozen=True)
class OracleGpu:
    id: str
    spec: Any  # LatencySpec


# κ(session, src_gpu, dst_gpu) in ms; only called for sessions that have a GPU and move off it.
Kappa = Callable[[OracleSession, OracleGpu, OracleGpu], float]
Placement = Mapping[str, str]


def alpha_beta_kappa(alpha_ms: float = 5.0, link_gbps: float = 200.0) -> Kappa:
    """κ = α + bytes / β (Hockney α–β model), the same for every GPU pair."""

    def kappa(session: OracleSession, src: OracleGpu, dst: OracleGpu) -> float:
        return alpha_ms + session.state_bytes / (link_gbps * 1e9) * 1000.0

    return kappa


def spec_kappa(session: OracleSession, src: OracleGpu, dst: OracleGpu) -> float:
    """κ from the specs' own ``kappa_ms(bytes)`` (the slower end of the link decides)."""
    return max(src.spec.kappa_ms(session.state_bytes), dst.spec.kappa_ms(session.state_bytes))


@dataclass
class PlacementResult:
    placement: dict[str, str]
    bottleneck_ms: float
    migration_ms: float  # Σ κ over moved sessions (before η)
    objective: float  # bottleneck_ms + η · migration_ms
    moved: list[str]
    method: str
    optimal: bool  # proven optimal (exhaustive, or MILP solved to optimality)
    solve_ms: float
    details: dict[str, Any] = field(default_factory=dict)


class InfeasibleInstance(ValueError):
    """No placement satisfies the memory limits."""


def _session_limit(spec: Any) -> float:
    limit = getattr(spec, "memory_limit_sessions", None)
    return math.inf if limit is None else float(limit)


def _bytes_limit(spec: Any) -> float:
    limit = getattr(spec, "memory_limit_bytes", None)
    return math.inf if limit is None else float(limit)


def evaluate_placement(
    sessions: Sequence[OracleSession],
    gpus: Sequence[OracleGpu],
    placement: Placement,
    kappa: Kappa,
    eta: float,
) -> PlacementResult:
    """The exact objective of a placement, with the true latency curves. Raises if infeasible."""
    by_id = {g.id: g for g in gpus}
    load = dict.fromkeys(by_id, 0.0)
    count = dict.fromkeys(by_id, 0)
    used_bytes = dict.fromkeys(by_id, 0)
    migration = 0.0
    moved = []
    for s in sessions:
        if s.id not in placement:
            raise InfeasibleInstance(f"session {s.id} is not placed")
        gid = placement[s.id]
        if gid not in by_id:
            raise InfeasibleInstance(f"session {s.id} placed on unknown GPU {gid!r}")
        load[gid] += s.load
        count[gid] += 1
        used_bytes[gid] += s.state_bytes
        if s.gpu is not None and s.gpu != gid:
            migration += kappa(s, by_id[s.gpu], by_id[gid])
            moved.append(s.id)
    for gid, g in by_id.items():
        if count[gid] > _session_limit(g.spec) or used_bytes[gid] > _bytes_limit(g.spec):
            raise InfeasibleInstance(f"GPU {gid} over its memory limit")
    bottleneck = max((by_id[g].spec.latency_ms(load[g]) for g in by_id if count[g] > 0), default=0.0)
    return PlacementResult(
        placement={s.id: placement[s.id] for s in sessions},
        bottleneck_ms=bottleneck,
        migration_ms=migration,
        objective=bottleneck + eta * migration,
        moved=moved,
        method="evaluate",
        optimal=False,
        solve_ms=0.0,
    )


# --------------------------------------------------------------------------------------------------
# Exhaustive search.


def solve_placement_exhaustive(
    sessions: Sequence[OracleSession],
    gpus: Sequence[OracleGpu],
    kappa: Kappa,
    eta: float = 0.5,
    max_placements: int = 2_000_000,
) -> PlacementResult:
    """Try every placement (``len(gpus) ** len(sessions)``) with the true latency curves."""
    started = time.perf_counter()
    n, m = len(sessions), len(gpus)
    if m**n > max_placements:
        raise ValueError(f"{m}^{n} placements is more than max_placements={max_placements}")
    loads = [s.load for s in sessions]
    sizes = [s.state_bytes for s in sessions]
    limits = [(_session_limit(g.spec), _bytes_limit(g.spec)) for g in gpus]
    gpu_index = {g.id: j for j, g in enumerate(gpus)}
    move_cost = np.zeros((n, m))
    for i, s in enumerate(sessions):
        if s.gpu is not None:
            src = gpus[gpu_index[s.gpu]]
            for j, g in enumerate(gpus):
                if g.id != s.gpu:
                    move_cost[i, j] = kappa(s, src, g)
    best: tuple[float, tuple[int, ...]] | None = None
    for choice in itertools.product(range(m), repeat=n):
        load = [0.0] * m
        count = [0] * m
        used = [0] * m
        for i, j in enumerate(choice):
            load[j] += loads[i]
            count[j] += 1
            used[j] += sizes[i]
        if any(count[j] > limits[j][0] or used[j] > limits[j][1] for j in range(m)):
            continue
        bottleneck = max((gpus[j].spec.latency_ms(load[j]) for j in range(m) if count[j]), default=0.0)
        value = bottleneck + eta * sum(move_cost[i, j] for i, j in enumerate(choice))
        if best is None or value < best[0] - 1e-9:
            best = (value, choice)
    if best is None:
        raise InfeasibleInstance("no placement fits the memory limits")
    placement = {s.id: gpus[j].id for s, j in zip(sessions, best[1], strict=True)}
    result = evaluate_placement(sessions, gpus, placement, kappa, eta)
    result.method = "exhaustive"
    result.optimal = True
    result.solve_ms = (time.perf_counter() - started) * 1000.0
    return result


# --------------------------------------------------------------------------------------------------
# MILP.


def _load_quantum(loads: Sequence[float], max_denominator: int = 1000) -> float | None:
    """The largest q with every load an integer multiple of q (loads like 0.5, 1.25, 2), if any."""
    fractions = []
    for load in loads:
        f = Fraction(load).limit_denominator(max_denominator)
        if abs(float(f) - load) > 1e-9:
            return None
        fractions.append(f)
    denominator = math.lcm(*(f.denominator for f in fractions))
    numerator = math.gcd(*(int(f * denominator) for f in fractions))
    return numerator / denominator


def _breakpoints(
    spec: Any, lmin: float, wmax: float, quantum: float | None, max_points: int
) -> tuple[list[float], bool]:
    """Loads at which to sample ℓ on [lmin, wmax]; ``exact`` when the interpolation equals ℓ at every
    load the GPU can actually carry."""
    points = getattr(spec, "latency_points", None)
    if points:
        xs = {lmin, wmax}
        xs.update(float(x) for x, _ in points if lmin < x < wmax)
        return sorted(xs), True
    if wmax <= lmin:
        return [lmin], True
    if quantum is not None and (wmax - lmin) / quantum <= max_points:
        steps = round((wmax - lmin) / quantum)
        return [lmin + k * quantum for k in range(steps + 1)], True
    return list(np.linspace(lmin, wmax, max_points + 1)), False


def _is_convex(xs: Sequence[float], ys: Sequence[float]) -> bool:
    slopes = [(ys[k + 1] - ys[k]) / (xs[k + 1] - xs[k]) for k in range(len(xs) - 1)]
    return all(b >= a - 1e-9 for a, b in itertools.pairwise(slopes))


@contextlib.contextmanager
def _quiet_stdout():
    """Some HiGHS builds print debug lines straight to file descriptor 1 even with ``disp=False``;
    silence the descriptor (not just ``sys.stdout``) while the solver runs."""
    try:
        sys.stdout.flush()
        saved = os.dup(1)
    except (OSError, ValueError):
        yield
        return
    try:
        with open(os.devnull, "w") as devnull:
            os.dup2(devnull.fileno(), 1)
            yield
    finally:
        os.dup2(saved, 1)
        os.close(saved)


class _Model:
    """Sparse constraint rows for ``scipy.optimize.milp``."""

    def __init__(self) -> None:
        self.n_vars = 0
        self.cost: list[float] = []
        self.lower: list[float] = []
        self.upper: list[float] = []
        self.integral: list[int] = []
        self.rows: list[int] = []
        self.cols: list[int] = []
        self.vals: list[float] = []
        self.row_lo: list[float] = []
        self.row_hi: list[float] = []

    def var(self, cost: float = 0.0, lo: float = 0.0, hi: float = 1.0, integer: bool = True) -> int:
        self.cost.append(cost)
        self.lower.append(lo)
        self.upper.append(hi)
        self.integral.append(1 if integer else 0)
        self.n_vars += 1
        return self.n_vars - 1

    def row(self, terms: Mapping[int, float] | Sequence[tuple[int, float]], lo: float, hi: float) -> None:
        r = len(self.row_lo)
        items = terms.items() if isinstance(terms, Mapping) else terms
        for col, val in items:
            self.rows.append(r)
            self.cols.append(col)
            self.vals.append(val)
        self.row_lo.append(lo)
        self.row_hi.append(hi)

    def solve(self, time_limit_s: float, mip_rel_gap: float):
        a = coo_matrix((self.vals, (self.rows, self.cols)), shape=(len(self.row_lo), self.n_vars)).tocsr()
        with _quiet_stdout():
            return milp(
                c=np.array(self.cost),
                integrality=np.array(self.integral),
                bounds=Bounds(np.array(self.lower), np.array(self.upper)),
                constraints=LinearConstraint(a, np.array(self.row_lo), np.array(self.row_hi)),
                options={"time_limit": time_limit_s, "mip_rel_gap": mip_rel_gap, "disp": False},
            )


def solve_placement_milp(
    sessions: Sequence[OracleSession],
    gpus: Sequence[OracleGpu],
    kappa: Kappa,
    eta: float = 0.5,
    *,
    time_limit_s: float = 60.0,
    mip_rel_gap: float = 1e-6,
    max_breakpoints: int = 400,
    formulation: str = "auto",
    symmetry_breaking: bool = True,
    upper_bound: float | None = None,
) -> PlacementResult:
    """Exact min-max placement by MILP (HiGHS). ``formulation``: ``"auto"`` (convex lines where the
    curve is convex, segment binaries otherwise), ``"convex"`` or ``"segments"``.

    ``upper_bound`` (e.g. a heuristic's objective) is added as a cut ``objective <= upper_bound``; a
    valid lower bound on L from water-filling the total load over the GPUs' curves is always added.
    Both only prune the search: the optimum is unchanged.

    ``optimal`` is False when HiGHS stopped at ``time_limit_s`` (the best placement found is returned,
    with HiGHS' lower bound in ``details["lower_bound"]``) or when the breakpoints could not cover
    every realisable load exactly (``details["exact_curves"]``).
    """
    if formulation not in ("auto", "convex", "segments"):
        raise ValueError("formulation must be 'auto', 'convex' or 'segments'")
    started = time.perf_counter()
    n, m = len(sessions), len(gpus)
    if n == 0:
        return PlacementResult({}, 0.0, 0.0, 0.0, [], "milp", True, 0.0)
    gpu_index = {g.id: j for j, g in enumerate(gpus)}
    for s in sessions:
        if s.load <= 0 or not math.isfinite(s.load):
            raise ValueError(f"session {s.id}: load must be finite and > 0")
        if s.gpu is not None and s.gpu not in gpu_index:
            raise ValueError(f"session {s.id}: current GPU {s.gpu!r} is not in the instance")
    loads = [s.load for s in sessions]
    quantum = _load_quantum(loads)
    lmin = min(loads)
    sorted_loads = sorted(loads, reverse=True)

    model = _Model()
    bottleneck = model.var(cost=1.0, lo=0.0, hi=np.inf, integer=False)
    x = np.empty((n, m), dtype=int)
    kappas = np.zeros((n, m))
    for i, s in enumerate(sessions):
        src = gpus[gpu_index[s.gpu]] if s.gpu is not None else None
        for j, g in enumerate(gpus):
            if src is not None and g.id != s.gpu:
                kappas[i, j] = kappa(s, src, g)
            x[i, j] = model.var(cost=eta * kappas[i, j])
    for i in range(n):  # every active session placed exactly once
        model.row({int(x[i, j]): 1.0 for j in range(m)}, 1.0, 1.0)

    exact = True
    formulations = []
    load_vars = []
    vmax = 0.0
    for j, g in enumerate(gpus):
        spec = g.spec
        limit_n = _session_limit(spec)
        limit_b = _bytes_limit(spec)
        if limit_n < n:
            model.row({int(x[i, j]): 1.0 for i in range(n)}, 0.0, limit_n)
        if limit_b < sum(s.state_bytes for s in sessions):
            model.row({int(x[i, j]): float(s.state_bytes) for i, s in enumerate(sessions)}, 0.0, limit_b)
        cap_n = int(min(limit_n, n))
        wmax = float(sum(sorted_loads[:cap_n]))
        w = model.var(lo=0.0, hi=wmax, integer=False)
        load_vars.append(w)
        # w = Σ load_i x_ij
        model.row({w: 1.0, **{int(x[i, j]): -loads[i] for i in range(n)}}, 0.0, 0.0)
        if cap_n == 0:
            for i in range(n):
                model.row({int(x[i, j]): 1.0}, 0.0, 0.0)
            formulations.append("unusable")
            continue
        xs, exact_g = _breakpoints(spec, lmin, max(wmax, lmin), quantum, max_breakpoints)
        exact = exact and exact_g
        ys = [float(spec.latency_ms(v)) for v in xs]
        vmax = max(vmax, max(ys))
        convex = len(xs) < 3 or _is_convex(xs, ys)
        use_convex = formulation == "convex" or (formulation == "auto" and convex)
        if formulation == "convex" and not convex:
            raise ValueError(f"GPU {g.id}: latency curve is not convex on the reachable loads")
        used = model.var()  # 1 when the GPU hosts at least one session
        for i in range(n):
            model.row({int(x[i, j]): 1.0, used: -1.0}, -np.inf, 0.0)
        model.row({used: 1.0, **{int(x[i, j]): -1.0 for i in range(n)}}, -np.inf, 0.0)
        big = max(ys) + 1.0
        if use_convex:
            formulations.append("convex")
            lines = [(0.0, ys[0], xs[0])] if len(xs) == 1 else []
            for k in range(len(xs) - 1):
                slope = (ys[k + 1] - ys[k]) / (xs[k + 1] - xs[k])
                lines.append((slope, ys[k], xs[k]))
            # L >= y_k + slope_k (w - x_k) - big (1 - used)
            for slope, y0, x0 in lines:
                model.row({bottleneck: 1.0, w: -slope, used: -big}, y0 - slope * x0 - big, np.inf)
        else:
            formulations.append("segments")
            # Segment 0 is the empty GPU (w = 0, latency 0); segment k >= 1 spans [xs[k-1], xs[k]].
            lam = model.var(lo=0.0, hi=np.inf, integer=False)
            z_empty = model.var()
            seg_z = []
            seg_d = []
            for _ in range(max(1, len(xs) - 1)):
                seg_z.append(model.var())
                seg_d.append(model.var(lo=0.0, hi=np.inf, integer=False))
            model.row({z_empty: 1.0, **dict.fromkeys(seg_z, 1.0)}, 1.0, 1.0)
            model.row({z_empty: 1.0, used: 1.0}, 1.0, 1.0)
            w_terms: dict[int, float] = {w: 1.0}
            lam_terms: dict[int, float] = {lam: 1.0}
            for k, (z, d) in enumerate(zip(seg_z, seg_d, strict=True)):
                if len(xs) == 1:
                    x0, x1, y0, y1 = xs[0], xs[0], ys[0], ys[0]
                else:
                    x0, x1, y0, y1 = xs[k], xs[k + 1], ys[k], ys[k + 1]
                width = x1 - x0
                model.row({d: 1.0, z: -width}, -np.inf, 0.0)
                w_terms[z] = -x0
                w_terms[d] = -1.0
                lam_terms[z] = -y0
                lam_terms[d] = -((y1 - y0) / width if width > 0 else 0.0)
            model.row(w_terms, 0.0, 0.0)
            model.row(lam_terms, 0.0, 0.0)
            model.row({bottleneck: 1.0, lam: -1.0}, 0.0, np.inf)

    # L >= water-filling bound: spreading the total load fractionally over the GPUs cannot do better.
    lower = _water_filling_bound(sessions, gpus)
    if lower > 0:
        model.row({bottleneck: 1.0}, lower, np.inf)
    if upper_bound is not None and math.isfinite(upper_bound):
        terms = {bottleneck: 1.0}
        for i in range(n):
            for j in range(m):
                if kappas[i, j]:
                    terms[int(x[i, j])] = eta * kappas[i, j]
        model.row(terms, -np.inf, upper_bound + 1e-6 * max(1.0, abs(upper_bound)))

    symmetric_pairs = 0
    if symmetry_breaking:
        # GPUs with the same spec, no current residents and identical κ columns are interchangeable:
        # order their loads to cut the equivalent branches.
        occupied = {s.gpu for s in sessions if s.gpu is not None}
        groups: dict[tuple, list[int]] = {}
        for j, g in enumerate(gpus):
            if g.id in occupied:
                continue
            key = (id(g.spec), tuple(np.round(kappas[:, j], 9)))
            groups.setdefault(key, []).append(j)
        for members in groups.values():
            for a, b in itertools.pairwise(members):
                model.row({load_vars[a]: 1.0, load_vars[b]: -1.0}, 0.0, np.inf)
                symmetric_pairs += 1

    res = model.solve(time_limit_s, mip_rel_gap)
    solve_ms = (time.perf_counter() - started) * 1000.0
    if res.x is None and upper_bound is not None:
        # The cut can leave HiGHS with an empty or numerically awkward feasible set when the bound is
        # already optimal; solve again without it (same optimum, just slower).
        return solve_placement_milp(
            sessions,
            gpus,
            kappa,
            eta,
            time_limit_s=time_limit_s,
            mip_rel_gap=mip_rel_gap,
            max_breakpoints=max_breakpoints,
            formulation=formulation,
            symmetry_breaking=symmetry_breaking,
        )
    if res.x is None:
        if res.status == 2:
            raise InfeasibleInstance("no placement fits the memory limits")
        raise RuntimeError(f"HiGHS found no placement: {res.message}")
    xv = np.asarray(res.x)
    placement = {}
    for i, s in enumerate(sessions):
        j = int(np.argmax(xv[x[i]]))
        placement[s.id] = gpus[j].id
    result = evaluate_placement(sessions, gpus, placement, kappa, eta)
    result.method = "milp"
    result.optimal = bool(res.status == 0 and exact)
    result.solve_ms = solve_ms
    result.details = {
        "status": int(res.status),
        "message": res.message,
        "milp_objective": float(res.fun),
        "lower_bound": float(getattr(res, "mip_dual_bound", res.fun) or res.fun),
        "exact_curves": exact,
        "formulations": formulations,
        "variables": model.n_vars,
        "constraints": len(model.row_lo),
        "symmetry_cuts": symmetric_pairs,
        "lower_bound_cut": lower,
    }
    return result


def _max_load_at(spec: Any, latency: float, wmax: float) -> float:
    """Largest load ``w <= wmax`` with ``latency_ms(w) <= latency`` (ℓ non-decreasing), by bisection."""
    if spec.latency_ms(wmax) <= latency:
        return wmax
    lo, hi = 0.0, wmax
    for _ in range(60):
        mid = (lo + hi) / 2.0
        if spec.latency_ms(mid) <= latency:
            lo = mid
        else:
            hi = mid
    return lo


def _water_filling_bound(sessions: Sequence[OracleSession], gpus: Sequence[OracleGpu]) -> float:
    """A lower bound on the bottleneck latency of any placement.

    In a placement with bottleneck λ every GPU carries at most ``w_g(λ) = max{w : ℓ_g(w) <= λ}`` (and
    what its memory limit allows), so ``Σ_g w_g(λ)`` must reach the total load; the smallest such λ
    (found by bisection, then lowered by a safety margin) bounds the optimum from below.
    """
    total = sum(s.load for s in sessions)
    if total <= 0 or not gpus:
        return 0.0
    loads = sorted((s.load for s in sessions), reverse=True)
    caps = [float(sum(loads[: int(min(_session_limit(g.spec), len(loads)))])) for g in gpus]
    lmin = min(loads)
    hi = max(g.spec.latency_ms(c) for g, c in zip(gpus, caps, strict=True) if c > 0)
    lo = min(g.spec.latency_ms(lmin) for g in gpus)
    if sum(caps) < total - 1e-9:
        return 0.0  # infeasible anyway; let the solver say so
    for _ in range(60):
        mid = (lo + hi) / 2.0
        room = sum(_max_load_at(g.spec, mid, c) for g, c in zip(gpus, caps, strict=True) if c > 0)
        if room >= total:
            hi = mid
        else:
            lo = mid
    return max(0.0, lo - 1e-6 * max(1.0, lo))


def solve_placement(
    sessions: Sequence[OracleSession],
    gpus: Sequence[OracleGpu],
    kappa: Kappa,
    eta: float = 0.5,
    *,
    exhaustive_limit: int = 20_000,
    **milp_options: Any,
) -> PlacementResult:
    """Exhaustive search when ``len(gpus) ** len(sessions) <= exhaustive_limit``, MILP otherwise."""
    if len(gpus) ** len(sessions) <= exhaustive_limit:
        return solve_placement_exhaustive(sessions, gpus, kappa, eta)
    return solve_placement_milp(sessions, gpus, kappa, eta, **milp_options)
