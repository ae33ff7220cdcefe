"""TurboServe with the predictive floor (issue 16, single region): the floor provisions GPUs ahead of a
known periodic burst, runs are deterministic, and bad ``--forecast*`` flags name the flag."""

from __future__ import annotations

import json

import pytest
from django.core.management import CommandError, call_command

from scheduling.core.forecast_floor import ForecastTurboServe
from scheduling.core.policy import make_policy
from scheduling.core.types import GB, GpuTypeSpec
from scheduling.sim.cli import CliError, forecast_options, run_compare, run_simulate
from scheduling.sim.simulator import SimConfig, simulate
from scheduling.sim.traces import TraceEvent, write_trace

PERIOD = 300.0
BURST = 20
DELAY = 40.0


def spec() -> GpuTypeSpec:
    return GpuTypeSpec(
        name="test",
        gpu_type="test",
        capacity=4.0,
        latency_points=((0.0, 400.0), (8.0, 1200.0)),
        price_per_hour=3.6,
        provisioning_delay_s=DELAY,
        memory_limit_sessions=8,
        state_bytes=int(1 * GB),
        link_gbps=100.0,
        host_link_gbps=50.0,
        migration_alpha_ms=5.0,
    )


def periodic_trace(periods: int = 6) -> list[TraceEvent]:
    """Two sessions always active; every PERIOD seconds a burst of BURST sessions for 120 s."""
    rows = [
        (0.0, "base0", "arrive"),
        (0.0, "base0", "active"),
        (0.0, "base1", "arrive"),
        (0.0, "base1", "active"),
    ]
    for k in range(1, periods + 1):
        t0 = k * PERIOD
        for i in range(BURST):
            sid = f"b{k}-{i:02d}"
            rows += [
                (t0 + 0.1 * i, sid, "arrive"),
                (t0 + 0.1 * i + 0.05, sid, "active"),
                (t0 + 120.0 + 0.1 * i, sid, "depart"),
            ]
    rows.sort(key=lambda r: r[0])
    return [TraceEvent(t, s, e) for t, s, e in rows]


def config() -> SimConfig:
    return SimConfig(profiles=[spec()], initial_gpus=1, min_gpus=1, max_gpus=16, duration_s=7 * PERIOD)


def gpus_at(result, t: float) -> int:
    """Provisioned GPUs in the 10-s timeline window that starts at ``t``."""
    row = next(r for r in result.timeline if r["t0"] == t)
    return row["budget_max"]


@pytest.mark.parametrize("forecast", ["seasonal-naive"])
def test_floor_requests_gpus_before_a_known_periodic_burst(forecast):
    # (ETS here is damped-trend without a season: it cannot see a periodic burst coming.)
    events = periodic_trace()
    plain = simulate(events, make_policy("turboserve"), config())
    floored = simulate(
        events,
        ForecastTurboServe(forecast=forecast, forecast_slot_s=30.0, forecast_season_s=PERIOD),
        config(),
    )
    # Reactive TurboServe holds the small pool up to each burst; with the floor (the burst was seen one
    # and more periods ago), GPUs are provisioned in the 10 s before it arrives.
    for k in (4, 5, 6):
        before = k * PERIOD - 10.0
        assert gpus_at(plain, before) <= 2
        assert gpus_at(floored, before) >= 5, (forecast, k, floored.timeline)

    # The first burst (nothing to forecast from) waits in both; the later ones only without the floor.
    def late_worst(result):
        return max(r["worst_ms"] for r in result.timeline if r["t0"] >= 4 * PERIOD - 10.0)

    assert late_worst(floored) < late_worst(plain)
    report = floored.policy_config["forecast"]
    assert report["slots"] == 70
    assert 0.0 < report["accuracy_eq12"] <= 1.0
    assert report["floor_gpus_max"] >= 5


def test_seasonal_naive_floor_is_exact_on_a_periodic_trace_after_one_season():
    policy = ForecastTurboServe(forecast="seasonal-naive", forecast_slot_s=30.0, forecast_season_s=PERIOD)
    simulate(periodic_trace(), policy, config())
    season = int(PERIOD // 30)
    # After two seasons the one-slot-ahead forecast is last period's value, which repeats exactly.
    for i in range(2 * season, len(policy.actual) - 1):
        assert policy.predicted[i] == pytest.approx(policy.actual[i + 1 - season])


def test_forecast_runs_are_deterministic(tmp_path):
    path = tmp_path / "periodic.jsonl"
    write_trace(path, periodic_trace(4), {"name": "periodic", "duration_s": 5 * PERIOD})
    profile = tmp_path / "p.json"
    s = spec()
    profile.write_text(
        json.dumps(
            {
                "name": "test",
                "capacity": s.capacity,
                "price_per_hour": s.price_per_hour,
                "provisioning_delay_s": DELAY,
                "latency_ms": [list(p) for p in s.latency_points],
                "memory_limit_sessions": 8,
            }
        )
    )
    runs = [
        run_simulate(
            trace=str(path),
            policy="turboserve",
            profile=str(profile),
            initial_gpus=1,
            forecast=forecast_options("ets", 30.0, 0.5, PERIOD),
        )
        for _ in range(2)
    ]
    for r in runs:
        r["forecast"].pop("fit_s")
        r["policy_config"]["forecast"].pop("fit_s")
        for key in ("scheduler_ms_mean", "scheduler_ms_p99", "scheduler_ms_max"):
            r.pop(key)
    assert runs[0] == runs[1]
    block = runs[0]["forecast"]
    assert block["forecast"] == "ets"
    assert block["gpu_seconds_added_by_floor"] == pytest.approx(
        runs[0]["gpu_seconds"] - block["without_floor"]["gpu_seconds"], abs=1e-3
    )


@pytest.mark.parametrize(
    ("args", "flag"),
    [
        (("bogus", 30.0, 0.5, 600.0), "--forecast"),
        (("ets", 0.0, 0.5, 600.0), "--forecast-slot-s"),
        (("ets", float("nan"), 0.5, 600.0), "--forecast-slot-s"),
        (("ets", 30.0, -1.0, 600.0), "--forecast-sigma"),
        (("seasonal-naive", 30.0, 0.5, 10.0), "--forecast-season-s"),
    ],
)
def test_bad_forecast_values_name_the_flag(args, flag):
    with pytest.raises(CliError) as info:
        forecast_options(*args)
    assert str(info.value).startswith(flag + ":")


def test_commands_reject_bad_forecast_flags(tmp_path):
    path = tmp_path / "t.jsonl"
    write_trace(path, periodic_trace(1), {"name": "t", "duration_s": 400.0})
    with pytest.raises(CommandError, match="--forecast: must be one of"):
        call_command("simulate", "--trace", str(path), "--forecast", "arima", "--json")
    with pytest.raises(CommandError, match="--forecast-slot-s"):
        call_command("simulate_compare", "--trace", str(path), "--forecast", "ets", "--forecast-slot-s", "-5")
    with pytest.raises(CommandError, match="--forecast: applies to --policy turboserve only"):
        call_command("simulate", "--trace", str(path), "--policy", "lag", "--forecast", "ets")


def test_compare_with_forecast_runs_turboserve_with_and_without_the_floor(tmp_path):
    path = tmp_path / "t.jsonl"
    write_trace(path, periodic_trace(2), {"name": "t", "duration_s": 3 * PERIOD})
    out = run_compare(
        trace=str(path),
        profile="h20-1.3b",
        max_gpus=4,
        initial_gpus=1,
        policies=["turboserve"],
        forecast=forecast_options("last-value"),
    )
    assert list(out["policies"]) == ["turboserve-forecast", "turboserve"]
    assert out["policies"]["turboserve-forecast"]["forecast"]["forecast"] == "last-value"
    assert "turboserve" in out["reduction_vs"]
