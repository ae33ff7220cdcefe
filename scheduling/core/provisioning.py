"""The provisioning delay as a model: boot, then the weights from wherever the pool has them.

A GPU requested at ``t`` serves from ``t + boot_s + load_s``: ``boot_s`` is the worker coming up
(process and interpreter, CUDA context, connection pool) and ``load_s`` is when the scale plan
(:mod:`scheduling.core.scaleplan`, BlitzScale §5.1) says its weights are complete. The plan is made
per scale-out from the pool's state at that moment — which GPUs already serve the model, where the
host copy is — by the same planner the live platform uses, so a batch of new GPUs shares chains and
a pool that has grown scales faster.

Scale-out paths (``--scale-out``):

* ``disk`` — every new GPU reads its own host's local storage (one NVMe read per host, forwarded
  over NVLink to the other new GPUs of that host);
* ``host-cache`` — the cluster's host copies (``host_copies``, BlitzScale §5.3's O(1) host caching)
  are the only sources, disk the fallback;
* ``peer`` — every GPU serving the model and the host copies are sources (BlitzScale's parameter
  pool), disk the fallback;
* ``fixed`` — not a path but the profile's stated constant ``provisioning_delay_s`` (the built-in
  profiles' own: a cold boot as DESIGN.md assumes it, container start and local load included).

GPUs are laid out on hosts in slots (``gpus_per_host`` per host, ``hosts_per_domain`` hosts per leaf
switch); a new GPU takes the lowest free slot of its type. Pure Python, no Django.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

from .scaleplan import Endpoint, ScalePlan, ScalePlanError, Topology, host_cache_endpoint, plan_scale_out

SCALE_OUT_PATHS = ("disk", "host-cache", "peer")
FIXED = "fixed"
OWN_PATHS = (FIXED, *SCALE_OUT_PATHS)
# Measured phases that happen before any weight moves: what ``boot_s`` defaults to when a measured
# profile gives phases but no ``boot_s``.
BOOT_PHASES = ("container", "process_up", "cuda_context", "connection_pool")


@dataclass(frozen=True)
class ScaleOutModel:
    """How a GPU of one profile joins: boot, weights, links, and where GPUs sit."""

    boot_s: float
    weights_bytes: int
    topology: Topology
    path: str = FIXED
    gpus_per_host: int = 8
    hosts_per_domain: int = 4
    host_copies: int = 1
    # Phases a measured profile recorded (``profile_model``), seconds by name; kept with the profile.
    measured_phases_s: tuple[tuple[str, float], ...] = ()
    source: str = ""

    def __post_init__(self) -> None:
        if not (math.isfinite(self.boot_s) and self.boot_s >= 0):
            raise ScalePlanError(f"scale_out.boot_s must be a number >= 0, got {self.boot_s!r}")
        if not (isinstance(self.weights_bytes, int) and self.weights_bytes > 0):
            raise ScalePlanError(
                f"scale_out.weights_bytes must be a positive integer, got {self.weights_bytes!r}"
            )
        if self.path not in OWN_PATHS:
            raise ScalePlanError(f"scale_out.path must be one of {', '.join(OWN_PATHS)}, got {self.path!r}")
        for name in ("gpus_per_host", "hosts_per_domain"):
            if not (isinstance(getattr(self, name), int) and getattr(self, name) >= 1):
                raise ScalePlanError(f"scale_out.{name} must be an integer >= 1")
        if not (isinstance(self.host_copies, int) and self.host_copies >= 0):
            raise ScalePlanError("scale_out.host_copies must be an integer >= 0")
        object.__setattr__(
            self, "measured_phases_s", tuple((str(k), float(v)) for k, v in self.measured_phases_s)
        )

    # --- where GPUs sit ---------------------------------------------------------------------------

    def endpoint(self, type_key: str, slot: int) -> Endpoint:
        """The GPU in ``slot`` of this type's hosts: ``<type>:h<host>g<gpu>``."""
        host = slot // self.gpus_per_host
        return Endpoint(
            id=f"{type_key}:h{host}g{slot % self.gpus_per_host}",
            host=f"{type_key}:h{host}",
            domain=f"{type_key}:d{host // self.hosts_per_domain}",
        )

    def host_caches(self, type_key: str) -> list[Endpoint]:
        """The cluster's host copies, one per host from host 0 (§5.3: at most ``host_copies``)."""
        return [
            host_cache_endpoint(f"{type_key}:h{h}", f"{type_key}:d{h // self.hosts_per_domain}")
            for h in range(self.host_copies)
        ]

    # --- the delay --------------------------------------------------------------------------------

    def sources_for(self, path: str, type_key: str, serving: Sequence[Endpoint]) -> list[Endpoint]:
        if path == "disk":
            return []
        if path == "host-cache":
            return self.host_caches(type_key)
        if path == "peer":
            return [*serving, *self.host_caches(type_key)]
        raise ScalePlanError(f"scale-out path must be one of {', '.join(SCALE_OUT_PATHS)}, got {path!r}")

    def plan(
        self,
        path: str,
        type_key: str,
        *,
        serving: Sequence[Endpoint],
        targets: Sequence[Endpoint],
        busy: frozenset[tuple[str, str]] = frozenset(),
    ) -> ScalePlan:
        """The scale plan for ``targets`` given the GPUs ``serving`` the model now."""
        topology = self.topology.with_busy(busy) if busy else self.topology
        return plan_scale_out(
            sources=self.sources_for(path, type_key, serving),
            targets=targets,
            topology=topology,
            weights_bytes=self.weights_bytes,
        )

    def nominal_delay_s(self, path: str) -> float:
        """One GPU joining a pool that holds the model on another host of its leaf (peer) or has a
        host copy there (host-cache), or from its own disk: what a policy should expect."""
        probe = "probe"
        target = self.endpoint(probe, self.gpus_per_host)  # host 1
        serving = [self.endpoint(probe, 0)]  # host 0, same leaf unless hosts_per_domain == 1
        if path == "host-cache" and self.host_copies == 0:
            path = "disk"
        plan = self.plan(path, probe, serving=serving, targets=[target])
        return self.boot_s + plan.expected_ready_s[target.id]

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "boot_s": self.boot_s,
            "weights_bytes": self.weights_bytes,
            "path": self.path,
            "topology": self.topology.to_json(),
            "gpus_per_host": self.gpus_per_host,
            "hosts_per_domain": self.hosts_per_domain,
            "host_copies": self.host_copies,
        }
        if self.measured_phases_s:
            out["measured_phases_s"] = dict(self.measured_phases_s)
        if self.source:
            out["source"] = self.source
        return out

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> ScaleOutModel:
        """The profile JSON's optional ``scale_out`` object (docs/scheduling.md)."""
        if not isinstance(data, Mapping):
            raise ScalePlanError("scale_out must be a JSON object")
        known = {
            "boot_s",
            "weights_bytes",
            "path",
            "topology",
            "gpus_per_host",
            "hosts_per_domain",
            "host_copies",
            "measured_phases_s",
            "source",
        }
        unknown = sorted(set(data) - known)
        if unknown:
            raise ScalePlanError(f"scale_out has unknown field(s) {', '.join(unknown)}")
        for key in ("weights_bytes", "topology"):
            if key not in data:
                raise ScalePlanError(f"scale_out is missing {key}")
        phases = data.get("measured_phases_s", {})
        if not isinstance(phases, Mapping):
            raise ScalePlanError("scale_out.measured_phases_s must be an object of seconds by phase")
        boot = data.get("boot_s")
        if boot is None:
            if not any(p in phases for p in BOOT_PHASES):
                raise ScalePlanError(
                    f"scale_out needs boot_s or measured_phases_s with one of {', '.join(BOOT_PHASES)}"
                )
            boot = sum(float(phases[p]) for p in BOOT_PHASES if p in phases)
        try:
            return cls(
                boot_s=float(boot),
                weights_bytes=int(data["weights_bytes"]),
                topology=Topology.from_json(data["topology"]),
                path=str(data.get("path", FIXED)),
                gpus_per_host=int(data.get("gpus_per_host", 8)),
                hosts_per_domain=int(data.get("hosts_per_domain", 4)),
                host_copies=int(data.get("host_copies", 1)),
                measured_phases_s=tuple(sorted(phases.items())),
                source=str(data.get("source", "")),
            )
        except (TypeError, ValueError) as exc:
            if isinstance(exc, ScalePlanError):
                raise
            raise ScalePlanError(f"scale_out: {exc}") from exc


def with_path(model: ScaleOutModel, path: str) -> ScaleOutModel:
    return replace(model, path=path)
