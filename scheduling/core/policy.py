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


# Built-in names → the classes they stand for (resolved on use: the classes import this module).
# What a policy is — static, tunable by ρ̂ — is a class attribute, read the same way for custom paths.
BUILTIN = {
    "base": "scheduling.core.baselines:BasePolicy",
    "lag": "scheduling.core.baselines:LeastLoadedPolicy",
    "mag": "scheduling.core.baselines:MemoryAwarePolicy",
    "turboserve": "scheduling.core.turboserve:TurboServePolicy",
    "turboserve-no-migration": "scheduling.core.turboserve:TurboServeNoMigration",
    "turboserve-no-autoscale": "scheduling.core.turboserve:TurboServeNoAutoscale",
    "turboserve-paper": "scheduling.core.turboserve:TurboServePaper",
    "turboserve-forecast": "scheduling.core.forecast_floor:ForecastTurboServe",
}
BUILTIN_POLICIES = tuple(BUILTIN)


def resolve_policy_class(name: str) -> Any:
    """A built-in name, or a ``package.module:ClassName`` path to a ``Policy`` subclass."""
    path = BUILTIN.get(name, name)
    if ":" not in path:
        raise PolicyError(
            f"unknown policy {name!r}: use one of {', '.join(BUILTIN_POLICIES)} or package.module:ClassName"
        )
    try:
        target = pkgutil.resolve_name(path)
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
    return bool(resolve_policy_class(name).static)


def accepts_rho_hat(name: str) -> bool:
    """Autoscalers whose target utilisation ρ̂ a comparison may search."""
    return bool(resolve_policy_class(name).accepts_rho_hat)
