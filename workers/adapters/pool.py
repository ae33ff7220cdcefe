"""The parameter pool (``gpu``) as the weights loader and the host cache see it: the Django side of
the ``PoolLink`` and ``HostCacheLink`` ports (``workers.ports``).

Both are called from their process's main thread (the loader before the daemon runs, the host cache
from its step), never from a worker's hot loop.
"""

from __future__ import annotations

import time
from typing import Any

from django.db import close_old_connections, connection
from django.db.models import Q

from gpu import services as pool
from gpu.models import GpuWorker, HostCache, WeightHolding
from gpu.selectors import weight_sources
from workers.ports import CopyRefused, HostCacheLink, PoolLink


class DjangoPoolLink(PoolLink):
    """The loader's view of the parameter pool (``gpu``): this worker's plan and holding, its chain
    predecessors' addresses. Called from the main thread before the daemon runs."""

    POLL_S = 0.1

    def __init__(self, worker_id: int, preset: str) -> None:
        self.worker_id = worker_id
        self.preset = preset
        self.holding_id: int | None = None

    def plan(self) -> dict[str, Any]:
        return (
            GpuWorker.objects.filter(pk=self.worker_id).values_list("weights_plan", flat=True).first() or {}
        )

    def holder_address(self, name: str, timeout_s: float) -> str | None:
        deadline = time.monotonic() + timeout_s
        while True:
            address = (
                WeightHolding.objects.filter(model_preset=self.preset)
                .filter(Q(worker__name=name) | Q(cache__name=name))
                .exclude(address="")
                .values_list("address", flat=True)
                .first()
            )
            if address or time.monotonic() >= deadline:
                return address
            time.sleep(self.POLL_S)

    def sources_now(self) -> list[dict[str, Any]]:
        return weight_sources(model_preset=self.preset)

    def loading(self, *, address: str, weights_bytes: int) -> None:
        worker = GpuWorker.objects.get(pk=self.worker_id)
        holding = pool.worker_holding_register(
            worker=worker, model_preset=self.preset, weights_bytes=weights_bytes, address=address
        )
        self.holding_id = holding.pk

    def complete(self, *, digest: str, address: str, weights_bytes: int) -> None:
        if self.holding_id is None:
            self.loading(address=address, weights_bytes=weights_bytes)
        pool.holding_complete(holding_id=self.holding_id, digest=digest, address=address)

    def withdraw(self) -> None:
        pool.holdings_of_worker_drop(worker_id=self.worker_id)
        self.holding_id = None


class DjangoHostCacheLink(HostCacheLink):
    """A host cache's row and its copies' holdings (``gpu.services``' ``host_*`` and ``holding_*``)."""

    def __init__(self) -> None:
        self.cache: HostCache | None = None

    def join(self, *, name: str, host: str, address: str, capacity_bytes: int, pinned: bool) -> None:
        self.cache = pool.host_cache_register(
            name=name, host=host, address=address, capacity_bytes=capacity_bytes, pinned=pinned
        )

    def beat(self) -> list[str] | None:
        # One beat per step of the cache's loop: the connection it finds may have gone stale since.
        close_old_connections()
        return pool.host_cache_heartbeat(cache_id=self._cache().pk)

    def beat_thread_done(self) -> None:
        connection.close()  # the keep-alive thread's own connection (Django's are per thread)

    def reserve(self, *, model_preset: str, weights_bytes: int) -> int:
        try:
            holding = pool.host_copy_register(
                cache=self._cache(), model_preset=model_preset, weights_bytes=weights_bytes
            )
        except pool.PoolError as exc:
            raise CopyRefused(str(exc)) from exc
        return holding.pk

    def complete(self, *, holding_id: int, digest: str, address: str) -> bool:
        return pool.holding_complete(holding_id=holding_id, digest=digest, address=address)

    def evict(self, *, model_preset: str) -> None:
        pool.host_copy_evict(cache=self._cache(), model_preset=model_preset)

    def touch(self, *, holding_id: int) -> None:
        pool.holding_touch(holding_id=holding_id)

    def sources_now(self, *, model_preset: str) -> list[dict[str, Any]]:
        return weight_sources(model_preset=model_preset)

    def leave(self) -> None:
        if self.cache is not None:
            pool.host_cache_stop(cache_id=self.cache.pk)

    def _cache(self) -> HostCache:
        assert self.cache is not None, "join the pool first"
        return self.cache
