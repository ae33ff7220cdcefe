"""The host cache against a fake parameter pool (its ``HostCacheLink`` port, ``workers.ports``), with
no database: what it asks of the pool at each step, a refused copy retried, a copy evicted while it
loaded, and a cache declared lost that rejoins. (``tests/gpu/test_hostcache.py`` runs it against
the real pool.)"""

from __future__ import annotations

from typing import Any

import pytest

from workers.hostcache import HostCacheDaemon
from workers.ports import CopyRefused, HostCacheLink

PRESET = "tiny"


class Pool(HostCacheLink):
    def __init__(self) -> None:
        self.calls: list[str] = []
        self.listed: list[str] | None = []
        self.refuse: str | None = None
        self.completes = True

    def join(self, **identity: Any) -> None:
        self.calls.append("join")

    def beat(self) -> list[str] | None:
        self.calls.append("beat")
        return self.listed

    def reserve(self, *, model_preset: str, weights_bytes: int) -> int:
        self.calls.append(f"reserve {model_preset}")
        if self.refuse:
            raise CopyRefused(self.refuse)
        return 7

    def complete(self, *, holding_id: int, digest: str, address: str) -> bool:
        self.calls.append(f"complete {holding_id}")
        if self.completes and self.listed is not None:
            self.listed.append(PRESET)
        return self.completes

    def touch(self, *, holding_id: int) -> None:
        self.calls.append(f"touch {holding_id}")

    def leave(self) -> None:
        self.calls.append("leave")


@pytest.fixture
def make_cache(tmp_path):
    made: list[HostCacheDaemon] = []

    def factory(pool: Pool, **kwargs: Any) -> HostCacheDaemon:
        cache = HostCacheDaemon(
            name="c1",
            host="127.0.0.1",
            models=[PRESET],
            capacity_bytes=64 << 20,
            weights_dir=str(tmp_path),
            pool=pool,
            weights_from="disk",
            **kwargs,
        )
        cache.start()
        made.append(cache)
        return cache

    yield factory
    for cache in made:
        cache.shutdown()


def test_a_step_beats_then_reserves_fills_and_completes_one_copy(make_cache):
    pool = Pool()
    cache = make_cache(pool)
    assert cache.step()
    assert pool.calls == ["join", "beat", f"reserve {PRESET}", "complete 7"]
    assert cache.held[PRESET].source == "disk" and cache.held[PRESET].holding_id == 7
    # A step with nothing to load only beats
    assert not cache.step()
    assert pool.calls[-1] == "beat"
    cache.shutdown()
    assert pool.calls[-1] == "leave" and cache.held == {}


def test_a_refused_copy_is_retried_after_retry_s(make_cache):
    pool = Pool()
    pool.refuse = "1 host copy of tiny in the cluster already"
    cache = make_cache(pool, retry_s=3600.0)
    assert not cache.step() and cache.held == {}
    assert not cache.step()
    assert pool.calls.count(f"reserve {PRESET}") == 1
    cache._next_try[PRESET] = 0.0  # the retry time has come
    pool.refuse = None
    assert cache.step() and PRESET in cache.held


def test_a_copy_evicted_while_it_loaded_is_not_served(make_cache):
    pool = Pool()
    pool.completes = False
    cache = make_cache(pool)
    assert cache.step()
    assert cache.held == {}


def test_an_evicted_copy_is_freed_and_a_cache_declared_lost_rejoins_with_nothing(make_cache):
    pool = Pool()
    cache = make_cache(pool, retry_s=3600.0)
    assert cache.step()
    server = cache.held[PRESET].server
    # When the pool no longer lists the copy, the next beat frees it
    pool.listed = []
    cache.step()
    assert cache.held == {} and server._closed.is_set()
    # When the cache was declared lost, it joins again
    pool.listed = None
    cache.step()
    assert pool.calls.count("join") == 2
