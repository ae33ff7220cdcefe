"""The host cache (``manage.py hostcache``): model weights in host memory, served to peers.

BlitzScale §5.3 keeps one copy of each model's parameters in host memory somewhere in the cluster,
so a scale-out never has to go to storage while any GPU or host holds them. This process is that
copy: for each model it is asked to cache it reserves one of the model's host slots in the parameter
pool (``HostCacheLink.reserve``, ``gpu.services.host_copy_register`` behind it: the cluster-wide
bound, eviction when its memory is bounded), fills host memory (pinned on CUDA hosts) from a GPU that holds the weights or from local
storage, verifies every block, and serves blocks to peers through ``workers.runtime.weights``.

``HostCacheDaemon.step()`` does one bounded unit: a heartbeat (which also tells it what the pool
evicted: those copies are freed), then at most one model loaded. A model whose host slots are all
taken is retried at later steps, so when another cache dies this one takes over its copy (the pool
heals itself, §5.3 "reclaim/reload cached copies").

This module holds no ORM code: the pool is reached through the ``HostCacheLink`` port
(``workers.ports``; ``workers.adapters.pool.DjangoHostCacheLink`` is the real one).
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from workers.ports import CopyRefused, HostCacheLink
from workers.runtime.weights import (
    PackedWeights,
    WeightServer,
    WeightsUnavailable,
    load_weights,
    read_manifest,
    weights_receive,
    weights_serve,
)
from workers.weights_loading import pinned, weights_file, weights_file_ensure

logger = logging.getLogger("workers.hostcache")


@dataclass
class CachedModel:
    holding_id: int
    packed: PackedWeights
    server: WeightServer
    source: str
    served_seen: int = 0


@dataclass
class HostCacheDaemon:
    name: str
    host: str
    models: list[str]
    capacity_bytes: int
    weights_dir: str
    pool: HostCacheLink
    weights_from: str = "auto"  # auto: a GPU holder, else disk; pool: GPU holders only; disk
    link_mbps: float | None = None
    heartbeat_s: float = 1.0
    retry_s: float = 5.0
    pinned: bool = False
    # The machine, as the scale planner's ``host`` (a host copy reaches the GPUs of its own machine
    # over PCIe, BlitzScale §5.1); the Kubernetes node name in a cluster. Empty: the listen host.
    node: str = ""
    held: dict[str, CachedModel] = field(default_factory=dict)
    stopping: threading.Event = field(default_factory=threading.Event)
    _next_try: dict[str, float] = field(default_factory=dict)

    def start(self) -> None:
        self.pinned = pinned_memory_available()
        self.pool.join(
            name=self.name,
            host=self.node or self.host,
            address=self.host,
            capacity_bytes=self.capacity_bytes,
            pinned=self.pinned,
        )
        logger.info(
            "hostcache.up cache=%s capacity_bytes=%d models=%s", self.name, self.capacity_bytes, self.models
        )

    def run(self) -> None:
        self.start()
        try:
            while not self.stopping.is_set():
                did = self.step()
                self.stopping.wait(0.0 if did else self.heartbeat_s)
        finally:
            self.shutdown()

    def request_stop(self, *_args: Any) -> None:
        self.stopping.set()

    def step(self) -> bool:
        """Heartbeat (free what the pool evicted), then load at most one wanted model."""
        listed = self.pool.beat()
        if listed is None:
            # Declared lost (we were frozen past the timeout): our copies left the pool. Start over.
            logger.warning("hostcache.lost_rejoin cache=%s", self.name)
            self._drop_all()
            self.start()
            listed = []
        for model in [m for m in self.held if m not in listed]:
            logger.info("hostcache.evicted cache=%s model=%s", self.name, model)
            self._drop(model)
        for cached in self.held.values():
            # A copy that served peers since the last beat is the most recently used (LRU eviction).
            if len(cached.server.served) > cached.served_seen:
                cached.served_seen = len(cached.server.served)
                self.pool.touch(holding_id=cached.holding_id)
        now = time.monotonic()
        for model in self.models:
            if model in self.held or self._next_try.get(model, 0.0) > now:
                continue
            self._next_try[model] = now + self.retry_s
            return self._load(model)
        return False

    def _load(self, model: str) -> bool:
        path = weights_file(self.weights_dir, model)
        weights_file_ensure(path, model)
        manifest = read_manifest(path)
        try:
            holding_id = self.pool.reserve(model_preset=model, weights_bytes=manifest.total_bytes)
        except CopyRefused as exc:
            logger.info("hostcache.not_cached cache=%s model=%s reason=%s", self.name, model, exc)
            return False
        started = time.monotonic()
        try:
            with self._beating(model):
                packed, source = self._fill(model, manifest, path)
        except (WeightsUnavailable, OSError, ValueError) as exc:
            logger.error("hostcache.load_failed cache=%s model=%s error=%s", self.name, model, exc)
            self.pool.evict(model_preset=model)
            return True
        server = weights_serve(packed, device="cpu", host=self.host, link_mbps=self.link_mbps)
        if not self.pool.complete(holding_id=holding_id, digest=manifest.weights_id, address=server.address):
            # Evicted (or the cache was declared lost) while we were loading: do not serve it.
            server.close()
            return True
        self.held[model] = CachedModel(holding_id, packed, server, source)
        logger.info(
            "hostcache.cached cache=%s model=%s bytes=%d source=%s seconds=%.3f address=%s pinned=%s",
            self.name,
            model,
            manifest.total_bytes,
            source,
            time.monotonic() - started,
            server.address,
            self.pinned,
        )
        return True

    @contextlib.contextmanager
    def _beating(self, model: str) -> Iterator[None]:
        """Heartbeats from a thread of their own while a load runs: a load takes as long as its bytes
        take (GBs from storage or a peer), far past ``HEARTBEAT_TIMEOUT_S``, and a cache that went
        quiet that long was declared lost and its copy thrown away when the load finished. The beats
        only keep the cache alive; the next step's beat reads what the pool evicted meanwhile."""
        done = threading.Event()

        def keep_alive() -> None:
            try:
                while not done.wait(self.heartbeat_s):
                    try:
                        if self.pool.beat() is None:
                            return  # declared lost all the same: ``complete`` will say so
                    except Exception:  # a missed beat is retried; the load goes on
                        logger.exception("hostcache.beat_failed cache=%s model=%s", self.name, model)
            finally:
                self.pool.beat_thread_done()

        beater = threading.Thread(target=keep_alive, name=f"hostcache-beat-{model}", daemon=True)
        beater.start()
        try:
            yield
        finally:
            done.set()
            beater.join()

    def _fill(self, model: str, manifest, path) -> tuple[PackedWeights, str]:
        """From GPU holders first (the fast network), then local storage (unless ``pool``)."""
        sources = [
            s["address"]
            for s in self.pool.sources_now(model_preset=model)
            if s["kind"] == "gpu" and s["address"] and s["digest"] == manifest.weights_id
        ]
        if self.weights_from == "disk":
            return pinned(load_weights(path, manifest, device="cpu")), "disk"
        result = weights_receive(
            manifest,
            sources=sources,
            disk_path=None if self.weights_from == "pool" else path,
            device="cpu",
            host=self.host,
            link_mbps=self.link_mbps,
        )
        return pinned(result.packed), ("disk" if result.source == "disk" else "peer")

    def _drop(self, model: str) -> None:
        cached = self.held.pop(model, None)
        if cached is not None:
            cached.server.close()

    def _drop_all(self) -> None:
        for model in list(self.held):
            self._drop(model)

    def shutdown(self) -> None:
        self._drop_all()
        self.pool.leave()
        logger.info("hostcache.stopped cache=%s", self.name)


def pinned_memory_available() -> bool:
    import torch

    return torch.cuda.is_available()
