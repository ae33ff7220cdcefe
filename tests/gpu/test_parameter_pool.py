"""The parameter pool registry (BlitzScale §5.3): holders, the host-copy bound, eviction, healing."""

from __future__ import annotations

import contextlib
import threading
from datetime import timedelta

import pytest
from django.db import close_old_connections, connection
from django.utils import timezone
from hypothesis import HealthCheck
from hypothesis import settings as hsettings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from gpu import selectors
from gpu import services as pool
from gpu.models import GpuWorker, HostCache, WeightHolding
from tests.factories import GpuWorkerFactory

MB = 1 << 20


def make_cache(name: str, capacity_bytes: int = 100 * MB) -> HostCache:
    return pool.host_cache_register(
        name=name, host=f"host-{name}", address=f"{name}:7000", capacity_bytes=capacity_bytes, pinned=False
    )


def host_copies(model: str) -> int:
    return WeightHolding.objects.filter(model_preset=model, kind=WeightHolding.Kind.HOST).count()


@pytest.mark.django_db
def test_one_host_copy_per_model_by_default(settings):
    # given two live host caches and the default bound of one host copy per model
    settings.STREAMSERVE = {**settings.STREAMSERVE, "POOL_HOST_COPIES": 1}
    a, b = make_cache("a"), make_cache("b")
    # when both ask to cache the same model
    pool.host_copy_register(cache=a, model_preset="tiny", weights_bytes=10 * MB)
    # then the second is refused, and another model still fits in b
    with pytest.raises(pool.HostCopiesExhausted):
        pool.host_copy_register(cache=b, model_preset="tiny", weights_bytes=10 * MB)
    pool.host_copy_register(cache=b, model_preset="small", weights_bytes=10 * MB)
    assert host_copies("tiny") == 1 and host_copies("small") == 1


@pytest.mark.django_db
def test_registering_again_in_the_same_cache_is_idempotent():
    cache = make_cache("a")
    first = pool.host_copy_register(cache=cache, model_preset="tiny", weights_bytes=MB)
    again = pool.host_copy_register(cache=cache, model_preset="tiny", weights_bytes=MB)
    assert first.pk == again.pk and host_copies("tiny") == 1


@pytest.mark.django_db
def test_bound_is_configurable(settings):
    settings.STREAMSERVE = {**settings.STREAMSERVE, "POOL_HOST_COPIES": 2}
    caches = [make_cache(n) for n in "abc"]
    pool.host_copy_register(cache=caches[0], model_preset="tiny", weights_bytes=MB)
    pool.host_copy_register(cache=caches[1], model_preset="tiny", weights_bytes=MB)
    with pytest.raises(pool.HostCopiesExhausted):
        pool.host_copy_register(cache=caches[2], model_preset="tiny", weights_bytes=MB)
    assert host_copies("tiny") == 2


@pytest.mark.django_db
def test_a_freed_slot_can_be_taken_again():
    a, b = make_cache("a"), make_cache("b")
    pool.host_copy_register(cache=a, model_preset="tiny", weights_bytes=MB)
    assert pool.host_copy_evict(cache=a, model_preset="tiny")
    holding = pool.host_copy_register(cache=b, model_preset="tiny", weights_bytes=MB)
    assert holding.cache_id == b.pk and host_copies("tiny") == 1


@pytest.mark.django_db
def test_bounded_memory_evicts_least_recently_used_first():
    # given a cache with room for two 40 MB models, holding "old" (used long ago) and "recent"
    cache = make_cache("a", capacity_bytes=100 * MB)
    old = pool.host_copy_register(cache=cache, model_preset="old", weights_bytes=40 * MB)
    recent = pool.host_copy_register(cache=cache, model_preset="recent", weights_bytes=40 * MB)
    WeightHolding.objects.filter(pk=old.pk).update(last_used_at=timezone.now() - timedelta(hours=1))
    pool.holding_touch(holding_id=recent.pk)
    # when a third model arrives
    pool.host_copy_register(cache=cache, model_preset="new", weights_bytes=40 * MB)
    # then the least recently used copy left the pool and the cache stays within its memory
    held = set(cache.holdings.values_list("model_preset", flat=True))
    assert held == {"recent", "new"}
    assert sum(cache.holdings.values_list("weights_bytes", flat=True)) <= cache.capacity_bytes


@pytest.mark.django_db
def test_eviction_prefers_copies_held_elsewhere():
    # given "lru" used long ago but held only here, and "mirrored" used recently but also complete on a GPU
    cache = make_cache("a", capacity_bytes=100 * MB)
    lru = pool.host_copy_register(cache=cache, model_preset="lru", weights_bytes=40 * MB)
    WeightHolding.objects.filter(pk=lru.pk).update(last_used_at=timezone.now() - timedelta(hours=1))
    pool.host_copy_register(cache=cache, model_preset="mirrored", weights_bytes=40 * MB)
    worker = GpuWorkerFactory()
    gpu_copy = pool.worker_holding_register(worker=worker, model_preset="mirrored", weights_bytes=40 * MB)
    pool.holding_complete(holding_id=gpu_copy.pk, digest="d")
    # when room is needed
    pool.host_copy_register(cache=cache, model_preset="new", weights_bytes=40 * MB)
    # then the copy that exists elsewhere goes, the only copy of "lru" stays
    assert set(cache.holdings.values_list("model_preset", flat=True)) == {"lru", "new"}


@pytest.mark.django_db
def test_a_model_larger_than_the_cache_is_refused_without_evicting():
    cache = make_cache("a", capacity_bytes=50 * MB)
    pool.host_copy_register(cache=cache, model_preset="kept", weights_bytes=40 * MB)
    with pytest.raises(pool.HostCacheFull):
        pool.host_copy_register(cache=cache, model_preset="huge", weights_bytes=60 * MB)
    assert list(cache.holdings.values_list("model_preset", flat=True)) == ["kept"]


@pytest.mark.django_db
def test_only_complete_copies_of_live_holders_are_sources():
    # given a complete GPU copy, a loading GPU copy and a complete host copy
    serving, loading = GpuWorkerFactory(), GpuWorkerFactory()
    done = pool.worker_holding_register(worker=serving, model_preset="tiny", weights_bytes=MB, address="s:1")
    pool.holding_complete(holding_id=done.pk, digest="abc")
    pool.worker_holding_register(worker=loading, model_preset="tiny", weights_bytes=MB, address="l:1")
    cache = make_cache("a")
    host = pool.host_copy_register(cache=cache, model_preset="tiny", weights_bytes=MB)
    pool.holding_complete(holding_id=host.pk, digest="abc")
    # then the sources are the two complete ones
    sources = selectors.weight_sources(model_preset="tiny")
    assert sorted((s["kind"], s["name"]) for s in sources) == [("gpu", serving.name), ("host", "a")]
    assert all(s["digest"] == "abc" for s in sources)


@pytest.mark.django_db
def test_registry_heals_when_a_worker_dies_or_is_released():
    a, b = GpuWorkerFactory(), GpuWorkerFactory()
    for worker in (a, b):
        holding = pool.worker_holding_register(worker=worker, model_preset="tiny", weights_bytes=MB)
        pool.holding_complete(holding_id=holding.pk, digest="d")
    pool.worker_fail(worker=a)
    pool.worker_release(worker=b)
    assert not WeightHolding.objects.exists()
    assert selectors.weight_sources(model_preset="tiny") == []


@pytest.mark.django_db
def test_registry_heals_when_a_host_cache_stops_heartbeating(settings):
    # given a cache holding a copy whose heartbeat is older than the timeout
    cache = make_cache("a")
    pool.host_copy_register(cache=cache, model_preset="tiny", weights_bytes=MB)
    timeout = settings.STREAMSERVE["HEARTBEAT_TIMEOUT_S"]
    HostCache.objects.filter(pk=cache.pk).update(
        last_heartbeat=timezone.now() - timedelta(seconds=timeout + 1)
    )
    # when liveness runs
    lost = pool.host_caches_check()
    # then the cache is lost, its copy is gone, its slot is free, and its next heartbeat is refused
    assert lost == ["a"]
    assert HostCache.objects.get(pk=cache.pk).status == HostCache.Status.LOST
    assert host_copies("tiny") == 0
    assert pool.host_cache_heartbeat(cache_id=cache.pk) is None
    other = make_cache("b")
    pool.host_copy_register(cache=other, model_preset="tiny", weights_bytes=MB)


@pytest.mark.django_db
def test_heartbeat_lists_what_the_pool_still_holds_for_the_cache():
    cache = make_cache("a")
    pool.host_copy_register(cache=cache, model_preset="x", weights_bytes=MB)
    pool.host_copy_register(cache=cache, model_preset="y", weights_bytes=MB)
    pool.host_copy_evict(cache=cache, model_preset="x")
    assert pool.host_cache_heartbeat(cache_id=cache.pk) == ["y"]


@pytest.mark.django_db
def test_a_restarted_cache_starts_empty():
    cache = make_cache("a")
    pool.host_copy_register(cache=cache, model_preset="tiny", weights_bytes=MB)
    make_cache("a")
    assert host_copies("tiny") == 0


@pytest.mark.django_db
def test_holding_complete_is_compare_and_set():
    worker = GpuWorkerFactory()
    holding = pool.worker_holding_register(worker=worker, model_preset="tiny", weights_bytes=MB)
    assert pool.holding_complete(holding_id=holding.pk, digest="d")
    assert not pool.holding_complete(holding_id=holding.pk, digest="d")
    pool.worker_fail(worker=worker)
    assert not pool.holding_complete(holding_id=holding.pk, digest="d")


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize("bound", [1, 2])
def test_concurrent_registrations_never_exceed_the_bound(settings, bound):
    # given six caches racing to cache the same model from six threads (six connections)
    settings.STREAMSERVE = {**settings.STREAMSERVE, "POOL_HOST_COPIES": bound}
    caches = [make_cache(f"c{i}") for i in range(6)]
    barrier = threading.Barrier(len(caches))
    outcomes: list[str] = []

    def register(cache: HostCache) -> None:
        close_old_connections()
        try:
            barrier.wait()
            pool.host_copy_register(cache=cache, model_preset="tiny", weights_bytes=MB)
            outcomes.append("ok")
        except pool.HostCopiesExhausted:
            outcomes.append("refused")
        finally:
            connection.close()

    threads = [threading.Thread(target=register, args=(c,)) for c in caches]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    # then exactly `bound` won and the rest were refused
    assert sorted(outcomes) == ["ok"] * bound + ["refused"] * (len(caches) - bound)
    assert host_copies("tiny") == bound


class PoolMachine(RuleBasedStateMachine):
    """Arbitrary interleavings of register / complete / evict / die / restart / worker death."""

    MODELS = ("m0", "m1", "m2")
    CACHES = ("c0", "c1", "c2")

    def __init__(self) -> None:
        super().__init__()
        WeightHolding.objects.all().delete()
        HostCache.objects.all().delete()
        GpuWorker.objects.all().delete()
        self.bound = pool.host_copies_bound()
        self.caches = {n: make_cache(n, capacity_bytes=25 * MB) for n in self.CACHES}
        self.workers = [GpuWorkerFactory() for _ in range(2)]

    @rule(cache=st.sampled_from(CACHES), model=st.sampled_from(MODELS), size=st.sampled_from([5, 10, 20]))
    def register(self, cache, model, size):
        with contextlib.suppress(pool.PoolError):
            pool.host_copy_register(cache=self.caches[cache], model_preset=model, weights_bytes=size * MB)

    @rule(cache=st.sampled_from(CACHES), model=st.sampled_from(MODELS))
    def evict(self, cache, model):
        pool.host_copy_evict(cache=self.caches[cache], model_preset=model)

    @rule(cache=st.sampled_from(CACHES))
    def die(self, cache):
        HostCache.objects.filter(pk=self.caches[cache].pk).update(
            last_heartbeat=timezone.now() - timedelta(hours=1)
        )
        pool.host_caches_check()

    @rule(cache=st.sampled_from(CACHES))
    def restart(self, cache):
        self.caches[cache] = make_cache(cache, capacity_bytes=25 * MB)

    @rule(model=st.sampled_from(MODELS))
    def complete_all(self, model):
        for holding in WeightHolding.objects.filter(model_preset=model, state=WeightHolding.State.LOADING):
            pool.holding_complete(holding_id=holding.pk, digest="d")

    @rule(index=st.sampled_from([0, 1]), model=st.sampled_from(MODELS))
    def worker_loads(self, index, model):
        worker = self.workers[index]
        if worker.status in GpuWorker.LIVE_STATUSES:
            pool.worker_holding_register(worker=worker, model_preset=model, weights_bytes=MB)

    @rule(index=st.sampled_from([0, 1]))
    def worker_dies(self, index):
        worker = self.workers[index]
        if worker.status in GpuWorker.LIVE_STATUSES:
            self.workers[index] = pool.worker_fail(worker=worker)
        else:
            self.workers[index] = GpuWorkerFactory()

    @invariant()
    def host_copies_within_bound(self):
        for model in self.MODELS:
            assert host_copies(model) <= self.bound

    @invariant()
    def caches_within_memory(self):
        for cache in HostCache.objects.all():
            assert sum(cache.holdings.values_list("weights_bytes", flat=True)) <= cache.capacity_bytes

    @invariant()
    def no_dead_holder(self):
        assert (
            not WeightHolding.objects.exclude(cache__status=HostCache.Status.LIVE)
            .filter(kind="host")
            .exists()
        )
        assert not WeightHolding.objects.filter(
            kind="gpu", worker__status__in=[GpuWorker.Status.FAILED, GpuWorker.Status.RELEASED]
        ).exists()


@pytest.mark.django_db
@pytest.mark.parametrize("bound", [1, 2])
def test_property_host_copies_never_exceed_the_bound(settings, bound):
    settings.STREAMSERVE = {**settings.STREAMSERVE, "POOL_HOST_COPIES": bound}
    machine = PoolMachine.TestCase
    machine.settings = hsettings(
        max_examples=25,
        stateful_step_count=25,
        deadline=None,
        suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
    )
    machine().runTest()
