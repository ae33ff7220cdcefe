"""A two-rank communicator between one source and one target worker.

Contract (one module per backend, same shape): a ``PairGroup`` is built from a rendezvous store
(already namespaced for one migration) plus this side's rank (0 = source, 1 = target). It moves byte
tensors to and from the peer in issue order, honours a deadline on every wait, and ``abort()`` tears
the connection down so that a peer blocked on it fails at once instead of waiting for its timeout.

No global ``init_process_group`` is involved: the backend object is constructed directly on a
``PrefixStore``, so workers that join or leave the pool never force anyone to rebuild a world.
"""

from __future__ import annotations

import datetime
import ipaddress
import pkgutil
import socket
from typing import Any, ClassVar

import torch

BACKENDS: dict[str, str] = {
    "gloo": "workers.runtime.transport.gloo:GlooPairGroup",
    "nccl": "workers.runtime.transport.nccl:NcclPairGroup",
}

SOURCE_RANK = 0
TARGET_RANK = 1


class PairGroup:
    name: ClassVar[str] = ""

    def __init__(
        self, store: Any, rank: int, *, device: torch.device, local_host: str, timeout_s: float
    ) -> None:
        self.store = store
        self.rank = rank
        self.peer = 1 - rank
        self.device = device
        self.local_host = local_host
        self.timeout_s = timeout_s

    def isend(self, tensor: torch.Tensor) -> Any:
        """Start sending ``tensor`` to the peer; returns a handle for ``wait``."""
        raise NotImplementedError

    def irecv(self, tensor: torch.Tensor) -> Any:
        """Start receiving into ``tensor`` from the peer; returns a handle for ``wait``."""
        raise NotImplementedError

    def wait(self, handle: Any, timeout_s: float) -> None:
        """Block until ``handle`` has completed (its buffer may be reused) or raise."""
        raise NotImplementedError

    def abort(self) -> None:
        """Break the connection now; safe to call more than once and after a failure."""
        raise NotImplementedError

    def close(self) -> None:
        """Release the connection after a successful exchange."""
        self.abort()


def timedelta(seconds: float) -> datetime.timedelta:
    return datetime.timedelta(seconds=max(seconds, 0.001))


def backend_for_device(device: torch.device | str) -> str:
    """NCCL between GPUs, Gloo on CPU: the device alone decides, both sides must agree."""
    device = torch.device(device)
    if device.type == "cuda":
        return "nccl"
    if device.type == "cpu":
        return "gloo"
    raise ValueError(f"no state transport for device type {device.type!r}")


def pair_group_class(backend: str) -> type[PairGroup]:
    try:
        dotted = BACKENDS[backend]
    except KeyError as exc:
        raise ValueError(f"unknown transport backend {backend!r}; known: {sorted(BACKENDS)}") from exc
    return pkgutil.resolve_name(dotted)


def store_server(host: str, port: int = 0, *, timeout: datetime.timedelta) -> Any:
    """The server side of a rendezvous ``TCPStore`` (a migration listener's, a weight server's),
    listening on ``host`` only.

    Given just a host, TCPStore's server listens on every interface (torch 2.13: ``*:port``, IPv4
    and IPv6): a worker's listeners were reachable on all of its host's addresses, not only on the
    ``--listen-host`` it advertises. The socket is bound here and handed over (``master_listen_fd``),
    so the operator's choice of network is the one the listener serves.
    """
    from torch._C._distributed_c10d import TCPStore

    family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
    listening = socket.socket(family, kind, proto)
    try:
        listening.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listening.bind(address)
        listening.listen(socket.SOMAXCONN)
        bound_port = listening.getsockname()[1]
    except OSError:
        listening.close()
        raise
    return TCPStore(
        host, bound_port, None, True, timeout, wait_for_workers=False, master_listen_fd=listening.detach()
    )


def local_address_towards(host: str, port: int) -> str:
    """The local IP that routes to ``host`` (no packet is sent: a UDP connect only picks a route)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        try:
            probe.connect((host, port))
            return probe.getsockname()[0]
        except OSError:
            return "127.0.0.1"


def is_loopback(host: str) -> bool:
    """Whether ``host`` (an address or a name) is a loopback address: peers on another host cannot
    reach it. A name counts as loopback when any address it resolves to is (``localhost``, or a
    hostname mapped to 127.0.1.1 as some distributions do); one that does not resolve is left to the
    listener's bind to report."""
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        pass
    try:
        infos = socket.getaddrinfo(host, None)
    except OSError:
        return False
    return any(ipaddress.ip_address(info[4][0].split("%")[0]).is_loopback for info in infos)
