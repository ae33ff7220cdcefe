"""Spare capacity for what arrives while a scale-out boots (issue 27): one pure rule.

A GPU asked for now serves only after the scale-out delay — boot plus the weights from wherever the
pool has them (``scheduling.core.provisioning``). Sessions that activate in that delay land on the
GPUs already there, and those bursts are what the worst-case latency measures (DESIGN.md,
"Scheduling"). So the autoscaler keeps free capacity, at K, for the net activations expected within
one delay: their drift over the delay plus a margin of ``margin_z`` standard deviations of the
observed per-bin counts (independent bins: the spread grows with √bins), never below ``floor``.

Two ways to feed the rule (``SPARE_POLICY``):

* ``off`` — the headroom TurboServe had before: the delay is the type's stated constant, the margin
  is the policy's ``headroom_z`` and the spare is added to N_req before dividing by ρ̂;
* ``boot-aware`` — the delay is the one the platform predicts for its next scale-out (the scale
  plan's delay of the last one on the pool's path, or the measured boot of the last worker; the
  type's constant only before any), the margin and floor are the settings, and the spare is free
  capacity at K: the pool needs max(N_req/ρ̂, N_req + spare), since the slack ρ̂ already leaves
  counts toward it.

The rule returns the target and a small explanation (``SpareTarget.to_json``) that the live loop
records with each decision and the console shows. Released by the normal scale-in rules: the
target is part of the need that scale-in keeps.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

SPARE_POLICIES = ("off", "boot-aware")
# The one-sided 95 % quantile of a normal: spares cover the activations of 19 delays in 20 when the
# per-bin counts are normal. A stated coverage, not a value fitted to a result.
DEFAULT_MARGIN_Z = 1.645


@dataclass(frozen=True, slots=True)
class SpareInputs:
    """What the rule sees. ``mean_per_bin``/``std_per_bin``: net activations (activations minus
    ends of active periods) per detector bin of ``bin_s`` seconds over the detector's window;
    ``delay_s``: the scale-out delay the spares must cover and ``delay_source`` where it came from
    (``stated``: the type's constant; ``predicted``: the platform's last scale-out); ``job_gpus``:
    the one-shot jobs' backlog demand in GPUs, counted beside the spares (shown, not added twice)."""

    policy: str
    delay_s: float
    delay_source: str
    bin_s: float
    mean_per_bin: float
    std_per_bin: float
    margin_z: float
    floor: float
    job_gpus: float = 0.0

    def __post_init__(self) -> None:
        if self.policy not in SPARE_POLICIES:
            raise ValueError(f"spare policy must be one of {', '.join(SPARE_POLICIES)}, got {self.policy!r}")
        for name in ("delay_s", "bin_s", "std_per_bin", "margin_z", "floor", "job_gpus"):
            value = getattr(self, name)
            if not (math.isfinite(value) and value >= 0):
                raise ValueError(f"spare input {name} must be a finite number >= 0, got {value!r}")
        if self.bin_s <= 0:
            raise ValueError("spare input bin_s must be > 0")
        if not math.isfinite(self.mean_per_bin):
            raise ValueError("spare input mean_per_bin must be finite")


@dataclass(frozen=True, slots=True)
class SpareTarget:
    """The rule's answer: ``expected`` (drift over the delay), ``margin`` (z·σ·√bins), ``target``
    (their sum, at least ``floor``), all in load units (sessions of load 1) at K, and ``why``."""

    inputs: SpareInputs
    expected: float
    margin: float
    target: float
    why: str

    def to_json(self) -> dict[str, Any]:
        i = self.inputs
        return {
            "policy": i.policy,
            "target": round(self.target, 4),
            "expected": round(self.expected, 4),
            "margin": round(self.margin, 4),
            "delay_s": round(i.delay_s, 4),
            "delay_source": i.delay_source,
            "bin_s": i.bin_s,
            "mean_per_bin": round(i.mean_per_bin, 4),
            "std_per_bin": round(i.std_per_bin, 4),
            "margin_z": i.margin_z,
            "floor": i.floor,
            "job_gpus": round(i.job_gpus, 4),
            "why": self.why,
        }


def spare_target(inputs: SpareInputs) -> SpareTarget:
    """Expected net activations within one delay plus z standard deviations, at least the floor."""
    bins_ahead = inputs.delay_s / inputs.bin_s
    # Only a positive drift adds load: a falling trend frees capacity by itself.
    expected = max(0.0, inputs.mean_per_bin) * bins_ahead
    margin = inputs.margin_z * inputs.std_per_bin * math.sqrt(bins_ahead)
    raw = expected + margin
    target = max(inputs.floor, raw)
    if target > raw:
        reason = f"floor {inputs.floor:g} above expected {expected:.2f} + margin {margin:.2f}"
    else:
        reason = (
            f"{expected:.2f} expected + {margin:.2f} margin ({inputs.margin_z:g}σ) net activations "
            f"within a {inputs.delay_s:.1f} s scale-out ({inputs.delay_source})"
        )
    return SpareTarget(inputs=inputs, expected=expected, margin=margin, target=target, why=reason)
