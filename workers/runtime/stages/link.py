"""Hand-off between stage workers: one-way links over ``torch.distributed`` point-to-point.

A link joins an upstream worker (rank 0, `LinkSender`) to a downstream one (rank 1, `LinkReceiver`)
through the migration transport's two-rank pair groups (``workers.runtime.transport.pair``: Gloo on
CPU, NCCL between GPUs, chosen by the device alone; no global world, so workers join and leave
without anyone rebuilding a communicator). The rendezvous is a ``TCPStore`` the deployment (or the
test's driver) hosts; each link uses its own prefix of it.

Wire, per message: ``int64[2] = [meta_len, payload_bytes]``, the JSON meta (kind, meta, payload dtype
and shape) as ``uint8``, then the payload's bytes, in issue order on the pair (Gloo and NCCL both
deliver the sends of one pair in order).

Bounded buffers. A sent tensor stays in device memory until its transfer completes, and a transfer
completes only when the receiver takes it, so a slow downstream stage would pin ever more device
memory upstream. Each sender therefore keeps at most ``max_in_flight_bytes`` posted (always at least
one message, however large). A message that does not fit waits in a FIFO queue *in host memory*: its
tensors are copied to the host (pinned, so the later copy back is asynchronous) and the device copy
is released; the sender's completion thread retires finished transfers in order and posts queued
messages as room frees, copying them back to the device first (NCCL sends device memory only). On a CPU worker the payload already lives in host memory: queuing
it costs no copy, and the bound still caps what Gloo holds in flight. ``stats`` counts spills.
"""

from __future__ import annotations

import json
import threading
from collections import deque
from dataclasses import dataclass, field
from typing import Any

import torch
from torch._C._distributed_c10d import PrefixStore, TCPStore

from workers.runtime.models.base import DTYPES_BY_NAME, dtype_name
from workers.runtime.stages.pipeline import StageMessage
from workers.runtime.transport.pair import (
    SOURCE_RANK,
    TARGET_RANK,
    PairGroup,
    backend_for_device,
    local_address_towards,
    pair_group_class,
    timedelta,
)

DEFAULT_MAX_IN_FLIGHT_BYTES = 256 << 20
DEFAULT_TIMEOUT_S = 60.0
DEFAULT_IDLE_TIMEOUT_S = 24 * 3600.0


class LinkError(RuntimeError):
    """A stage link failed: the peer went away or a message did not arrive within the timeout."""


def resolve_device(text: str | torch.device) -> torch.device:
    """``cuda`` → ``cuda:<current>``: an NCCL pair group needs an indexed device, and a tensor's
    device always carries one, so a bare ``cuda`` would never compare equal to it."""
    device = torch.device(text)
    if device.type == "cuda" and device.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return device


def parse_store_address(address: str) -> tuple[str, int]:
    host, sep, port = address.rpartition(":")
    if not sep or not port.isdigit():
        raise ValueError(f"store address must be host:port, got {address!r}")
    return host.strip("[]"), int(port)


def connect_store(address: str, *, timeout_s: float = DEFAULT_TIMEOUT_S) -> TCPStore:
    host, port = parse_store_address(address)
    return TCPStore(host, port, is_master=False, timeout=timedelta(timeout_s))


def open_pair(
    store: TCPStore, link: str, rank: int, *, device: torch.device, timeout_s: float = DEFAULT_TIMEOUT_S
) -> PairGroup:
    """The pair group of link ``link`` (blocks until the peer opens it too)."""
    local = local_address_towards(store.host, store.port)
    group_class = pair_group_class(backend_for_device(device))
    return group_class(
        PrefixStore(f"stage-link/{link}/", store), rank, device=device, local_host=local, timeout_s=timeout_s
    )


@dataclass
class _Outgoing:
    frames: list[torch.Tensor]
    nbytes: int
    spilled: bool = False
    handles: list[Any] = field(default_factory=list)


@dataclass
class LinkStats:
    messages: int = 0
    bytes: int = 0
    spilled_messages: int = 0
    spilled_bytes: int = 0
    peak_in_flight_bytes: int = 0

    def as_dict(self) -> dict[str, int]:
        return dict(self.__dict__)


class LinkSender:
    """The upstream end of a link: ordered, bounded sends that spill to host memory (module docs).

    ``send`` never waits for the peer. A completion thread waits for the posted transfers in order
    (a Gloo send reports completion only through a blocking ``wait``, never through polling), frees
    their room and posts queued messages that now fit. A transfer that fails or stalls past
    ``timeout_s`` breaks the link: the next ``send``/``flush`` raises `LinkError`.
    """

    def __init__(
        self,
        group: PairGroup,
        *,
        max_in_flight_bytes: int = DEFAULT_MAX_IN_FLIGHT_BYTES,
        timeout_s: float = DEFAULT_TIMEOUT_S,
    ) -> None:
        if group.rank != SOURCE_RANK:
            raise ValueError("a link sender is rank 0 of its pair")
        if max_in_flight_bytes < 1:
            raise ValueError("max_in_flight_bytes must be >= 1")
        self.group = group
        self.device = group.device
        self.max_in_flight_bytes = max_in_flight_bytes
        self.timeout_s = timeout_s
        self.stats = LinkStats()
        self._in_flight: deque[_Outgoing] = deque()
        self._in_flight_bytes = 0
        self._queue: deque[_Outgoing] = deque()
        self._error: BaseException | None = None
        self._closed = False
        self._changed = threading.Condition()
        self._completer = threading.Thread(target=self._complete, name="stage-link-sender", daemon=True)
        self._completer.start()

    @property
    def in_flight_bytes(self) -> int:
        return self._in_flight_bytes

    @property
    def queued(self) -> int:
        return len(self._queue)

    def send(self, message: StageMessage) -> None:
        """Send ``message`` (its tensor must not be modified afterwards); never waits for the peer."""
        outgoing = self._encode(message)
        with self._changed:
            self._raise_if_broken()
            self.stats.messages += 1
            self.stats.bytes += outgoing.nbytes
            if self._queue or not self._fits(outgoing.nbytes):
                self._spill(outgoing)
                self._queue.append(outgoing)
            else:
                self._post(outgoing)
            self._changed.notify_all()

    def flush(self, timeout_s: float | None = None) -> None:
        """Block until the peer has taken every message sent so far."""
        with self._changed:
            drained = self._changed.wait_for(
                lambda: self._error is not None or not (self._queue or self._in_flight),
                timeout=self.timeout_s if timeout_s is None else timeout_s,
            )
            self._raise_if_broken()
            if not drained:
                raise LinkError(
                    f"{len(self._queue) + len(self._in_flight)} message(s) not taken by the peer "
                    f"within {self.timeout_s:.1f}s"
                )

    def close(self) -> None:
        with self._changed:
            self._closed = True
            self._changed.notify_all()
        self.group.close()

    def _complete(self) -> None:
        while True:
            with self._changed:
                self._changed.wait_for(lambda: self._closed or bool(self._in_flight))
                if self._closed:
                    return
                head = self._in_flight[0]
            try:
                for handle in head.handles:
                    self.group.wait(handle, self.timeout_s)
            except Exception as exc:  # Gloo/NCCL raise RuntimeError subclasses on timeouts and resets
                with self._changed:
                    if not self._closed:
                        self._error = exc
                    self._changed.notify_all()
                return
            with self._changed:
                self._in_flight.popleft()
                self._in_flight_bytes -= head.nbytes
                while self._queue and self._fits(self._queue[0].nbytes):
                    self._post(self._unspill(self._queue.popleft()))
                self._changed.notify_all()

    def _raise_if_broken(self) -> None:
        if self._error is not None:
            raise LinkError(f"the link to the downstream worker broke: {self._error}") from self._error

    def _fits(self, nbytes: int) -> bool:
        return not self._in_flight or self._in_flight_bytes + nbytes <= self.max_in_flight_bytes

    def _post(self, outgoing: _Outgoing) -> None:
        outgoing.handles = [self.group.isend(frame) for frame in outgoing.frames]
        self._in_flight.append(outgoing)
        self._in_flight_bytes += outgoing.nbytes
        self.stats.peak_in_flight_bytes = max(self.stats.peak_in_flight_bytes, self._in_flight_bytes)

    def _spill(self, outgoing: _Outgoing) -> None:
        outgoing.spilled = True
        self.stats.spilled_messages += 1
        self.stats.spilled_bytes += outgoing.nbytes
        if self.device.type != "cpu":
            outgoing.frames = [_to_pinned_host(frame) for frame in outgoing.frames]

    def _unspill(self, outgoing: _Outgoing) -> _Outgoing:
        if outgoing.spilled and self.device.type != "cpu":
            with torch.cuda.device(self.device):
                outgoing.frames = [frame.to(self.device, non_blocking=True) for frame in outgoing.frames]
        return outgoing

    def _encode(self, message: StageMessage) -> _Outgoing:
        payload = message.tensor
        header: dict[str, Any] = {"kind": message.kind, "meta": message.meta}
        if payload is not None:
            payload = payload.detach().to(self.device).contiguous()
            header["dtype"] = dtype_name(payload.dtype)
            header["shape"] = list(payload.shape)
        raw = json.dumps(header, separators=(",", ":")).encode()
        body = torch.frombuffer(bytearray(raw), dtype=torch.uint8).to(self.device)
        payload_bytes = 0 if payload is None else payload.numel() * payload.element_size()
        lengths = torch.tensor([len(raw), payload_bytes], dtype=torch.int64, device=self.device)
        frames = [lengths, body]
        if payload_bytes:
            frames.append(payload.reshape(-1).view(torch.uint8))  # type: ignore[union-attr]
        return _Outgoing(frames, nbytes=sum(f.numel() * f.element_size() for f in frames))


class LinkReceiver:
    """The downstream end of a link: messages in the order they were sent.

    ``recv`` waits up to ``idle_timeout_s`` for a message to begin (a stage worker may sit idle
    between sessions) and up to ``timeout_s`` for each further part of it.
    """

    def __init__(
        self,
        group: PairGroup,
        *,
        timeout_s: float = DEFAULT_TIMEOUT_S,
        idle_timeout_s: float = DEFAULT_IDLE_TIMEOUT_S,
    ) -> None:
        if group.rank != TARGET_RANK:
            raise ValueError("a link receiver is rank 1 of its pair")
        self.group = group
        self.device = group.device
        self.timeout_s = timeout_s
        self.idle_timeout_s = idle_timeout_s

    def recv(self) -> StageMessage:
        lengths = self._take(torch.empty(2, dtype=torch.int64, device=self.device), self.idle_timeout_s)
        meta_len, payload_bytes = (int(v) for v in lengths.tolist())
        body = self._take(torch.empty(meta_len, dtype=torch.uint8, device=self.device), self.timeout_s)
        header = json.loads(bytes(body.cpu().numpy()).decode())
        tensor = None
        if payload_bytes:
            raw = self._take(
                torch.empty(payload_bytes, dtype=torch.uint8, device=self.device), self.timeout_s
            )
            tensor = raw.view(DTYPES_BY_NAME[header["dtype"]]).view(header["shape"])
        elif "shape" in header:
            tensor = torch.empty(header["shape"], dtype=DTYPES_BY_NAME[header["dtype"]], device=self.device)
        return StageMessage(header["kind"], header["meta"], tensor)

    def close(self) -> None:
        self.group.close()

    def _take(self, buffer: torch.Tensor, timeout_s: float) -> torch.Tensor:
        handle = self.group.irecv(buffer)
        try:
            self.group.wait(handle, timeout_s)
        except Exception as exc:  # Gloo/NCCL raise RuntimeError subclasses on timeouts and resets
            self.group.abort()
            raise LinkError(f"receiving from the upstream worker failed: {exc}") from exc
        return buffer


def _to_pinned_host(tensor: torch.Tensor) -> torch.Tensor:
    host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=torch.cuda.is_available())
    host.copy_(tensor)
    return host
