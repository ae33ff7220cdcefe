"""Policies used only by the reproduction (subclasses of the TurboServe policy; the core is untouched).

* :class:`WindowRhoPolicy` — TurboServe with ρ̂ fixed per time window (Tables 8–10 oracle replays);
* :class:`RecordingTurboServe` — TurboServe that records the ρ̂ it used at each decision;
* :class:`NoHeadroom`, :class:`NoCooldown` (and the built-in ``turboserve-paper``) — TurboServe with one or all of the
  beyond-the-paper extensions switched off, and :class:`WithScaleInWindow` with the opt-in scale-in
  stabilisation window switched on, as named policies so that the §7.1 comparison
  (``scheduling.sim.compare``) can search their cheapest SLO-meeting configuration like any other.
  They are reachable by dotted path (``scheduling.reproduce.policies:NoHeadroom``);
* :class:`BootAwareSpares` — TurboServe with boot-aware spare capacity (issue 27).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from scheduling.core.detector import fixed_table
from scheduling.core.turboserve import TurboServePolicy
from scheduling.core.types import Decision, Event, Snapshot


class RecordingTurboServe(TurboServePolicy):
    """TurboServe (adaptive table by default) that keeps ``(time, ρ̂, level, target budget)`` of every
    decision."""

    def __init__(self, **kwargs: Any):
        super().__init__(**kwargs)
        self.trail: list[tuple[float, float, int, int]] = []

    def decide(self, snapshot: Snapshot, event: Event) -> Decision:
        decision = super().decide(snapshot, event)
        s = decision.signals
        self.trail.append(
            (snapshot.time, float(s.rho_hat), int(s.volatility_level), int(decision.target_budget))
        )
        return decision


class WindowRhoPolicy(RecordingTurboServe):
    """TurboServe whose target utilisation is ``rhos[w]`` during window ``w`` (``window_s`` long).

    Everything else — placement, migration, autoscaler, headroom, cooldown — is the TurboServe policy,
    so an oracle built on it differs from the online mapping only in how ρ̂ is chosen.
    """

    name = "turboserve-window-rho"

    def __init__(self, *, rhos: Sequence[float] = (0.8,), window_s: float = 30.0, **kwargs: Any):
        self.rhos = [float(r) for r in rhos]
        self.window_s = float(window_s)
        self._tables = {r: fixed_table(r) for r in sorted(set(self.rhos))}
        kwargs.pop("rho_hat", None)
        super().__init__(rho_hat=self.rhos[0], **kwargs)

    def _rho_at(self, time: float) -> float:
        w = min(len(self.rhos) - 1, max(0, math.floor(time / self.window_s + 1e-9)))
        return self.rhos[w]

    def decide(self, snapshot: Snapshot, event: Event) -> Decision:
        table = self._tables[self._rho_at(snapshot.time)]
        self.table = table
        self.detector.table = table
        return super().decide(snapshot, event)

    def describe(self) -> dict[str, Any]:
        return {**super().describe(), "rhos": self.rhos, "window_s": self.window_s}


class NoHeadroom(TurboServePolicy):
    name = "turboserve-no-headroom"

    def __init__(self, **kwargs: Any):
        super().__init__(headroom=False, name=self.name, **kwargs)


class NoCooldown(TurboServePolicy):
    name = "turboserve-no-cooldown"

    def __init__(self, **kwargs: Any):
        super().__init__(cooldown_s=0.0, name=self.name, **kwargs)


class WithScaleInWindow(TurboServePolicy):
    """TurboServe with the scale-in stabilisation window on (one provisioning delay; off by default)."""

    name = "turboserve-scale-in-window"

    def __init__(self, **kwargs: Any):
        super().__init__(scale_in_window_s=None, name=self.name, **kwargs)


class BootAwareSpares(TurboServePolicy):
    """TurboServe with boot-aware spare capacity (issue 27, ``scheduling.core.spares``) at its
    default margin, as ``SPARE_POLICY=boot-aware`` runs it live."""

    name = "turboserve-spares"

    def __init__(self, **kwargs: Any):
        super().__init__(spares="boot-aware", name=self.name, **kwargs)


BOOT_AWARE_SPARES = "scheduling.reproduce.policies:BootAwareSpares"
NO_HEADROOM = "scheduling.reproduce.policies:NoHeadroom"
NO_COOLDOWN = "scheduling.reproduce.policies:NoCooldown"
WITH_SCALE_IN_WINDOW = "scheduling.reproduce.policies:WithScaleInWindow"
PAPER_LOOP = "turboserve-paper"
