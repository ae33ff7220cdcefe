"""The macro router's plan: optimal transport from demand by origin to capacity by region (TORTA §5.2.1).

TORTA normalises both marginals to unit mass, which hides absolute overload: a plan for 3× the
capacity looks the same as one for 0.3×. We keep masses absolute instead:

- ``emd`` (default): the exact capacity-constrained transport LP, solved by ``ot.emd`` on an augmented
  problem — a *slack* origin absorbs unused capacity at no cost and an *overflow* region absorbs demand
  that no region within budget can take, at a cost above any real route. Rows sum to the demand,
  columns never exceed the capacity, and the overflow is reported, not normalised away.
- ``sinkhorn``: unbalanced entropic OT (``ot.unbalanced.sinkhorn_unbalanced``) on the raw masses, with a
  KL penalty on each marginal (tight on demand, loose on capacity).

Routes beyond an origin's RTT budget are forbidden (zero mass) in both. The plan is row-normalised
into routing probabilities and smoothed against the previous slot's (§5.2.2's smoothness term, without
the RL layer): ``A_t = (1 − β) A_{t−1} + β P_t``.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

# POT (its torch backend off: the package __init__) is imported on first use: its import (networkx,
# scipy.stats …) costs ~0.7 s of CPU, which every process that loads the scheduler's apps would pay —
# worker daemons, the web process, management commands — though only the scheduler's Celery worker
# solves (and imports it when it starts: ``preload_solver``, so no live solve pays for it).
_pot = None


def _ot():
    global _pot
    if _pot is None:
        import ot

        _pot = ot
    return _pot


def preload_solver() -> None:
    """Import the solver now (the scheduler's Celery worker, at start)."""
    _ot()


_FORBIDDEN = 1e6  # cost of a route beyond the RTT budget (emd): never chosen while overflow exists
_OVERFLOW = 1e4  # cost of leaving demand unplaced: above every allowed route
_NEGLIGIBLE = 1e-9  # load units


@dataclass(frozen=True)
class CostWeights:
    """``C[o, r] = w_rtt · RTT + w_transfer · transfer $/session-h + w_price · GPU $/session-h`` (ms-equivalents)."""

    rtt: float = 1.0
    transfer: float = 100.0
    price: float = 100.0


def cost_matrix(
    rtt_ms: np.ndarray,
    transfer_usd_per_session_h: np.ndarray,
    price_usd_per_session_h: np.ndarray,
    weights: CostWeights,
) -> np.ndarray:
    """TORTA's C_ij = w1·L_ij + w2·BandwidthCost_ij + w3·OperationalCost_j (we price the destination
    absolutely rather than as a difference to the origin's, which only shifts each row by a constant)."""
    return (
        weights.rtt * rtt_ms
        + weights.transfer * transfer_usd_per_session_h
        + weights.price * price_usd_per_session_h[None, :]
    )


@dataclass(frozen=True)
class Pools:
    """The supply side: one column per (region, GPU type) a region may hold, so the plan sees that a
    region's cheap GPUs run out before its dear ones."""

    region: np.ndarray  # column -> region index
    capacity: np.ndarray  # column -> load units at the capacity limit
    price_per_unit_h: np.ndarray  # column -> $ per load unit and hour

    def to_regions(self, flow: np.ndarray, n_regions: int) -> np.ndarray:
        """origins × columns → origins × regions."""
        out = np.zeros((flow.shape[0], n_regions))
        np.add.at(out.T, self.region, flow.T)
        return out


def gpu_pools(limits: np.ndarray, type_capacity: np.ndarray, price_h: np.ndarray) -> Pools:
    """``limits`` and ``price_h`` are regions × types; ``type_capacity`` per type."""
    regions, types = np.nonzero(limits > 0)
    return Pools(
        regions,
        limits[regions, types] * type_capacity[types],
        price_h[regions, types] / type_capacity[types],
    )


@dataclass(frozen=True)
class TransportPlan:
    flow: np.ndarray  # origins × regions, load units placed within capacity
    overflow: np.ndarray  # per origin, load that fits nowhere within budget and capacity


def solve_plan(
    demand: np.ndarray,
    capacity: np.ndarray,
    cost: np.ndarray,
    allowed: np.ndarray,
    *,
    method: str = "emd",
    reg: float = 0.05,
    reg_m_capacity: float = 1.0,
) -> TransportPlan:
    """Transport ``demand`` (per origin) onto ``capacity`` (per region) at least ``cost``.

    ``emd``: rows of ``flow`` + ``overflow`` equal ``demand``, columns of ``flow`` are ≤ ``capacity``,
    and no mass goes where ``allowed`` is false. ``sinkhorn``: the same up to the KL relaxation.
    """
    # Masses below a billionth of a session are nothing; they must also go because ot.emd (POT
    # 0.9.7) crashes the process on subnormal masses (found by the property test).
    demand = np.asarray(demand, dtype=float)
    capacity = np.asarray(capacity, dtype=float)
    demand = np.where(demand > _NEGLIGIBLE, demand, 0.0)
    capacity = np.where(capacity > _NEGLIGIBLE, capacity, 0.0)
    n_o, n_r = cost.shape
    if demand.sum() <= 0:
        return TransportPlan(np.zeros((n_o, n_r)), np.zeros(n_o))
    if method == "emd":
        big = np.where(allowed, cost, _FORBIDDEN)
        augmented = np.zeros((n_o + 1, n_r + 1))
        augmented[:n_o, :n_r] = big
        augmented[:n_o, n_r] = _OVERFLOW
        # The slack row (unused capacity) costs nothing anywhere, the overflow column included.
        a = np.append(demand, capacity.sum())
        b = np.append(capacity, demand.sum())
        plan = _ot().emd(a, b, augmented, numItermax=1_000_000)
        flow = plan[:n_o, :n_r] * allowed
        return TransportPlan(flow, plan[:n_o, n_r] + (plan[:n_o, :n_r] * ~allowed).sum(axis=1))
    if method == "sinkhorn":
        finite = np.where(allowed, cost, 0.0)
        scale = float(finite.max()) or 1.0
        # Forbidden routes: a cost whose Gibbs kernel underflows to zero.
        normalised = np.where(allowed, cost / scale, 50.0)
        flow = _ot().unbalanced.sinkhorn_unbalanced(
            demand,
            capacity,
            normalised,
            reg,
            (float("inf"), reg_m_capacity),
            method="sinkhorn_stabilized",
            numItermax=200,
            stopThr=1e-6,
        )
        flow = np.asarray(flow) * allowed
        return TransportPlan(flow, np.maximum(demand - flow.sum(axis=1), 0.0))
    raise ValueError(f"unknown transport method {method!r} (expected 'emd' or 'sinkhorn')")


def routing_probabilities(plan: TransportPlan, allowed: np.ndarray, fallback: np.ndarray) -> np.ndarray:
    """Row-stochastic origins × regions. Overflow is spread over the origin's allowed regions in
    proportion to ``fallback`` (e.g. their capacity): it must go somewhere, and the regional
    autoscalers see it as load. An origin without demand keeps the fallback split."""
    n_o, _ = plan.flow.shape
    probs = np.zeros_like(plan.flow)
    for o in range(n_o):
        spread = fallback * allowed[o]
        spread = spread / spread.sum() if spread.sum() > 0 else allowed[o] / allowed[o].sum()
        row = plan.flow[o] + plan.overflow[o] * spread
        total = row.sum()
        probs[o] = row / total if total > 0 else spread
    return probs


def smooth_plan(previous: np.ndarray | None, current: np.ndarray, beta: float) -> np.ndarray:
    """``(1 − β)·previous + β·current``: stays row-stochastic and within each row's allowed support,
    and moves at most ``β·‖current − previous‖`` (any norm) per slot."""
    if not 0.0 < beta <= 1.0:
        raise ValueError(f"beta must be in (0, 1], got {beta}")
    if previous is None:
        return current.copy()
    return (1.0 - beta) * previous + beta * current
