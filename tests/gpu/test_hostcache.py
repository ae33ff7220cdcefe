"""The host-cache process, driven step by step: fills from a GPU holder, serves peers, obeys the pool."""

from __future__ import annotations

import re
import threading
import time
from datetime import timedelta

import pytest
from django.core.management import call_command
from django.core.management.base import CommandError
from django.db import connection
from django.utils import timezone

from gpu import services as pool
from gpu.models import HostCache, WeightHolding
from tests.factories import GpuWorkerFactory
from workers.adapters.pool import DjangoHostCacheLink, DjangoPoolLink
from workers.hostcache import HostCacheDaemon
from workers.runtime.weights import read_manifest, weights_receive
from workers.weights_loading import HOST_CACHE, WeightsLoader, weights_file

PRESET = "tiny"


@pytest.fixture
def daemons():
    made: list[HostCacheDaemon] = []
    yield made
    for daemon in made:
        daemon.shutdown()


def make_daemon(daemons, tmp_path, name: str, **kwargs) -> HostCacheDaemon:
    kwargs.setdefault("capacity_bytes", 64 << 20)
    daemon = HostCacheDaemon(
        name=name,
        host="127.0.0.1",
        models=[PRESET],
        weights_dir=str(tmp_path),
        pool=DjangoHostCacheLink(),
        retry_s=0.0,
        **kwargs,
    )
    daemon.start()
    daemons.append(daemon)
    return daemon


@pytest.mark.django_db(transaction=True)
def test_cache_fills_from_a_gpu_holder_and_serves_identical_blocks(tmp_path, daemons):
    # given a serving worker holding the weights
    source = GpuWorkerFactory(model_preset=PRESET)
    served = WeightsLoader(
        preset=PRESET,
        device="cpu",
        host="127.0.0.1",
        weights_from="disk",
        weights_dir=tmp_path,
        pool=DjangoPoolLink(source.pk, PRESET),
    ).load()
    try:
        # when a host cache steps once
        cache = make_daemon(daemons, tmp_path, "c1")
        assert cache.step()
        # then it holds a complete copy filled from the peer, listed as a source
        holding = WeightHolding.objects.get(cache__name="c1")
        assert holding.state == "complete" and holding.digest == served.packed.manifest.weights_id
        assert cache.held[PRESET].source == "peer"
        # and a new worker pulling from the cache gets the same bytes
        manifest = read_manifest(weights_file(tmp_path, PRESET))
        result = weights_receive(manifest, sources=[holding.address], device="cpu")
        assert result.source == holding.address
        assert [b.checksum for b in result.packed.manifest.blocks] == [
            b.checksum for b in served.packed.manifest.blocks
        ]
        assert all((a == b).all() for a, b in zip(result.packed.buffers, served.packed.buffers, strict=True))
        # and serving it made the copy the most recently used
        before = holding.last_used_at
        cache.step()
        holding.refresh_from_db()
        assert holding.last_used_at > before
    finally:
        served.close()


@pytest.mark.django_db(transaction=True)
def test_a_new_worker_records_the_host_cache_as_its_source(tmp_path, daemons):
    cache = make_daemon(daemons, tmp_path, "c1")
    assert cache.step()  # fills from disk: no GPU holds the model
    assert cache.held[PRESET].source == "disk"
    worker = GpuWorkerFactory(model_preset=PRESET, status="provisioning", ready_at=None)
    loaded = WeightsLoader(
        preset=PRESET,
        device="cpu",
        host="127.0.0.1",
        weights_from="pool",
        weights_dir=tmp_path,
        pool=DjangoPoolLink(worker.pk, PRESET),
    ).load()
    try:
        assert loaded.source == HOST_CACHE and "c1" in loaded.detail
    finally:
        loaded.close()


@pytest.mark.django_db(transaction=True)
def test_second_cache_waits_for_the_slot_and_takes_over_when_the_first_dies(tmp_path, daemons):
    # given two caches of the same model and the default bound of one host copy
    first = make_daemon(daemons, tmp_path, "c1")
    second = make_daemon(daemons, tmp_path, "c2")
    assert first.step()
    # when the second steps, it is refused a copy
    assert not second.step()
    assert PRESET not in second.held
    # when the first stops heartbeating and liveness declares it lost
    HostCache.objects.filter(name="c1").update(last_heartbeat=timezone.now() - timedelta(hours=1))
    assert pool.host_caches_check() == ["c1"]
    # then the second takes the freed slot at its next step
    assert second.step()
    assert list(WeightHolding.objects.filter(kind="host").values_list("cache__name", flat=True)) == ["c2"]
    # and the first, when it wakes, learns it was lost and rejoins with nothing until a slot frees
    first.step()
    assert PRESET not in first.held
    assert WeightHolding.objects.filter(kind="host").count() == 1


@pytest.mark.django_db(transaction=True)
def test_an_evicted_copy_is_freed_at_the_next_heartbeat(tmp_path, daemons):
    cache = make_daemon(daemons, tmp_path, "c1")
    assert cache.step()
    server = cache.held[PRESET].server
    pool.host_copy_evict(cache=HostCache.objects.get(name="c1"), model_preset=PRESET)
    cache.retry_s = 3600.0  # do not take it back in the same step
    cache._next_try[PRESET] = float("inf")
    cache.step()
    assert PRESET not in cache.held
    assert server._closed.is_set()


@pytest.mark.django_db(transaction=True)
def test_shutdown_leaves_the_pool(tmp_path, daemons):
    cache = make_daemon(daemons, tmp_path, "c1")
    cache.step()
    cache.shutdown()
    daemons.remove(cache)
    assert HostCache.objects.get(name="c1").status == "stopped"
    assert not WeightHolding.objects.exists()


@pytest.mark.django_db(transaction=True)
def test_a_cache_given_its_node_registers_it_as_host_and_serves_on_its_listen_address(tmp_path, daemons):
    # On Kubernetes the cache listens on its Pod IP and registers as its node (hostcache --node),
    # the host the worker Pods of that node register (gpuworker --node) and the planner compares.
    cache = make_daemon(daemons, tmp_path, "cache-gpu-node-3", node="gpu-node-3")
    assert cache.step()
    row = HostCache.objects.get(name="cache-gpu-node-3")
    assert (row.host, row.address) == ("gpu-node-3", "127.0.0.1")
    holding = WeightHolding.objects.get(cache=row)
    assert holding.host == "gpu-node-3" and holding.address.startswith("127.0.0.1:")


@pytest.mark.django_db
def test_a_multi_host_cache_refuses_a_loopback_listen_host_naming_the_setting(settings):
    # The DaemonSet sets WORKER_MULTI_HOST: workers on other nodes fetch from the cache's address.
    settings.STREAMSERVE = {**settings.STREAMSERVE, "WORKER_MULTI_HOST": True}
    with pytest.raises(CommandError, match=r"--listen-host '127.0.0.1' is a loopback.*WORKER_MULTI_HOST"):
        call_command("hostcache", model=["tiny"], name="cache-node-1")
    assert not HostCache.objects.filter(name="cache-node-1").exists()


def test_the_models_default_to_hostcache_models(settings):
    # The DaemonSet names no --model: HOSTCACHE_MODELS (configmap.yaml) is read, and checked.
    settings.STREAMSERVE = {**settings.STREAMSERVE, "HOSTCACHE_MODELS": ["nosuch"]}
    with pytest.raises(CommandError, match=re.escape("--model: unknown preset(s) nosuch")):
        call_command("hostcache")
    settings.STREAMSERVE = {**settings.STREAMSERVE, "HOSTCACHE_MODELS": []}
    with pytest.raises(
        CommandError, match=re.escape("--model: name at least one model preset (or set HOSTCACHE_MODELS)")
    ):
        call_command("hostcache")


@pytest.mark.django_db(transaction=True)
def test_a_load_longer_than_the_heartbeat_timeout_keeps_the_cache_alive_and_its_copy(
    tmp_path, daemons, settings
):
    # given a worker serving the weights over a slow link: the cache's load takes seconds
    settings.STREAMSERVE = {**settings.STREAMSERVE, "HEARTBEAT_TIMEOUT_S": 0.6}
    source = GpuWorkerFactory(model_preset=PRESET)
    served = WeightsLoader(
        preset=PRESET,
        device="cpu",
        host="127.0.0.1",
        weights_from="disk",
        weights_dir=tmp_path,
        pool=DjangoPoolLink(source.pk, PRESET),
        link_mbps=8.0 * served_bytes_per_second_for(seconds=2.0, tmp_path=tmp_path) / 1e6,
    ).load()
    cache = make_daemon(daemons, tmp_path, "c1", heartbeat_s=0.1)
    declared_lost: list[str] = []
    checking = threading.Event()

    def liveness() -> None:  # the scheduler's liveness check, every 0.2 s while the load runs
        try:
            while not checking.wait(0.2):
                declared_lost.extend(pool.host_caches_check())
        finally:
            connection.close()

    checker = threading.Thread(target=liveness)
    checker.start()
    started = time.monotonic()
    try:
        # when the cache loads the model
        assert cache.step()
    finally:
        checking.set()
        checker.join()
        served.close()
    # then the load outlasted the heartbeat timeout, and the cache was never declared lost: it holds
    # a complete copy the pool lists
    assert time.monotonic() - started > 3 * 0.6
    assert declared_lost == []
    assert PRESET in cache.held
    assert WeightHolding.objects.get(cache__name="c1").state == "complete"


def served_bytes_per_second_for(*, seconds: float, tmp_path) -> float:
    """The rate at which the tiny model's weights take ``seconds`` to send."""
    from workers.weights_loading import weights_file_ensure

    path = weights_file(tmp_path, PRESET)
    weights_file_ensure(path, PRESET)
    return read_manifest(path).total_bytes / seconds
