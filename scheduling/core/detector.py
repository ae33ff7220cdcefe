"""Workload detector (TurboServe Appendix A) and the volatility → (λ, ρ̂) table.

Volatility σ(t) is the standard deviation of the number of newly activated sessions per time bin
(Table 5 uses 5 s bins) over a sliding window ending now. It is quantised into levels by the table's
upper edges and each level maps to profiled control parameters (λ, ρ̂).

Beyond the paper the detector also tracks *net* activations per bin (activations minus sessions
that stop being active: idle or depart while active), so the autoscaler can size headroom from the
load expected to arrive within one provisioning delay rather than from re-activations that idles
offset.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

DEFAULT_TABLE_PATH = Path(__file__).resolve().parent.parent / "data" / "volatility_table.json"


@dataclass(frozen=True)
class VolatilityLevel:
    level: int
    upper: float  # σ below or equal this value falls in this level (last level: +inf)
    lam: float
    rho_hat: float


@dataclass(frozen=True)
class VolatilityTable:
    levels: tuple[VolatilityLevel, ...]
    bin_s: float = 5.0
    window_bins: int = 12
    meta: tuple[tuple[str, Any], ...] = ()

    def __post_init__(self) -> None:
        if not self.levels:
            raise ValueError("volatility table needs at least one level")
        uppers = [lv.upper for lv in self.levels]
        if uppers != sorted(uppers):
            raise ValueError("volatility levels must have increasing upper edges")
        for lv in self.levels:
            if not 0 < lv.rho_hat <= 1:
                raise ValueError(f"level {lv.level}: rho_hat must be in (0, 1]")

    def quantise(self, sigma: float) -> VolatilityLevel:
        for lv in self.levels[:-1]:
            if sigma <= lv.upper:
                return lv
        return self.levels[-1]

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> VolatilityTable:
        levels = tuple(
            VolatilityLevel(
                level=int(row["level"]),
                upper=math.inf if row.get("upper") is None else float(row["upper"]),
                lam=float(row["lambda"]),
                rho_hat=float(row["rho_hat"]),
            )
            for row in data["levels"]
        )
        meta = tuple(
            sorted(
                (k, v)
                for k, v in data.items()
                if k not in ("levels", "bin_s", "window_bins") and isinstance(v, str | int | float)
            )
        )
        return cls(
            levels=levels,
            bin_s=float(data.get("bin_s", 5.0)),
            window_bins=int(data.get("window_bins", 12)),
            meta=meta,
        )

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = dict(self.meta)
        out["bin_s"] = self.bin_s
        out["window_bins"] = self.window_bins
        out["levels"] = [
            {
                "level": lv.level,
                "upper": None if math.isinf(lv.upper) else lv.upper,
                "lambda": lv.lam,
                "rho_hat": lv.rho_hat,
            }
            for lv in self.levels
        ]
        return out


def load_volatility_table(path: str | Path | None = None) -> VolatilityTable:
    data = json.loads(Path(path or DEFAULT_TABLE_PATH).read_text())
    return VolatilityTable.from_json(data)


def fixed_table(
    rho_hat: float, lam: float = 0.2, bin_s: float = 5.0, window_bins: int = 12
) -> VolatilityTable:
    """One level: a non-adaptive controller (used for grid search and ablations)."""
    return VolatilityTable(
        levels=(VolatilityLevel(1, math.inf, lam, rho_hat),), bin_s=bin_s, window_bins=window_bins
    )


class WorkloadDetector:
    """Sliding window of per-bin activation counts; O(1) per event, JSON-serialisable state."""

    def __init__(self, table: VolatilityTable):
        self.table = table
        self.bin_s = table.bin_s
        self.window_bins = table.window_bins
        # bins: [bin_index, activations, deactivations], oldest first, at most window_bins long
        self.bins: list[list[int]] = []
        self.first_bin: int | None = None

    def _bin(self, time: float) -> list[int]:
        idx = math.floor(time / self.bin_s)
        if self.first_bin is None:
            self.first_bin = idx
        if not self.bins or self.bins[-1][0] < idx:
            self.bins.append([idx, 0, 0])
        oldest = idx - self.window_bins + 1
        while self.bins and self.bins[0][0] < oldest:
            self.bins.pop(0)
        return self.bins[-1]

    def observe(self, time: float, kind: str, was_active: bool = False) -> None:
        """Record one event. ``was_active``: an idle/depart that ended an active period."""
        current = self._bin(time)
        if kind == "active":
            current[1] += 1
        elif kind in ("idle", "depart") and was_active:
            current[2] += 1

    def _series(self, time: float, column: int) -> list[int]:
        last = math.floor(time / self.bin_s)
        first = last - self.window_bins + 1
        if self.first_bin is not None:
            # Before a full window has been observed, average only over what was seen: padding with
            # zeros would hide the ramp at start-up, exactly when headroom matters most.
            first = max(first, min(self.first_bin, last))
        counts = dict.fromkeys(range(first, last + 1), 0)
        for row in self.bins:
            if row[0] in counts:
                counts[row[0]] = row[column] if column > 0 else row[1] - row[2]
        return [counts[i] for i in range(first, last + 1)]

    def volatility(self, time: float) -> float:
        """σ(t): population std of activations per bin over the window (Appendix A, Eq. 6)."""
        series = self._series(time, 1)
        mean = sum(series) / len(series)
        return math.sqrt(sum((x - mean) ** 2 for x in series) / len(series))

    def level(self, time: float) -> tuple[float, VolatilityLevel]:
        sigma = self.volatility(time)
        return sigma, self.table.quantise(sigma)

    def net_activation_stats(self, time: float) -> tuple[float, float]:
        """Mean and population std of net activations per bin over the window (spares' input)."""
        series = self._series(time, 0)
        n = len(series)
        mean = sum(series) / n
        return mean, math.sqrt(sum((x - mean) ** 2 for x in series) / n)

    def expected_net_activations(self, time: float, horizon_s: float, z: float = 1.0) -> float:
        """Net new active sessions expected within ``horizon_s``: drift plus z standard deviations."""
        mean, std = self.net_activation_stats(time)
        bins_ahead = horizon_s / self.bin_s
        # Only positive drift adds load; the spread term keeps the estimate from collapsing to zero
        # on one quiet bin, which would let the autoscaler flap.
        return max(0.0, mean) * bins_ahead + z * std * math.sqrt(bins_ahead)

    def state_dict(self) -> dict[str, Any]:
        return {"bins": [list(row) for row in self.bins], "first_bin": self.first_bin}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.bins = [[int(a), int(b), int(c)] for a, b, c in state.get("bins", [])]
        first = state.get("first_bin")
        self.first_bin = None if first is None else int(first)
