"""The worker's ports: every way a worker process talks to the control plane (PostgreSQL, the
scheduler's records), as small base classes with a written contract.

The worker daemon, the weights loader and the host cache call only these; the Django adapters that
implement them live in ``workers.adapters`` and are wired by the entry points
(``workers.management.commands``). The import contracts in ``pyproject.toml`` (``worker-seam``,
``adapters-wired-by-entry-points``) keep it so: no other module of ``workers`` imports the control
plane, and none imports the adapters.

Every method has a do-nothing default, so a test's fake implements only what it watches. The
Redis command stream and the chunk records are no ports: they are the wire
(``contracts.wire``), shared by both sides.
"""

from __future__ import annotations

from typing import Any


class Reporter:
    """The worker daemon's side-effect sink: command answers, migrations, heartbeats and one-shot job
    reports (``workers.adapters.reporting.DjangoReporter`` is the real one). Called from the hot
    loop, the heartbeat thread and the job encoder thread: an implementation must not block them."""

    def answer(
        self, command: dict[str, Any], status: str, reason: str = "", result: dict | None = None
    ) -> None: ...
    def migration_sent(self, command: dict[str, Any], report: dict[str, Any]) -> None: ...
    def migration_failed(self, command: dict[str, Any], error: str) -> None: ...
    def heartbeat(
        self,
        telemetry: dict[str, Any],
        resident: list[str],
        parked: list[str],
        stage: dict[str, Any] | None = None,
    ) -> None: ...
    def close(self) -> None: ...

    # One-shot jobs (docs/jobs.md): the signatures of ``sessions.jobs``'s functions of the same names.
    def job_progress(
        self, job_id: str, epoch: int, worker_name: str, *, state: str, step: int, steps: int
    ) -> None: ...
    def job_completed(
        self,
        job_id: str,
        epoch: int,
        worker_name: str,
        *,
        content: bytes,
        content_type: str,
        extension: str,
        run_s: float,
    ) -> None: ...
    def job_failed(self, job_id: str, epoch: int, worker_name: str, *, reason: str) -> None: ...


class PoolLink:
    """What a worker's weights loader asks of the parameter pool
    (``workers.adapters.pool.DjangoPoolLink`` is the real one)."""

    def plan(self) -> dict[str, Any]:
        """This worker's part of the scale plan (empty when it has none)."""
        return {}

    def holder_address(self, name: str, timeout_s: float) -> str | None:
        """Where the holder ``name`` (a worker, loading or complete, or a host cache) serves blocks;
        waits up to ``timeout_s`` for a chain predecessor that has not advertised yet."""
        return None

    def sources_now(self) -> list[dict[str, Any]]:
        """The pool's complete copies of this worker's model (``gpu.selectors.weight_sources``)."""
        return []

    def loading(self, *, address: str, weights_bytes: int) -> None:
        """This worker receives the weights and serves what it has at ``address``."""

    def complete(self, *, digest: str, address: str, weights_bytes: int) -> None:
        """Every block is in place and verified: this worker is a source for later scale-outs."""

    def withdraw(self) -> None:
        """This worker no longer holds a complete copy (it dropped a stage, issue 15): out of the pool."""


class CopyRefused(Exception):
    """The parameter pool gives the host cache no copy of a model now (the cluster-wide bound is
    reached, or the cache cannot make room); the reason says which."""


class HostCacheLink:
    """What a host cache (``workers.hostcache``) asks of the parameter pool: its own row, its copies'
    holdings (``workers.adapters.pool.DjangoHostCacheLink`` is the real one). One link per cache
    process: ``join`` names the cache every later call is about."""

    def join(self, *, name: str, host: str, address: str, capacity_bytes: int, pinned: bool) -> None:
        """Announce the cache (or come back under its name with nothing held)."""

    def beat(self) -> list[str] | None:
        """The cache is alive; the models the pool still lists for it (it frees the others), or None
        when it was declared lost meanwhile (its copies left the pool: join again)."""
        return []

    def beat_thread_done(self) -> None:
        """A thread that called ``beat`` (the keep-alive during a load) ends: release what it held."""

    def reserve(self, *, model_preset: str, weights_bytes: int) -> int:
        """Reserve a host copy of ``model_preset`` (state loading); returns its holding's id.
        Raises `CopyRefused` when the pool gives no copy."""
        raise CopyRefused("no parameter pool")

    def complete(self, *, holding_id: int, digest: str, address: str) -> bool:
        """Loading → complete; returns whether it applied (False: evicted while loading)."""
        return False

    def evict(self, *, model_preset: str) -> None:
        """Drop this cache's copy of ``model_preset`` from the pool (a load that failed)."""

    def touch(self, *, holding_id: int) -> None:
        """The copy served peers since the last beat: the most recently used (LRU eviction)."""

    def sources_now(self, *, model_preset: str) -> list[dict[str, Any]]:
        """The pool's complete copies of ``model_preset`` (``gpu.selectors.weight_sources``)."""
        return []

    def leave(self) -> None:
        """The cache exits: it leaves the pool with all its copies."""
