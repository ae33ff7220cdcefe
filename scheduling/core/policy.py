"""The policy contract and the registry of policies (built-in names and ``package.module:ClassName``).

A policy is what the live scheduler task and the simulator both call:

* ``decide(snapshot, event) -> Decision`` is called once per event (session arrive/active/idle/
  depart, periodic tick, GPU ready/failed) with the cluster *after* the event's bookkeeping
  (a departed session is already gone; a newly active one has ``alpha == 1`` and no GPU). It must be
  deterministic: the same state_dict, snapshot and event give the same decision. No wall clock,
  no randomness unless seeded from the inputs, no iteration over sets.
* Every active session must end up executing (``assign``/kept) or in ``queue``; a decision may never
  put more resident sessions on a GPU than its hard memory limit, never assign to a GPU that is not
  ``ready``, and may ``release`` only GPUs left with no resident session.
* ``state_dict()`` returns JSON-serialisable internal state (sliding windows, cooldown timers);
  ``load_state_dict()`` restores it, so the live system can persist it between Celery runs.
"""

from __future__ import annotations

import pkgutil
from typing import Any

from .types import Decision, Event, Snapshot


class Policy:
    """Base class. Subclasses set ``name`` and implement :meth:`decide`."""

    name = "policy"
    # Comparisons (compare.py) search a fixed budget for static policies and, for autoscalers that
    # accept a ``rho_hat`` keyword, a grid of target utilisations.
    static = False
    accepts_rho_hat = False

    def decide(self, snapshot: Snapshot, event: Event) -> Decision:  # pragma: no cover - interface
        raise NotImplementedError

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        return None

    def describe(self) -> dict[str, Any]:
        """Configuration worth recording next to results (JSON-serialisable)."""
        return {"name": self.name}


class PolicyError(ValueError):
    pass


def _builtin() -> dict[str, Any]:
    from .baselines import BasePolicy, LeastLoadedPolicy, MemoryAwarePolicy
    from .turboserve import TurboServePolicy

    return {
        "base": BasePolicy,
        "lag": LeastLoadedPolicy,
        "mag": MemoryAwarePolicy,
        "turboserve": TurboServePolicy,
        "turboserve-no-migration": lambda **kw: TurboServePolicy(
            migration=False, name="turboserve-no-migration", **kw
        ),
        "turboserve-no-autoscale": lambda **kw: TurboServePolicy(
            autoscale=False, name="turboserve-no-autoscale", **kw
        ),
        "turboserve-paper": lambda **kw: TurboServePolicy(
            headroom=False,
            cooldown_s=0.0,
            release_grace_s=0.0,
            scale_in_window_s=0.0,
            name="turboserve-paper",
            **kw,
        ),
    }


BUILTIN_POLICIES = (
    "base",
    "lag",
    "mag",
    "turboserve",
    "turboserve-no-migration",
    "turboserve-no-autoscale",
    "turboserve-paper",
)
STATIC_POLICIES = ("base", "lag", "mag", "turboserve-no-autoscale")


def resolve_policy_class(name: str) -> Any:
    """A built-in name, or a ``package.module:ClassName`` path to a ``Policy`` subclass."""
    builtin = _builtin()
    if name in builtin:
        return builtin[name]
    if ":" not in name:
        raise PolicyError(
            f"unknown policy {name!r}: use one of {', '.join(BUILTIN_POLICIES)} or package.module:ClassName"
        )
    try:
        target = pkgutil.resolve_name(name)
    except ImportError as exc:
        raise PolicyError(f"cannot import policy {name!r}: {exc}") from exc
    except (AttributeError, ValueError) as exc:
        raise PolicyError(f"policy {name!r} does not resolve: {exc}") from exc
    if not (isinstance(target, type) and issubclass(target, Policy)):
        raise PolicyError(f"{name!r} is not a subclass of scheduling.core.policy.Policy")
    return target


def make_policy(name: str, **kwargs: Any) -> Policy:
    """Instantiate a policy by built-in name or dotted path, passing only kwargs it accepts."""
    factory = resolve_policy_class(name)
    policy = factory(**kwargs)
    if not isinstance(policy, Policy):
        raise PolicyError(f"{name!r} did not build a Policy")
    return policy


def is_static(name: str) -> bool:
    """Static policies run a fixed budget; comparisons search that budget."""
    if name in BUILTIN_POLICIES:
        return name in STATIC_POLICIES
    return bool(getattr(resolve_policy_class(name), "static", False))


def accepts_rho_hat(name: str) -> bool:
    if name in BUILTIN_POLICIES:
        return name.startswith("turboserve")
    return bool(getattr(resolve_policy_class(name), "accepts_rho_hat", False))
