"""Demand forecasts per series (origin or region) and TORTA's predictive autoscaling floor (Eq. 6).

- :class:`EtsForecaster`: damped additive-trend exponential smoothing (Holt, an ETS(A,Ad,N) model)
  fitted with statsmodels. Fitting is the expensive part, so parameters are refit every ``refit_every``
  observations on a sliding window, and between refits the level/trend states are updated with the
  fitted parameters — one multiply-add per observation. Fit time is measured (``fit_seconds``).
- :class:`SeasonalNaiveForecaster`: ``ŷ(t + h) = y(t + h − m)`` for a season of ``m`` observations,
  the last value while less than one season is known. The baseline every forecast must beat.
- :class:`LastValueForecaster`: ``ŷ(t + h) = y(t)`` (what a purely reactive system assumes).
"""

from __future__ import annotations

import math
import time
import warnings

import numpy as np


def predictive_floor(
    queue: float, forecast: float, capacity_per_gpu: float, *, sigma: float = 1.0, max_gpus: int | None = None
) -> int:
    """TORTA Eq. 6: ``N = min(S, ⌈(Q + F + σ·√F) / C⌉)`` GPUs for queue Q, forecast F (load units),
    per-GPU capacity C and safety factor σ (the √F term buffers Poisson-like variability)."""
    if capacity_per_gpu <= 0:
        raise ValueError(f"capacity_per_gpu must be > 0, got {capacity_per_gpu}")
    queue = max(0.0, float(queue))
    forecast = max(0.0, float(forecast))
    needed = math.ceil((queue + forecast + sigma * math.sqrt(forecast)) / capacity_per_gpu - 1e-9)
    needed = max(0, needed)
    return needed if max_gpus is None else min(max_gpus, needed)


class LastValueForecaster:
    name = "last-value"

    def __init__(self, n_series: int):
        self.history: list[np.ndarray] = []
        self.n_series = n_series
        self.fit_seconds = 0.0
        self.fits = 0

    def observe(self, values: np.ndarray) -> None:
        self.history.append(np.asarray(values, dtype=float).copy())

    def forecast(self, horizon: int) -> np.ndarray:
        """series × horizon (steps 1..horizon ahead)."""
        last = self.history[-1] if self.history else np.zeros(self.n_series)
        return np.repeat(last[:, None], horizon, axis=1)


class SeasonalNaiveForecaster(LastValueForecaster):
    name = "seasonal-naive"

    def __init__(self, n_series: int, season: int):
        super().__init__(n_series)
        if season < 1:
            raise ValueError(f"season must be >= 1, got {season}")
        self.season = season

    def forecast(self, horizon: int) -> np.ndarray:
        n = len(self.history)
        out = super().forecast(horizon)
        for h in range(1, horizon + 1):
            back = n + h - 1 - self.season  # index of y(t + h − m), t = n − 1
            if back >= 0:
                out[:, h - 1] = self.history[back]
        return out


class EtsForecaster(LastValueForecaster):
    name = "ets"

    def __init__(self, n_series: int, *, refit_every: int = 40, window: int = 80, min_history: int = 12):
        super().__init__(n_series)
        self.refit_every = refit_every
        self.window = window
        self.min_history = min_history
        self.alpha = np.full(n_series, 0.5)
        self.beta = np.full(n_series, 0.1)
        self.phi = np.full(n_series, 0.9)
        self.level: np.ndarray | None = None
        self.trend = np.zeros(n_series)
        self._since_fit = 0

    def observe(self, values: np.ndarray) -> None:
        super().observe(values)
        y = self.history[-1]
        if self.level is None:
            self.level = y.copy()
            return
        self._since_fit += 1
        n = len(self.history)
        if n >= self.min_history and (self.fits == 0 or self._since_fit >= self.refit_every):
            self._refit()
            return
        # Holt's damped-trend recursions with the last fitted parameters.
        previous = self.level
        self.level = self.alpha * y + (1 - self.alpha) * (previous + self.phi * self.trend)
        self.trend = self.beta * (self.level - previous) + (1 - self.beta) * self.phi * self.trend

    def _refit(self) -> None:
        from statsmodels.tsa.holtwinters import ExponentialSmoothing

        started = time.perf_counter()
        series = np.array(self.history[-self.window :])
        for i in range(self.n_series):
            y = series[:, i]
            if np.ptp(y) < 1e-9:
                self.level[i], self.trend[i] = y[-1], 0.0
                continue
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                fit = ExponentialSmoothing(
                    y, trend="add", damped_trend=True, initialization_method="estimated"
                ).fit(method="L-BFGS-B", use_brute=False)
            self.alpha[i] = fit.params["smoothing_level"]
            self.beta[i] = fit.params["smoothing_trend"]
            self.phi[i] = fit.params["damping_trend"]
            self.level[i] = fit.level[-1]
            self.trend[i] = fit.trend[-1]
        self.fit_seconds += time.perf_counter() - started
        self.fits += 1
        self._since_fit = 0

    def forecast(self, horizon: int) -> np.ndarray:
        if self.level is None:
            return np.zeros((self.n_series, horizon))
        damp = np.cumsum(self.phi[:, None] ** np.arange(1, horizon + 1)[None, :], axis=1)
        return np.maximum(self.level[:, None] + damp * self.trend[:, None], 0.0)


class OracleForecaster(LastValueForecaster):
    """Knows the future (``truth``: observations × series) and blurs it with multiplicative lognormal
    noise of ``noise`` (seeded): the knob of TORTA's Fig. 12, prediction accuracy against gain."""

    name = "oracle"

    def __init__(self, truth: np.ndarray, noise: float, seed: int = 0):
        super().__init__(truth.shape[1])
        if noise < 0:
            raise ValueError(f"noise must be >= 0, got {noise}")
        self.truth = truth
        self.noise = noise
        self.rng = np.random.default_rng(seed)

    def forecast(self, horizon: int) -> np.ndarray:
        n = len(self.history)
        steps = [min(n - 1 + h, len(self.truth) - 1) for h in range(1, horizon + 1)]
        exact = self.truth[steps].T
        return (
            exact * np.exp(self.rng.normal(0.0, self.noise, size=exact.shape)) if self.noise else exact.copy()
        )


def make_forecaster(name: str, n_series: int, *, season: int, refit_every: int = 40):
    if name == "ets":
        return EtsForecaster(n_series, refit_every=refit_every)
    if name == "seasonal-naive":
        return SeasonalNaiveForecaster(n_series, season)
    if name == "last-value":
        return LastValueForecaster(n_series)
    raise ValueError(f"unknown forecaster {name!r} (expected ets, seasonal-naive or last-value)")


def prediction_accuracy(predicted: np.ndarray, actual: np.ndarray, epsilon: float = 1.0) -> float:
    """TORTA Eq. 12: ``PA = exp(−mean_t |F_pred − F_actual| / (F_actual + ε))`` in (0, 1]. ε is in load
    units (1 = one session), so near-empty slots do not dominate the mean."""
    predicted = np.asarray(predicted, dtype=float)
    actual = np.asarray(actual, dtype=float)
    if predicted.size == 0:
        return 1.0
    return float(np.exp(-np.mean(np.abs(predicted - actual) / (actual + epsilon))))
