"""Workers on other hosts (issue 30): three "hosts" as network namespaces, the platform on this one.

``tests/e2e/netns.py`` builds the hosts (a bridge, one veth and namespace per host, each with an
address of its own) and exposes PostgreSQL and Redis on the bridge; the platform's provisioner starts
each worker inside a host, advertising that host's address (``--listen-host``) with
``WORKER_MULTI_HOST`` on. No worker can reach another through loopback: whatever passes between two
workers — session state on a migration, weights along a chain — crosses the bridge.

One platform and one set of hosts for the module; the tests build on each other's cluster (one
worker, then three on three hosts by a scale-out, then one killed). Every stream is checked byte for
byte against the same session generated in this process, alone on the tiny engine: what a client
receives from workers on several hosts is what one host would have sent.
"""

from __future__ import annotations

import asyncio
import os
import signal
import time
from pathlib import Path
from urllib.parse import urlparse, urlunparse

import httpx
import pytest
import websockets
from django.core.management import call_command
from rest_framework.authtoken.models import Token

from contracts.wire.frames import decode_chunk_frame
from gpu.models import GpuWorker, WeightHolding
from scheduling.models import Migration, ScalingAction, SchedulerConfig
from sessions.models import ChunkRecord, GenerationSession, SessionEvent
from tests.e2e.conftest import ROOT, Platform, wait_for
from tests.e2e.netns import LAYOUT_ENV, Hosts, namespaces_refused
from tests.factories import StaffFactory, UserFactory
from workers.runtime.weights import read_manifest, weights_receive
from workers.runtime.weights.manifest import checksum

pytestmark = [pytest.mark.e2e, pytest.mark.slow, pytest.mark.django_db]

PROMPT, SEED = "a lighthouse on another host", 30
HOSTS = 3
# The e2e profile (tests/e2e/conftest.py: K = 2), with the network the scale plan sees: H100 hosts'
# documented links (docs/scaleout.md) and a LAN's 0.1 ms per hop. With the tiny model's 5.6 MB a
# hop's latency, not the bandwidth, decides between a peer and a disk; at the built-in 10 ms the
# planner reads the second new worker's weights from its own disk, and no chain crosses two hosts.
PROFILE = {
    "capacity": 2.0,
    "name": "cpu-tiny-multi-host",
    "provisioning_delay_s": 6.0,
    "latency_ms": [[1, 100.0], [2, 200.0], [3, 300.0], [4, 400.0]],
    "scale_out": {
        "boot_s": 6.0,
        "weights_bytes": 5590848,
        "topology": {
            "rdma_gbps": 50.0,
            "nvlink_gbps": None,
            "pcie_gbps": 64.0,
            "nvme_gbps": 6.9,
            "hop_latency_s": 0.0001,
        },
        "source": "tests/e2e/test_multi_host.py: H100 links, a LAN's hop latency",
    },
}


def on_bridge(url: str, address: str, port: int) -> str:
    """``url`` with its host and port replaced: the forwarder's on the bridge."""
    parsed = urlparse(url)
    netloc = f"{parsed.username}@{address}:{port}" if parsed.username else f"{address}:{port}"
    return urlunparse(parsed._replace(netloc=netloc))


@pytest.fixture(scope="module")
def hosts(tmp_path_factory):
    refused = namespaces_refused()
    if refused:
        pytest.skip(f"no network namespaces on this machine: {refused}")
    built = Hosts(HOSTS, tmp_path_factory.mktemp("hosts"))
    try:
        built.create()
        yield built
    finally:
        built.destroy()
        assert not built.leftovers(), built.leftovers()


@pytest.fixture(scope="module")
def cluster(hosts, django_db_setup, django_db_blocker, tmp_path_factory, request):
    """The platform on this host, its workers provisioned into the hosts; a user's and staff's tokens."""
    from scheduling.services import beat_schedule_install

    with django_db_blocker.unblock():
        call_command("flush", "--noinput", verbosity=0)
        beat_schedule_install(tick_s=1)
        SchedulerConfig.objects.update_or_create(
            pk=1,
            defaults={"min_gpus": 1, "max_gpus": 1, "scale_in_cooldown_s": 5.0, "target_utilization": 0.5},
        )
        platform = Platform(
            tmp_path_factory.mktemp("multi-host"),
            profile=PROFILE,
            env={"PROVISIONER": "tests.e2e.netns:NetnsProvisioner", "MAX_LIVE_SESSIONS_PER_USER": "20"},
        )
        database, redis_server = urlparse(platform.env["DATABASE_URL"]), urlparse(platform.env["REDIS_URL"])
        pg_port, redis_port = hosts.forward(
            f"{database.hostname}:{database.port}", f"{redis_server.hostname}:{redis_server.port}"
        )
        platform.env[LAYOUT_ENV] = hosts.layout(
            {
                "DATABASE_URL": on_bridge(platform.env["DATABASE_URL"], hosts.address, pg_port),
                "REDIS_URL": on_bridge(platform.env["REDIS_URL"], hosts.address, redis_port),
                "CELERY_BROKER_URL": on_bridge(platform.env["CELERY_BROKER_URL"], hosts.address, redis_port),
            }
        )
        platform.start()
        try:
            tokens = {
                "user": Token.objects.create(user=UserFactory()).key,
                "staff": Token.objects.create(user=StaffFactory()).key,
            }
            yield platform, tokens
        finally:
            platform.stop()
            if request.session.testsfailed:
                print(platform.logs())
                for name in GpuWorker.objects.values_list("name", flat=True):
                    log = ROOT / "var" / "log" / f"{name}.log"
                    if log.exists():
                        print(f"===== {log.name}\n" + log.read_text(errors="replace")[-3000:])
            call_command("flush", "--noinput", verbosity=0)


class Reference:
    """The session generated here, alone on the tiny engine: the JPEG frames of each chunk."""

    def __init__(self) -> None:
        from workers.runtime.engine import ChunkEngine

        self.engine = ChunkEngine.from_preset("tiny", max_batch=1)
        self.engine.add_session("reference", PROMPT, SEED)
        self.frames: list[list[bytes]] = []

    def chunk(self, index: int) -> list[bytes]:
        while len(self.frames) <= index:
            (result,) = self.engine.step()
            self.frames.append(result.encoded.result().frames)
        return self.frames[index]


@pytest.fixture(scope="module")
def reference():
    import torch

    torch.set_num_threads(1)
    return Reference()


def api(platform, token) -> httpx.Client:
    return httpx.Client(base_url=platform.url, headers={"Authorization": f"Token {token}"}, timeout=30)


def session_create(cluster) -> str:
    platform, tokens = cluster
    with api(platform, tokens["user"]) as client:
        response = client.post("/api/sessions/", json={"prompt": PROMPT, "model": "tiny", "seed": SEED})
    assert response.status_code == 201, response.text
    return response.json()["id"]


def session_terminate(cluster, sid: str) -> None:
    platform, tokens = cluster
    with api(platform, tokens["user"]) as client:
        client.post(f"/api/sessions/{sid}/terminate/")


def scheduler_config(cluster, **fields) -> None:
    platform, tokens = cluster
    with api(platform, tokens["staff"]) as staff:
        response = staff.patch("/api/scheduler/config/", json=fields)
    assert response.status_code == 200, response.text


class Stream:
    """A WebSocket client of one session: each chunk's header and JPEG frames, in arrival order."""

    def __init__(self, cluster, sid: str) -> None:
        platform, tokens = cluster
        self.url = f"{platform.ws_url}/ws/sessions/{sid}/?token={tokens['user']}&codec=jpeg"
        self.chunks: list[tuple[dict, list[bytes]]] = []

    async def collect(self, *, chunks: int, timeout: float, after_each=None) -> Stream:
        async with websockets.connect(self.url, max_size=None) as ws:
            deadline = time.monotonic() + timeout
            while len(self.chunks) < chunks and time.monotonic() < deadline:
                try:
                    message = await asyncio.wait_for(ws.recv(), timeout=max(0.1, deadline - time.monotonic()))
                except TimeoutError:
                    break
                if isinstance(message, bytes):
                    self.chunks.append(decode_chunk_frame(message))
                    if after_each is not None and after_each(self):
                        break
        return self

    def indices(self) -> list[int]:
        return [header["index"] for header, _ in self.chunks]

    def workers(self) -> list[str]:
        return [header["worker"] for header, _ in self.chunks]

    def assert_contiguous(self) -> None:
        indices = self.indices()
        assert indices == list(range(indices[0], indices[0] + len(indices))), indices

    def assert_byte_exact(self, reference: Reference) -> None:
        for header, frames in self.chunks:
            assert frames == reference.chunk(header["index"]), f"chunk {header['index']} differs"


def collect(cluster, sid: str, **options) -> Stream:
    return asyncio.run(Stream(cluster, sid).collect(**options))


def host_of(hosts: Hosts, worker: GpuWorker):
    return next(h for h in hosts.hosts if h.hostname == worker.host)


def test_a_worker_on_another_host_serves_chunks_byte_exact(hosts, cluster, reference):
    # Given the platform's first worker, started in the first host
    first = wait_for(lambda: GpuWorker.objects.filter(status="ready").first(), 120, message="a worker")
    host = host_of(hosts, first)
    assert host is hosts.hosts[0]
    # advertising that host's address for its migration listener and its weight server
    assert first.migration_address.startswith(f"{host.address}:"), first.migration_address
    holding = wait_for(
        lambda: WeightHolding.objects.filter(worker=first, state="complete").first(), 30, message="weights"
    )
    assert holding.address.startswith(f"{host.address}:"), holding.address
    # and listening there only: not on the host's loopback nor on any other interface it may have
    listening = hosts.listening(host)
    for address in (first.migration_address, holding.address):
        port = int(address.rpartition(":")[2])
        assert listening.get(port) == host.address, (address, listening)
    # When a client watches a session
    sid = session_create(cluster)
    stream = collect(cluster, sid, chunks=5, timeout=90)
    # then it receives consecutive chunks from that worker, byte for byte those of one host
    assert len(stream.chunks) == 5
    stream.assert_contiguous()
    assert set(stream.workers()) == {first.name}
    stream.assert_byte_exact(reference)
    wait_for(
        lambda: (
            set(stream.indices())
            <= set(ChunkRecord.objects.filter(session_id=sid).values_list("chunk_index", flat=True))
        ),
        15,
        message="the chunks' records",
    )
    session_terminate(cluster, sid)


def test_a_scale_out_chains_the_weights_across_hosts(hosts, cluster):
    # Given the first worker serving from the first host
    (first,) = GpuWorker.objects.filter(status="ready")
    source = WeightHolding.objects.get(worker=first, state="complete")
    # and no weights on the other hosts' disks
    assert not [f for h in hosts.hosts[1:] for f in Path(h.weights_dir).iterdir()]
    # When the pool scales out to three workers
    scheduler_config(cluster, min_gpus=3, max_gpus=3)
    new = wait_for(
        lambda: (
            (ws := list(GpuWorker.objects.filter(status="ready").exclude(pk=first.pk)))
            and len(ws) == 2
            and ws
        ),
        180,
        message="two more workers ready",
    )
    # then each runs on a host of its own
    assert sorted(w.host for w in [first, *new]) == sorted(h.hostname for h in hosts.hosts)
    for worker in new:
        worker_host = host_of(hosts, worker)
        assert worker.migration_address.startswith(f"{worker_host.address}:"), worker.migration_address
        # its weights came over the network from a peer on another host, as the plan chained them
        assert worker.weights_source == "peer", (worker.weights_source, worker.weights_source_detail)
        chain = worker.weights_plan["chain"]
        assert chain[0] == first.name and worker.name in chain, worker.weights_plan
        upstream = chain[chain.index(worker.name) - 1]
        assert upstream in worker.weights_source_detail, worker.weights_source_detail
    # and the plan was one chain through the three hosts: first → one new worker → the other
    action = ScalingAction.objects.get(direction="out", workers=new[0])
    assert set(action.workers.all()) == set(new)
    (chain,) = action.plan["chains"]
    assert chain["source"] == first.name and sorted(chain["targets"]) == sorted(w.name for w in new), chain
    # and every block each new worker serves is its source's, byte for byte
    manifest = read_manifest(Path(hosts.hosts[0].weights_dir) / "tiny.safetensors")
    assert manifest.weights_id == source.digest
    expected = [block.checksum for block in manifest.blocks]
    for worker in [first, *new]:
        holding = WeightHolding.objects.get(worker=worker, state="complete")
        assert holding.address.startswith(f"{host_of(hosts, worker).address}:"), holding.address
        received = weights_receive(manifest, sources=[holding.address], device="cpu", timeout_s=120)
        assert received.source == holding.address, received.attempts
        assert [checksum(buffer) for buffer in received.packed.buffers] == expected


def test_a_session_migrates_between_hosts_byte_exact(hosts, cluster, reference):
    # Given a session streaming from a worker on one host
    sid = session_create(cluster)
    wait_for(lambda: GenerationSession.objects.get(pk=sid).status == "executing", 60, message="placement")
    source = GenerationSession.objects.select_related("worker").get(pk=sid).worker
    target = GpuWorker.objects.filter(status="ready").exclude(host=source.host).first()
    platform, tokens = cluster

    def migrate_after_three(stream: Stream) -> bool:
        # When an operator moves it to a worker on another host after its third chunk
        if len(stream.chunks) == 3:
            with api(platform, tokens["staff"]) as staff:
                response = staff.post(f"/api/sessions/{sid}/migrate/", json={"target": target.name})
            assert response.status_code == 202, response.text
        return False

    stream = collect(cluster, sid, chunks=10, timeout=90, after_each=migrate_after_three)
    # then the client saw one stream that moved hosts once, byte for byte the one-host stream
    assert len(stream.chunks) == 10
    stream.assert_contiguous()
    workers = stream.workers()
    switch = workers.index(target.name)
    assert set(workers[:switch]) == {source.name} and set(workers[switch:]) == {target.name}, workers
    stream.assert_byte_exact(reference)
    migration = Migration.objects.get(session_id=sid)
    assert migration.outcome == "succeeded" and migration.state_bytes > 0, migration.error
    assert (migration.source.host, migration.target.host) == (source.host, target.host)
    session_terminate(cluster, sid)


def test_a_killed_workers_session_recovers_on_another_host_byte_exact(hosts, cluster, reference):
    # Given a session streaming from a worker on one host
    sid = session_create(cluster)
    wait_for(lambda: GenerationSession.objects.get(pk=sid).status == "executing", 60, message="placement")
    victim = GenerationSession.objects.select_related("worker").get(pk=sid).worker
    pid = int(victim.external_id.split("@")[0])
    others = {w.name: w.host for w in GpuWorker.objects.filter(status="ready").exclude(pk=victim.pk)}
    assert others and victim.host not in others.values(), others

    def kill_after_fifth(stream: Stream) -> bool:
        # When that worker is killed (SIGKILL: no hand-back) right after the fifth chunk
        if len(stream.chunks) == 5:
            os.kill(pid, signal.SIGKILL)
            return True
        return False

    before = collect(cluster, sid, chunks=6, timeout=60, after_each=kill_after_fifth)
    assert set(before.workers()) == {victim.name}
    wait_for(lambda: GpuWorker.objects.get(pk=victim.pk).status == "failed", 30, message="the loss detected")
    after = collect(cluster, sid, chunks=4, timeout=90)
    # then it continues on a worker of another host, no index twice, byte for byte the one-host stream
    assert len(after.chunks) == 4, after.indices()
    after.assert_contiguous()
    assert after.indices()[0] > max(before.indices())
    assert set(after.workers()) <= set(others), (after.workers(), others)
    before.assert_byte_exact(reference)
    after.assert_byte_exact(reference)
    assert SessionEvent.objects.filter(session_id=sid, kind="restart").exists()
    received = set(before.indices()) | set(after.indices())

    def recorded() -> list[int]:
        return list(ChunkRecord.objects.filter(session_id=sid).values_list("chunk_index", flat=True))

    wait_for(lambda: received <= set(recorded()), 15, message="a record for every chunk received")
    indices = recorded()
    assert len(indices) == len(set(indices)) and sorted(indices) == list(
        range(min(indices), max(indices) + 1)
    )
    session_terminate(cluster, sid)
