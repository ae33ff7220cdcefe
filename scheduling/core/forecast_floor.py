"""TurboServe with a predictive floor from a demand forecast (issue 16, single region).

:class:`ForecastTurboServe` is TurboServe whose autoscaler gets one more input each decision: the
forecast active load ``F`` one provisioning delay ahead, turned into TORTA's Eq. 6 floor
``N = ⌈(F + σ·√F) / (K·ρ̂)⌉`` GPUs (``regions.forecast.predictive_floor``, Q = 0: queued sessions are
already in TurboServe's reactive need). The floor only raises the need: scale-out requests GPUs when
the floor exceeds the live pool (before the burst is visible in ρ), and scale-in keeps it.

The forecast reuses ``regions.forecast``: every ``slot_s`` the time-weighted mean active load of the
slot just ended (sum of the loads of active sessions) is observed, and ``F`` is the largest forecast
over the next ``h = ⌈(delay + slot) / slot⌉`` slots (a GPU requested now is ready after ``delay``;
it must cover every slot until the next observation could request one). Deterministic: no wall
clock or randomness enters a decision (ETS fits with L-BFGS-B from fixed starts); the fit time is
measured only for the report. Simulator use: the forecaster's history is not in ``state_dict``.

The forecast reaches TurboServe as the snapshot's ``floor_load``, the input the live pipeline sets from
the region forecast slot (``scheduling.core.pipeline``); once this policy's own forecaster has one, its
forecast is the input, else the snapshot's own (live: a fresh object each run, so always the slot's).
"""

from __future__ import annotations

import math
from dataclasses import replace
from typing import Any

import numpy as np

from .regions.forecast import make_forecaster, prediction_accuracy
from .turboserve import TurboServePolicy
from .types import Decision, Event, Snapshot

FORECASTERS = ("ets", "seasonal-naive", "last-value")


class ForecastTurboServe(TurboServePolicy):
    name = "turboserve-forecast"

    def __init__(
        self,
        *,
        forecast: str = "ets",
        forecast_slot_s: float = 30.0,
        forecast_sigma: float = 0.5,
        forecast_season_s: float = 600.0,
        forecast_refit: int = 40,
        **kwargs: Any,
    ):
        super().__init__(**kwargs)
        if forecast not in FORECASTERS:
            raise ValueError(f"forecast must be one of {', '.join(FORECASTERS)}, got {forecast!r}")
        if not (forecast_slot_s > 0 and math.isfinite(forecast_slot_s)):
            raise ValueError(f"forecast_slot_s must be a positive number, got {forecast_slot_s!r}")
        if not (forecast_sigma >= 0 and math.isfinite(forecast_sigma)):
            raise ValueError(f"forecast_sigma must be a number >= 0, got {forecast_sigma!r}")
        if not (forecast_season_s >= forecast_slot_s and math.isfinite(forecast_season_s)):
            raise ValueError(f"forecast_season_s must be >= forecast_slot_s, got {forecast_season_s!r}")
        if int(forecast_refit) < 1:
            raise ValueError(f"forecast_refit must be >= 1, got {forecast_refit!r}")
        self.forecast = forecast
        self.slot_s = float(forecast_slot_s)
        self.floor_sigma = float(forecast_sigma)
        self.season_s = float(forecast_season_s)
        self.refit = int(forecast_refit)
        self.forecaster = make_forecaster(
            forecast, 1, season=max(1, round(self.season_s / self.slot_s)), refit_every=self.refit
        )
        self._slot_end: float | None = None  # set at the first decision (the slot grid is absolute)
        self._slot_start = 0.0
        self._last_t = 0.0
        self._last_load = 0.0
        self._acc = 0.0
        # F: the largest forecast over the floor's horizon, refreshed at each slot end (None: no slot
        # has ended yet).
        self.forecast_load: float | None = None
        self.last_floor_gpus = 0
        self.actual: list[float] = []  # mean active load per slot
        self.predicted: list[float] = []  # one-slot-ahead forecast made at the end of the slot before
        self.floor_timeline: list[tuple[float, int]] = []  # (slot end, floor GPUs) when it changes

    def _advance(self, now: float, snapshot: Snapshot) -> None:
        """Close every slot that ended by ``now`` and refresh the floor input from the forecast."""
        if self._slot_end is None:
            # Start at the first decision's slot (a live scheduler does not start at t = 0).
            self._slot_start = self._last_t = now
            self._slot_end = (math.floor(now / self.slot_s + 1e-9) + 1) * self.slot_s
        while now >= self._slot_end - 1e-9:
            self._acc += self._last_load * (self._slot_end - self._last_t)
            mean = self._acc / max(self._slot_end - self._slot_start, 1e-9)
            self.actual.append(mean)
            self.forecaster.observe(np.array([mean]))
            delays = [spec.provisioning_delay_s for spec in snapshot.gpu_types.values()]
            delay = min(delays) if delays else 0.0
            horizon = max(1, math.ceil((delay + self.slot_s) / self.slot_s - 1e-9))
            ahead = self.forecaster.forecast(horizon)[0]
            self.predicted.append(float(ahead[0]))
            self.forecast_load = float(max(0.0, ahead.max()))
            self._last_t = self._slot_start = self._slot_end
            self._acc = 0.0
            self._slot_end += self.slot_s
        self._acc += self._last_load * (now - self._last_t)
        self._last_t = now

    def decide(self, snapshot: Snapshot, event: Event) -> Decision:
        now = snapshot.time
        self._advance(now, snapshot)
        if self.forecast_load is not None:
            snapshot = replace(snapshot, floor_load=self.forecast_load)
        decision = super().decide(snapshot, event)
        if decision.signals.floor_gpus is not None:
            self.last_floor_gpus = decision.signals.floor_gpus
        if snapshot.floor_load is not None and (
            not self.floor_timeline or self.floor_timeline[-1][1] != self.last_floor_gpus
        ):
            self.floor_timeline.append((round(now, 6), self.last_floor_gpus))
        self._last_load = sum(s.load for s in snapshot.sessions.values() if s.alpha)
        return decision

    def forecast_report(self) -> dict[str, Any]:
        """Accuracy of the one-slot-ahead forecast (TORTA Eq. 12 and MAPE over slots with load) and
        the fit time; ``predicted[i]`` is judged against ``actual[i + 1]``."""
        pred = np.asarray(self.predicted[:-1], dtype=float)
        act = np.asarray(self.actual[1:], dtype=float)
        nonzero = act > 1e-9
        mape = (
            float(np.mean(np.abs(pred[nonzero] - act[nonzero]) / act[nonzero]) * 100)
            if nonzero.any()
            else None
        )
        return {
            "forecast": self.forecast,
            "slot_s": self.slot_s,
            "sigma": self.floor_sigma,
            "season_s": self.season_s,
            "slots": len(self.actual),
            "accuracy_eq12": round(prediction_accuracy(pred, act), 6),
            "mape_pct": None if mape is None else round(mape, 3),
            "fits": self.forecaster.fits,
            "fit_s": round(self.forecaster.fit_seconds, 6),
            "floor_gpus_max": max((g for _, g in self.floor_timeline), default=0),
            "floor_timeline": [list(row) for row in self.floor_timeline],
        }

    def describe(self) -> dict[str, Any]:
        out = super().describe()
        out["forecast"] = self.forecast_report()
        return out
