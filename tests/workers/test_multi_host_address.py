"""A worker or host cache of a pool on several hosts refuses to advertise a loopback address
(WORKER_MULTI_HOST)."""

from __future__ import annotations

import pytest
from django.core.management import call_command
from django.core.management.base import CommandError

from gpu.models import GpuWorker, HostCache
from workers.runtime.transport.pair import is_loopback

pytestmark = pytest.mark.django_db


@pytest.mark.parametrize("host", ["127.0.0.1", "127.0.1.1", "::1", "localhost"])
def test_a_multi_host_worker_refuses_a_loopback_listen_host_naming_the_setting(settings, host):
    """Given WORKER_MULTI_HOST, when a worker starts with a loopback --listen-host, then it refuses
    before registering, naming --listen-host and WORKER_MULTI_HOST."""
    settings.STREAMSERVE = {**settings.STREAMSERVE, "WORKER_MULTI_HOST": True}
    with pytest.raises(CommandError, match=r"--listen-host .*loopback.*WORKER_MULTI_HOST"):
        call_command("gpuworker", name="multi-host", preset="tiny", device="cpu", listen_host=host)
    assert not GpuWorker.objects.filter(name="multi-host").exists()


@pytest.mark.parametrize("host", ["127.0.0.1", "localhost"])
def test_a_multi_host_host_cache_refuses_a_loopback_listen_host_naming_the_setting(settings, host):
    """Given WORKER_MULTI_HOST, when a host cache starts with a loopback --listen-host (the default),
    then it refuses before joining the parameter pool, naming --listen-host and WORKER_MULTI_HOST."""
    settings.STREAMSERVE = {**settings.STREAMSERVE, "WORKER_MULTI_HOST": True}
    with pytest.raises(CommandError, match=r"--listen-host .*loopback.*WORKER_MULTI_HOST"):
        call_command("hostcache", model=["tiny"], name="multi-host-cache", listen_host=host)
    assert not HostCache.objects.filter(name="multi-host-cache").exists()


def test_loopback_is_told_from_an_address_other_hosts_reach():
    assert is_loopback("127.0.0.1") and is_loopback("::1") and is_loopback("localhost")
    assert not is_loopback("10.77.0.2") and not is_loopback("192.168.1.20") and not is_loopback("0.0.0.0")
