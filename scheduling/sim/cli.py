"""Pure functions behind the management commands (``simulate``, ``simulate_compare``,
``profile_volatility``). Commands parse flags, call one of these, and print.

Errors about a flag raise :class:`CliError` naming it; commands turn that into ``CommandError``.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

from scheduling.core.gpu_profiles import ProfileError, load_profiles
from scheduling.core.jobs.job_profiles import JobProfileError
from scheduling.core.jobs.solver import ROUND_SOLVERS
from scheduling.core.policy import PolicyError, is_static, make_policy
from scheduling.core.provisioning import FIXED, SCALE_OUT_PATHS, with_path
from scheduling.core.scaleplan import ScalePlanError

from .compare import DEFAULT_POLICIES, compare_policies
from .jobs.cosim import JobConfig, job_config
from .simulator import SimConfig, SimulationError, simulate
from .traces import TraceError, read_mixed_trace, read_trace
from .viewers import viewer_rule

REQUIRED_RESULT_KEYS = (
    "policy",
    "trace",
    "chunks",
    "worst_chunk_latency_ms",
    "p99_chunk_latency_ms",
    "mean_chunk_latency_ms",
    "slo_ms",
    "slo_pass_rate",
    "gpu_cost_usd",
    "gpu_seconds",
    "peak_gpus",
    "migrations",
    "scale_actions",
    "max_wait_ms",
    "scheduler_ms_mean",
    "scheduler_ms_p99",
    "scheduler_ms_max",
)


class CliError(ValueError):
    def __init__(self, flag: str, message: str):
        super().__init__(f"--{flag}: {message}")
        self.flag = flag


def _progress_bar(total: int, desc: str, enabled: bool):
    if not enabled:
        return None
    from tqdm import tqdm

    return tqdm(total=total, desc=desc, unit="run", leave=False)


def parse_options(items: Sequence[str]) -> dict[str, Any]:
    """``["headroom=false", "cooldown_s=0"]`` → keyword options for ``make_policy`` (JSON values)."""
    options: dict[str, Any] = {}
    for item in items:
        key, sep, raw = item.partition("=")
        if not sep or not key.isidentifier():
            raise CliError("option", f"expected key=value, got {item!r}")
        try:
            options[key] = json.loads(raw)
        except json.JSONDecodeError:
            options[key] = raw
    return options


def _make(policy: str, options: dict[str, Any], flag: str = "policy"):
    try:
        return make_policy(policy, **options)
    except PolicyError as exc:
        raise CliError(flag, str(exc)) from exc
    except TypeError as exc:
        raise CliError("option", f"{policy}: {exc}") from exc


FORECAST_CHOICES = ("ets", "seasonal-naive", "last-value")


def forecast_options(
    forecast: str | None, slot_s: float = 30.0, sigma: float = 0.5, season_s: float = 600.0
) -> dict[str, Any] | None:
    """Validated keyword options of ``turboserve-forecast`` from the ``--forecast*`` flags (None = off)."""
    if forecast is None:
        return None
    if forecast not in FORECAST_CHOICES:
        raise CliError("forecast", f"must be one of {', '.join(FORECAST_CHOICES)}, got {forecast!r}")
    if not (slot_s > 0 and math.isfinite(slot_s)):
        raise CliError("forecast-slot-s", f"must be a positive number, got {slot_s!r}")
    if not (sigma >= 0 and math.isfinite(sigma)):
        raise CliError("forecast-sigma", f"must be a number >= 0, got {sigma!r}")
    if not (season_s >= slot_s and math.isfinite(season_s)):
        raise CliError("forecast-season-s", f"must be a number >= --forecast-slot-s, got {season_s!r}")
    return {
        "forecast": forecast,
        "forecast_slot_s": float(slot_s),
        "forecast_sigma": float(sigma),
        "forecast_season_s": float(season_s),
    }


def add_boot_arguments(parser: Any) -> None:
    """The flags that replace how long a new GPU takes to serve, shared by ``simulate`` and
    ``simulate_compare`` (the what-if that decides the scheduler's value: docs/results §9)."""
    parser.add_argument(
        "--provisioning-delay-s",
        type=float,
        default=None,
        help="replace every GPU type's provisioning delay (request → ready), e.g. 0 for instant attach",
    )
    parser.add_argument(
        "--scale-out",
        choices=SCALE_OUT_PATHS,
        default=None,
        help="where new GPUs load weights from; the delay is boot + the scale plan's load time from the "
        "pool's state at each scale-out (default: each profile's own path)",
    )


def add_forecast_arguments(parser: Any) -> None:
    """The ``--forecast*`` flags shared by ``simulate`` and ``simulate_compare`` (argparse parser)."""
    parser.add_argument(
        "--forecast",
        default=None,
        help="TurboServe with a predictive floor (TORTA Eq. 6) from this demand forecast: "
        "ets | seasonal-naive | last-value (default: off)",
    )
    parser.add_argument("--forecast-slot-s", type=float, default=30.0, help="forecast slot length (s)")
    parser.add_argument("--forecast-sigma", type=float, default=0.5, help="Eq. 6 safety factor σ")
    parser.add_argument(
        "--forecast-season-s", type=float, default=600.0, help="season of the seasonal-naive forecast (s)"
    )


def load_trace(path: str) -> tuple[dict, list]:
    try:
        return read_trace(path)
    except FileNotFoundError as exc:
        raise CliError("trace", f"no such file {path}") from exc
    except TraceError as exc:
        raise CliError("trace", f"{path}: {exc}") from exc


def load_mixed_trace(path: str, *, viewer_events: bool = False) -> tuple[dict, list, list]:
    try:
        return read_mixed_trace(path, viewer_events=viewer_events)
    except FileNotFoundError as exc:
        raise CliError("trace", f"no such file {path}") from exc
    except TraceError as exc:
        raise CliError("trace", f"{path}: {exc}") from exc


def build_job_config(job_policy: str, job_profiles: Sequence[str] = (), round_steps: int = 5) -> JobConfig:
    """The job side of a simulation (issue 14): ``--job-policy``, ``--job-profile``, ``--job-round-steps``."""
    if job_policy not in ROUND_SOLVERS:
        raise CliError("job-policy", f"unknown job policy {job_policy!r} (known: {', '.join(ROUND_SOLVERS)})")
    if round_steps < 1:
        raise CliError("job-round-steps", "must be >= 1")
    try:
        return job_config(job_policy, tuple(job_profiles), round_steps)
    except JobProfileError as exc:
        raise CliError("job-profile", str(exc)) from exc


def build_config(
    *,
    profile: str = "h20-1.3b",
    max_gpus: int = 16,
    min_gpus: int = 1,
    initial_gpus: int | None = None,
    slo_ms: float | None = None,
    tick_s: float = 5.0,
    duration_s: float | None = None,
    provisioning_delay_s: float | None = None,
    scale_out: str | None = None,
    stream_period: str | None = None,
) -> SimConfig:
    try:
        profiles = load_profiles(profile)
    except ProfileError as exc:
        raise CliError("profile", str(exc)) from exc
    if provisioning_delay_s is not None:
        # What-if for a faster (pre-staged) or slower scale-out: every GPU type's request → ready time.
        if not (provisioning_delay_s >= 0 and math.isfinite(provisioning_delay_s)):
            raise CliError("provisioning-delay-s", "must be a number >= 0")
        if scale_out is not None:
            raise CliError("scale-out", "give either --scale-out or --provisioning-delay-s, not both")
        # A constant delay replaces whatever path the profile has.
        profiles = [
            replace(
                p,
                provisioning_delay_s=float(provisioning_delay_s),
                scale_out=with_path(p.scale_out, FIXED) if p.scale_out is not None else None,
            )
            for p in profiles
        ]
    if scale_out is not None:
        if scale_out not in SCALE_OUT_PATHS:
            raise CliError("scale-out", f"must be one of {', '.join(SCALE_OUT_PATHS)}, got {scale_out!r}")
        bare = [p.name for p in profiles if p.scale_out is None]
        if bare:
            raise CliError(
                "scale-out",
                f"profile(s) {', '.join(bare)} have no scale_out model (boot, weights, links; "
                "docs/scheduling.md): the delay by source cannot be computed",
            )
    if max_gpus < 1:
        raise CliError("max-gpus", "must be >= 1")
    if min_gpus < 0 or min_gpus > max_gpus:
        raise CliError("min-gpus", "must be between 0 and --max-gpus")
    if initial_gpus is not None and not 0 <= initial_gpus <= max_gpus:
        raise CliError("initial-gpus", "must be between 0 and --max-gpus")
    if slo_ms is not None and not (slo_ms > 0 and math.isfinite(slo_ms)):
        raise CliError("slo-ms", "must be a positive number")
    if tick_s < 0:
        raise CliError("tick-s", "must be >= 0")
    return SimConfig(
        stream_period_ms=stream_period_ms(
            stream_period, slo_ms if slo_ms is not None else profiles[0].default_slo_ms
        ),
        profiles=profiles,
        initial_gpus=initial_gpus if initial_gpus is not None else min(8, max_gpus),
        min_gpus=min_gpus,
        max_gpus=max_gpus,
        slo_ms=slo_ms,
        tick_s=tick_s,
        duration_s=duration_s,
        scale_out=scale_out,
    )


def stream_period_ms(value: str | None, slo_ms: float) -> float | None:
    """``--stream-period-ms``: a number of ms, or ``slo`` (a chunk plays for as long as it may take
    to make: the SLO); None keeps the streams' steps back to back."""
    if value is None:
        return None
    if value == "slo":
        return float(slo_ms)
    try:
        period = float(value)
    except ValueError:
        raise CliError("stream-period-ms", f"a number of ms or 'slo', got {value!r}") from None
    if not (period > 0 and math.isfinite(period)):
        raise CliError("stream-period-ms", f"must be > 0, got {value!r}")
    return period


def run_simulate(
    *,
    trace: str,
    policy: str,
    profile: str = "h20-1.3b",
    max_gpus: int = 16,
    min_gpus: int = 1,
    initial_gpus: int | None = None,
    budget: int | None = None,
    slo_ms: float | None = None,
    tick_s: float = 5.0,
    plot: str | None = None,
    progress: bool = False,
    options: Sequence[str] = (),
    provisioning_delay_s: float | None = None,
    scale_out: str | None = None,
    forecast: dict[str, Any] | None = None,
    job_policy: str = "genserve",
    job_profiles: Sequence[str] = (),
    job_round_steps: int = 5,
    viewer_grace_s: float | None = None,
    idle_timeout_s: float | None = None,
    stream_period: str | None = None,
    tenant_weights: Sequence[str] = (),
) -> dict[str, Any]:
    """Simulate one policy on one trace. Static policies run ``budget`` GPUs (default --max-gpus).

    ``viewer_grace_s`` / ``idle_timeout_s`` apply the platform's viewer rule to the trace's
    ``viewer_leave``/``viewer_return`` marks (``scheduling.sim.viewers``): a session whose viewer is
    gone goes idle after the grace and departs after the timeout; the result gains ``viewer_rule``.

    A trace with one-shot job events (docs/traces.md) runs them beside the streams under
    ``job_policy`` (docs/scheduling.md, "One-shot jobs"); the result then gains a ``jobs`` object.
    Without job events the result is exactly the stream-only one. ``stream_period``
    (``--stream-period-ms``: ms or ``slo``) paces each GPU's steps at one chunk period, so jobs also
    step beside the streams in the slack they leave (``contracts.coserve``).

    ``scale_out`` (disk / host-cache / peer) computes each new GPU's delay from the pool's state by
    the scale planner; ``None`` keeps each profile's own path. The result's ``scale_out`` summarises
    the delays every scale-out got and ``scale_out_events`` lists them.

    ``tenant_weights`` (``--tenant-weight name=weight``, repeatable) are the fair share's weights of
    the tenants the trace's arrivals name (docs/tenants.md); a trace with tenants, or weights given,
    runs the fair share and the result gains ``tenants`` (GPU-seconds, share, weight's share).

    ``forecast`` (from :func:`forecast_options`) runs TurboServe with the predictive floor and, under
    the same config, without it; the result is the floor's run plus a ``forecast`` block (accuracy,
    fit time, the floor's GPU-seconds and the run without the floor)."""
    if forecast is not None and policy != "turboserve":
        raise CliError("forecast", f"applies to --policy turboserve only, got {policy!r}")
    viewer_rule_on = viewer_grace_s is not None or idle_timeout_s is not None
    for flag, value in (("viewer-grace-s", viewer_grace_s), ("idle-timeout-s", idle_timeout_s)):
        if value is not None and not (math.isfinite(value) and value > 0):
            raise CliError(flag, f"must be a number of seconds > 0, got {value}")
    meta, events, job_events = load_mixed_trace(trace, viewer_events=viewer_rule_on)
    viewer_report = None
    if viewer_rule_on:
        events, viewer_report = viewer_rule(events, grace_s=viewer_grace_s, timeout_s=idle_timeout_s)
    jobs = build_job_config(job_policy, job_profiles, job_round_steps)
    if job_events and forecast is not None:
        raise CliError("forecast", "the forecast comparison takes session-only traces")
    config = build_config(
        profile=profile,
        max_gpus=max_gpus,
        min_gpus=min_gpus,
        initial_gpus=initial_gpus,
        slo_ms=slo_ms,
        tick_s=tick_s,
        duration_s=meta.get("duration_s"),
        provisioning_delay_s=provisioning_delay_s,
        scale_out=scale_out,
        stream_period=stream_period,
    )
    if tenant_weights:
        config.tenant_weights = parse_tenant_weights(tenant_weights)
    policy_options = parse_options(options)
    pol = _make(policy, policy_options)
    if forecast is not None:
        pol = _make("turboserve-forecast", {**policy_options, **forecast})
    if is_static(policy):
        b = budget if budget is not None else max_gpus
        if not 1 <= b <= max_gpus:
            raise CliError("budget", "must be between 1 and --max-gpus")
        config.initial_gpus = config.min_gpus = b
    name = str(meta.get("name") or Path(trace).stem)
    bar = _progress_bar(len(events), f"simulate {policy}", progress)
    try:
        result = simulate(
            events,
            pol,
            config,
            trace_name=name,
            progress=bar.update if bar else None,
            job_events=job_events,
            jobs=jobs,
        )
    except JobProfileError as exc:
        raise CliError("trace", f"{trace}: {exc}") from exc
    except SimulationError as exc:
        raise CliError("policy", f"decision rejected by the simulator: {exc}") from exc
    except ScalePlanError as exc:
        raise CliError("scale-out", str(exc)) from exc
    finally:
        if bar:
            bar.close()
    out = result.to_json()
    out["provisioning_delay_s"] = {p.name: p.provisioning_delay_s for p in config.profiles}
    if viewer_report is not None:
        out["viewer_rule"] = {
            "grace_s": viewer_grace_s,
            "idle_timeout_s": idle_timeout_s,
            **viewer_report.to_json(),
        }
    if forecast is not None:
        try:
            plain = simulate(events, _make(policy, policy_options), config, trace_name=name)
        except SimulationError as exc:
            raise CliError("policy", f"decision rejected by the simulator: {exc}") from exc
        block = dict(out["policy_config"]["forecast"])
        block["gpu_seconds_added_by_floor"] = round(result.gpu_seconds - plain.gpu_seconds, 3)
        block["gpu_cost_added_usd"] = round(result.gpu_cost_usd - plain.gpu_cost_usd, 4)
        block["without_floor"] = {
            key: getattr(plain, key)
            for key in (
                "worst_chunk_latency_ms",
                "p99_chunk_latency_ms",
                "slo_pass_rate",
                "gpu_cost_usd",
                "gpu_seconds",
                "peak_gpus",
                "scale_actions",
            )
        }
        block["without_floor_timeline"] = plain.timeline
        out["forecast"] = block
    if plot:
        from .plots import plot_timeline

        plot_timeline(out, plot)
        out["plot"] = str(plot)
    return out


def parse_tenant_weights(values: Sequence[str]) -> dict[str, float]:
    """``name=weight`` pairs (weight a finite number > 0) → weights by tenant; ``CliError`` otherwise."""
    weights: dict[str, float] = {}
    for value in values:
        name, sep, text = value.partition("=")
        try:
            weight = float(text)
        except ValueError:
            weight = math.nan
        if not sep or not name or not (math.isfinite(weight) and weight > 0):
            raise CliError("tenant-weight", f"must be name=weight with a weight > 0, got {value!r}")
        weights[name] = weight
    return weights


def format_simulate(result: dict[str, Any]) -> str:
    lines = [f"{result['policy']} on {result['trace']} ({result['profile']}, SLO {result['slo_ms']:.0f} ms)"]
    for key in REQUIRED_RESULT_KEYS[2:]:
        lines.append(f"  {key:<26} {result[key]}")
    for name, figures in sorted((result.get("tenants") or {}).items()):
        lines.append(
            f"  tenant {name:<19} {figures['gpu_seconds']} GPU-s, {figures['share']:.1%} "
            f"(weight's share {figures['weight_share']:.1%})"
        )
    return "\n".join(lines)


def run_compare(
    *,
    trace: str,
    profile: str = "h20-1.3b",
    max_gpus: int = 16,
    min_gpus: int = 1,
    initial_gpus: int | None = None,
    slo_ms: float | None = None,
    policies: Sequence[str] = DEFAULT_POLICIES,
    plot: str | None = None,
    progress: bool = False,
    capacity: str = "slo",
    provisioning_delay_s: float | None = None,
    scale_out: str | None = None,
    forecast: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """``forecast`` (from :func:`forecast_options`) adds ``turboserve-forecast`` (TurboServe with the
    predictive floor) as the reference, next to ``turboserve`` without it, under the same protocol."""
    reference = "turboserve"
    policy_options: dict[str, dict[str, Any]] = {}
    if forecast is not None:
        reference = "turboserve-forecast"
        policies = [reference, *[p for p in policies if p != reference]]
        if "turboserve" not in policies:
            policies.insert(1, "turboserve")
        policy_options[reference] = forecast
    if capacity not in ("slo", "profile"):
        raise CliError("capacity", f"{capacity!r} is not 'slo' or 'profile'")
    meta, events = load_trace(trace)
    config = build_config(
        profile=profile,
        max_gpus=max_gpus,
        min_gpus=min_gpus,
        initial_gpus=initial_gpus,
        slo_ms=slo_ms,
        duration_s=meta.get("duration_s"),
        provisioning_delay_s=provisioning_delay_s,
        scale_out=scale_out,
    )
    for p in policies:
        try:
            make_policy(p)
        except PolicyError as exc:
            raise CliError("policies", str(exc)) from exc
    if capacity == "slo" and slo_ms is not None:
        for spec in config.profiles:
            try:
                spec.capacity_for_slo(slo_ms)
            except ValueError as exc:
                raise CliError("slo-ms", str(exc)) from exc
    bar = _progress_bar(0, "compare", progress)
    try:
        out = compare_policies(
            events,
            config,
            trace=str(meta.get("name") or Path(trace).stem),
            slo_ms=slo_ms,
            policies=policies,
            step=(lambda label: (bar.set_postfix_str(label), bar.update(1))) if bar else None,
            capacity=capacity,
            reference=reference,
            policy_options=policy_options,
        )
    except SimulationError as exc:
        raise CliError("policies", f"decision rejected by the simulator: {exc}") from exc
    finally:
        if bar:
            bar.close()
    out["profile"] = profile
    out["max_gpus"] = max_gpus
    out["provisioning_delay_s"] = {p.name: p.provisioning_delay_s for p in config.profiles}
    if plot:
        from .plots import plot_comparison

        plot_comparison(out, plot)
        out["plot"] = str(plot)
    return out


def format_compare(comparison: dict[str, Any]) -> str:
    lines = [f"{comparison['trace']}: SLO {comparison['slo_ms']:.0f} ms"]
    lines.append(f"  {'policy':<26} {'cost@SLO $':>11} {'worst@cost ms':>14} {'Δlat %':>8} {'Δcost %':>8}")
    for name, entry in comparison["policies"].items():
        red = comparison["reduction_vs"].get(name, {})
        cost = entry.get("cost_at_slo_usd")
        lines.append(
            f"  {name:<26} {('-' if cost is None else f'{cost:.3f}'):>11} "
            f"{entry['worst_latency_at_matched_cost_ms']:>14.1f} "
            f"{_fmt(red.get('latency_pct')):>8} {_fmt(red.get('cost_pct')):>8}"
        )
    ref = next(iter(comparison["policies"]), "turboserve")
    lines.append(f"  Δ: {ref}'s reduction relative to that policy (positive = {ref} lower)")
    return "\n".join(lines)


def _fmt(x: float | None) -> str:
    return "-" if x is None else f"{x:.1f}"


def run_profile_volatility(
    *,
    out: str | None,
    profile: str = "paper-k5",
    max_gpus: int = 16,
    slo_ms: float | None = None,
    seed: int = 0,
    levels: int = 10,
    traces: Sequence[str] = (),
    segment_s: float = 60.0,
    progress: bool = False,
) -> dict[str, Any]:
    """Regenerate the volatility table: Table 5 segments by default, or segments cut from traces."""
    from .profiling import DEFAULT_RHO_GRID, profile_volatility_table

    config = build_config(profile=profile, max_gpus=max_gpus, min_gpus=1, slo_ms=slo_ms)
    slo = slo_ms if slo_ms is not None else config.profiles[0].default_slo_ms
    segments: list[tuple[dict, list]] = []
    if traces:
        for path in traces:
            meta, events = load_trace(path)
            segments.extend(_cut_segments(meta, events, segment_s, str(meta.get("name") or Path(path).stem)))
    else:
        from .generators import segment_family

        if not 1 <= levels <= 10:
            raise CliError("levels", "must be between 1 and 10")
        for level in range(1, levels + 1):
            meta, events = segment_family(level, seed)
            meta = {**meta, "name": f"level{level}"}
            segments.append((meta, events))
    bar = _progress_bar(len(segments) * len(DEFAULT_RHO_GRID), "profile", progress)
    try:
        table, rows = profile_volatility_table(
            segments, config, slo_ms=slo, step=bar.update if bar else None, policy_kwargs={}
        )
    finally:
        if bar:
            bar.close()
    data = table.to_json()
    data["profiled_segments"] = rows
    if out:
        Path(out).write_text(json.dumps(data, indent=2) + "\n")
    return data


def _cut_segments(meta: dict, events: list, segment_s: float, name: str) -> list[tuple[dict, list]]:
    """Each segment replays the trace from its start to the segment's end (so sessions exist)."""
    duration = float(meta.get("duration_s") or (events[-1].t if events else 0.0))
    out = []
    k = 0
    start = 0.0
    while start + segment_s <= duration + 1e-9:
        end = start + segment_s
        prefix = [e for e in events if e.t < end]
        out.append(
            (
                {
                    "name": f"{name}[{start:g},{end:g})",
                    "segment_start_s": start,
                    "segment_end_s": end,
                    "duration_s": end,
                },
                prefix,
            )
        )
        k += 1
        start = end
    return out
