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


def local_address_towards(host: str, port: int) -> str:
    """The local IP that routes to ``host`` (no packet is sent: a UDP connect only picks a route)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        try:
            probe.connect((host, port))
            return probe.getsockname()[0]
        except OSError:
            return "127.0.0.1"
