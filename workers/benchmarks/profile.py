"""The scheduler's GPU profile (what ``scheduling/core/gpu_profiles.py`` loads) from measured figures.

One writer for every producer of a profile: ``profile_model`` (``workers.benchmarks.runtime``) and
the GPU check (``workers.benchmarks.gpucheck``). Pure Python and no third-party import, so the check
can write a profile on a machine that has torch and nothing else of ours (no Django, no psutil).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any


def latency_curve(measured: Iterable[tuple[int, float]]) -> list[list[float]]:
    """``[[batch, ms], ...]`` by batch, made non-decreasing with a running maximum: a noisy
    measurement must not tell the scheduler that more load is faster."""
    curve, running = [], 0.0
    for batch, ms in sorted(measured):
        running = max(running, float(ms))
        curve.append([int(batch), round(running, 3)])
    return curve


def capacity_within(curve: list[list[float]], slo_ms: float) -> int:
    """The largest measured batch whose per-chunk latency meets ``slo_ms`` (1 when none does)."""
    within = [int(batch) for batch, ms in curve if ms <= slo_ms]
    return max(within) if within else 1


def scheduler_profile(
    *,
    name: str,
    gpu_type: str,
    measured_ms: Iterable[tuple[int, float]],
    state_bytes: int,
    memory_limit_sessions: int,
    price_per_hour: float,
    provisioning_delay_s: float,
    host_link_gbps: float,
    source: str,
    max_batch: int | None = None,
    link_gbps: float | None = None,
    slo_ms: float | None = None,
) -> dict[str, Any]:
    """The profile JSON object (docs/runtime.md, "Profiling and benchmarking").

    ``measured_ms``: per-chunk latency (the step time: every session in a step gets one chunk) by
    batch size. ``capacity`` (K) is ``max_batch`` (default: the largest batch measured), or the
    largest batch within ``slo_ms`` when one is given.
    """
    curve = latency_curve(measured_ms)
    if len(curve) < 2:
        raise ValueError("a profile needs latency at two batch sizes at least")
    capacity = max_batch if max_batch is not None else int(curve[-1][0])
    if slo_ms is not None:
        capacity = capacity_within(curve, slo_ms)
    profile: dict[str, Any] = {
        "name": name,
        "gpu_type": gpu_type,
        "capacity": float(capacity),
        "memory_limit_sessions": int(memory_limit_sessions),
        "price_per_hour": float(price_per_hour),
        "provisioning_delay_s": round(float(provisioning_delay_s), 3),
        "latency_ms": curve,
        "state_bytes": int(state_bytes),
        "host_link_gbps": round(float(host_link_gbps), 3),
        "source": source,
    }
    if link_gbps is not None:
        profile["link_gbps"] = float(link_gbps)
    if slo_ms is not None:
        profile["slo_ms"] = float(slo_ms)
    return profile
