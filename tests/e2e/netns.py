"""Several "hosts" on this machine for the multi-host test: Linux network namespaces on one bridge.

``Hosts`` builds them and takes them down again: a bridge on the host with the subnet's first
address, and per host a network namespace whose ``eth0`` (one end of a veth pair, the other end in
the bridge) has an address of its own. Nothing routes past the subnet (no default route in the
namespaces, no forwarding or NAT): a namespace reaches the other namespaces and the host's bridge
address, nothing else — loopback included, which is its own. PostgreSQL and Redis listen on
127.0.0.1 only, so a forwarder (``tests/e2e/tcp_forward.py``) exposes each on the bridge address,
as a database and a Redis server on a LAN would be.

``NetnsProvisioner`` is the local provisioner with one change, the one a second machine makes: it
places each worker on the host running fewest, and starts it there
(``ip netns exec <ns> unshare --uts``, the host's name set inside) with ``--listen-host`` the host's
address, ``WORKER_MULTI_HOST=true``, the forwarded ``DATABASE_URL``/``REDIS_URL``/broker and a
weights directory of the host's own (its local disk). Checkpoints stay in the one ``CHECKPOINT_DIR``:
the shared storage docs/production.md asks of several hosts. The platform loads it by dotted path
(``PROVISIONER=tests.e2e.netns:NetnsProvisioner``) with the layout in ``STREAMSERVE_TEST_NETNS``.

Names carry the creating process's pid (``ss-<pid hex>-h1``, bridge ``ss<pid hex>b``), so parallel
runs never clash, and a run finds what a killed run left behind (its pid gone) and removes it.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import ipaddress
import json
import os
import random
import shutil
import signal
import subprocess
import sys
from pathlib import Path

from gpu.models import GpuWorker
from gpu.provisioners.base import WorkerSpec
from gpu.provisioners.local import LocalProvisioner, gpuworker_command

LAYOUT_ENV = "STREAMSERVE_TEST_NETNS"
PREFIX = "ss-"
FORWARDER = Path(__file__).with_name("tcp_forward.py")


@dataclasses.dataclass(frozen=True)
class Host:
    netns: str  # the network namespace
    hostname: str  # its UTS name: what the worker registers as its host
    address: str  # eth0's address: the worker's --listen-host
    veth: str  # the host-side end of its veth pair (in the bridge)
    weights_dir: str  # its local disk's weights directory


def ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], capture_output=True, text=True, check=check)


def namespaces_refused() -> str | None:
    """Why this machine cannot build the hosts (not root, no ``ip``, namespaces refused), or None."""
    if shutil.which("ip") is None or shutil.which("unshare") is None:
        return "needs iproute2's ip and util-linux's unshare"
    if os.geteuid() != 0:
        return "network namespaces need root (CAP_NET_ADMIN, CAP_SYS_ADMIN)"
    probe = f"{PREFIX}{os.getpid():x}-probe"
    added = ip("netns", "add", probe, check=False)
    ip("netns", "del", probe, check=False)
    if added.returncode != 0:
        return f"`ip netns add` refused: {added.stderr.strip()}"
    return None


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def sweep_stale() -> None:
    """Remove namespaces and bridges a killed run left (their creator's pid is gone)."""
    for line in ip("netns", "list", check=False).stdout.splitlines():
        name = line.split()[0] if line.split() else ""
        owner = name[len(PREFIX) :].split("-")[0]
        if name.startswith(PREFIX) and owner and not _pid_alive(int(owner, 16)):
            ip("netns", "del", name, check=False)
    for line in ip("-o", "link", "show", "type", "bridge", check=False).stdout.splitlines():
        name = line.split(":")[1].strip().split("@")[0]
        owner = name[2:-1]
        if name.startswith("ss") and name.endswith("b") and _hex(owner) and not _pid_alive(int(owner, 16)):
            ip("link", "del", name, check=False)


def _hex(text: str) -> bool:
    return bool(text) and all(c in "0123456789abcdef" for c in text)


def free_subnet() -> ipaddress.IPv4Network:
    """A /24 in 10.64.0.0/10 that no address or route of this machine overlaps."""
    used = []
    for line in ip("-4", "-o", "addr", check=False).stdout.splitlines():
        used.append(ipaddress.ip_interface(line.split()[3]).network)
    for line in ip("-4", "route", check=False).stdout.splitlines():
        first = line.split()[0]
        if first != "default":
            used.append(ipaddress.ip_network(first, strict=False))
    rng = random.Random(os.getpid())
    for _ in range(1000):
        candidate = ipaddress.ip_network(f"10.{rng.randrange(64, 128)}.{rng.randrange(256)}.0/24")
        if not any(candidate.overlaps(net) for net in used):
            return candidate
    raise RuntimeError("no free /24 in 10.64.0.0/10 on this machine")


class Hosts:
    """``count`` hosts on one bridge (``create``/``destroy``), and forwarders to host services."""

    def __init__(self, count: int, tmp: Path) -> None:
        tag = f"{os.getpid():x}"
        self.subnet = free_subnet()
        addresses = list(self.subnet.hosts())
        self.bridge = f"ss{tag}b"
        self.address = str(addresses[0])  # the host's side: forwarders listen here
        self.hosts = [
            Host(
                netns=f"{PREFIX}{tag}-h{i}",
                hostname=f"{PREFIX}{tag}-h{i}",
                address=str(addresses[10 + i]),
                veth=f"ss{tag}v{i}",
                weights_dir=str(tmp / f"h{i}" / "weights"),
            )
            for i in range(1, count + 1)
        ]
        self.forwarder: subprocess.Popen | None = None

    def create(self) -> None:
        sweep_stale()
        prefix = self.subnet.prefixlen
        ip("link", "add", self.bridge, "type", "bridge")
        ip("addr", "add", f"{self.address}/{prefix}", "dev", self.bridge)
        ip("link", "set", self.bridge, "up")
        for host in self.hosts:
            peer = host.veth[:-2] + "p" + host.veth[-1]
            ip("netns", "add", host.netns)
            ip("link", "add", host.veth, "type", "veth", "peer", "name", peer)
            ip("link", "set", peer, "netns", host.netns)
            ip("link", "set", host.veth, "master", self.bridge)
            ip("link", "set", host.veth, "up")
            ip("-n", host.netns, "link", "set", peer, "name", "eth0")
            ip("-n", host.netns, "addr", "add", f"{host.address}/{prefix}", "dev", "eth0")
            ip("-n", host.netns, "link", "set", "eth0", "up")
            ip("-n", host.netns, "link", "set", "lo", "up")
            Path(host.weights_dir).mkdir(parents=True, exist_ok=True)

    def forward(self, *targets: str) -> list[int]:
        """Expose each ``host:port`` of this machine on the bridge address; the ports, in order."""
        self.forwarder = subprocess.Popen(
            [sys.executable, str(FORWARDER), self.address, *targets],
            stdout=subprocess.PIPE,
            stdin=subprocess.DEVNULL,
            text=True,
            start_new_session=True,
        )
        line = self.forwarder.stdout.readline() if self.forwarder.stdout else ""
        ports = [int(p) for p in line.split()]
        if len(ports) != len(targets):
            raise RuntimeError(f"the forwarder did not start (said {line!r})")
        return ports

    def destroy(self) -> None:
        """Every step regardless of the others (a half-built set is taken down too)."""
        if self.forwarder is not None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.forwarder.pid, signal.SIGTERM)
            try:
                self.forwarder.wait(timeout=10)
            except subprocess.TimeoutExpired:
                os.killpg(self.forwarder.pid, signal.SIGKILL)
                self.forwarder.wait()
        for host in self.hosts:
            ip("netns", "del", host.netns, check=False)  # its eth0 goes with it, and the veth's host end
            ip("link", "del", host.veth, check=False)
        ip("link", "del", self.bridge, check=False)

    def leftovers(self) -> list[str]:
        """What of this set still exists (empty once ``destroy`` did its work)."""
        names = {line.split()[0] for line in ip("netns", "list", check=False).stdout.splitlines() if line}
        links = ip("-o", "link", check=False).stdout
        return [h.netns for h in self.hosts if h.netns in names] + [
            name
            for name in [self.bridge, *(h.veth for h in self.hosts)]
            if f" {name}:" in links or f" {name}@" in links
        ]

    @staticmethod
    def listening(host: Host) -> dict[int, str]:
        """Port → the address a TCP socket listens on in ``host`` (``*`` for every interface)."""
        out = subprocess.run(
            ["ip", "netns", "exec", host.netns, "ss", "-Htln"], capture_output=True, text=True, check=True
        ).stdout
        found = {}
        for line in out.splitlines():
            address, _, port = line.split()[3].rpartition(":")
            found[int(port)] = address.strip("[]")
        return found

    def layout(self, env: dict[str, str]) -> str:
        """``STREAMSERVE_TEST_NETNS``: the hosts and the environment their workers get."""
        return json.dumps({"hosts": [dataclasses.asdict(h) for h in self.hosts], "env": env})


class NetnsProvisioner(LocalProvisioner):
    """Local workers, each in one of the layout's network namespaces (see the module docstring)."""

    name = "netns"

    def __init__(self, *, layout: str | None = None, **options) -> None:
        data = json.loads(layout if layout is not None else os.environ[LAYOUT_ENV])
        self.hosts = [Host(**h) for h in data["hosts"]]
        self.host_env: dict[str, str] = data["env"]
        super().__init__(command_factory=self.command, **options)

    def _host(self, hostname: str) -> Host:
        return next(h for h in self.hosts if h.hostname == hostname)

    def _live_here(self):
        return GpuWorker.objects.filter(
            provider=self.name,
            host__in=[h.hostname for h in self.hosts],
            status__in=GpuWorker.LIVE_STATUSES,
        )

    def _plan_cpu(self, count: int, gpu_type: str) -> tuple[list[WorkerSpec], str]:
        specs, shortfall = super()._plan_cpu(count, gpu_type)
        load = collections.Counter(self._live_here().values_list("host", flat=True))
        placed = []
        for spec in specs:
            host = min(self.hosts, key=lambda h: load[h.hostname])  # ties: the first host
            load[host.hostname] += 1
            placed.append(dataclasses.replace(spec, host=host.hostname))
        return placed, shortfall

    def command(self, worker: GpuWorker) -> list[str]:
        host = self._host(worker.host)
        # `ip netns exec`, unshare and sh each exec the next: the pid the provisioner records is the
        # worker's own.
        return [
            "ip", "netns", "exec", host.netns,
            "unshare", "--uts", "--", "sh", "-c", 'hostname "$0" && exec "$@"', host.hostname,
            *gpuworker_command(worker), "--listen-host", host.address,
        ]  # fmt: skip

    def start(self, worker: GpuWorker) -> str:
        host = self._host(worker.host)
        self.env = {
            **os.environ,
            **self.host_env,
            "WORKER_MULTI_HOST": "true",
            "WEIGHTS_DIR": host.weights_dir,
        }
        return super().start(worker)
