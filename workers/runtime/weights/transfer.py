"""Weights multicast along a chain of workers over ``torch.distributed`` point-to-point.

BlitzScale §5.1 loads a new instance's parameters from GPUs (or the one host copy) that already hold
them, as serial forwarding chains ``S → T1 → T2 …``: every receiver forwards what it has while it is
still receiving the rest, so a chain to three targets takes little longer than to one. Here:

* Every holder runs a ``WeightServer``: a ``TCPStore`` on an ephemeral port (its advertised
  ``host:port``). A receiver *pulls*: it connects as a store client, pushes a hello naming the
  weights (``weights_id``) and the blocks it still needs (``[block, first_piece]`` pairs: any subset,
  resuming inside a block), and both sides build a two-rank pair group (Gloo on CPU, NCCL on CUDA)
  directly on a ``PrefixStore`` unique to that request: the same discipline as session migration
  (``workers.runtime.transport``), no global communicator, nothing rebuilt when workers come and go.
* A receiver is itself a holder from the start: its ``WeightsReceiver`` runs a server over the
  buffers it is filling, and that server sends piece *i* downstream as soon as piece *i* has arrived
  **and passed its checksum**, while piece *i + 1* is still on the wire from upstream. Corrupt bytes
  are never forwarded; downstream verifies again against its own trusted manifest anyway.
* ``link_mbps`` paces a node's egress (one token bucket shared by all its outgoing links: a NIC) and
  its ingress, so a network slower than loopback can be emulated on one box with both sides honest.

Failure handling: a receiver walks its ``sources`` in order. A source that dies (connection lost), a
piece that fails its checksum, a stall longer than ``stall_timeout_s`` or a refusal ends that source;
the receiver keeps every verified piece and asks the next source only for what is still missing,
finally reading the rest from local storage (safetensors, verified block by block). Only when every
block is complete and verified does ``receive`` return; otherwise it raises ``WeightsUnavailable``
and its own server stops serving, so downstream receivers fall back in turn. Weights are never
installed from an incomplete or corrupt set.

API (what the worker daemon calls; see docs/scaleout.md)::

    # a holder (a serving worker, the host cache): serve a complete, verified set
    packed = PackedWeights.from_state_dict(preset, model.net.state_dict())   # or load_weights(path)
    server = weights_serve(packed, device="cpu", host="10.0.0.5", link_mbps=None)
    server.address                      # "10.0.0.5:41234": advertise it in the parameter pool
    server.close()

    # a new worker at position k of a chain [S, T1, T2, …] (plan from scheduling.core.scaleplan)
    receiver = WeightsReceiver(manifest, device="cpu", host="10.0.0.7")   # serves downstream at once
    receiver.address                    # advertise before receiving: T(k+1) pulls from it
    result = receiver.receive(sources=chain_sources(chain_addresses, k), disk_path=path,
                              timeout_s=300)          # raises WeightsUnavailable
    model = build_model(manifest.model, device="cpu", weights=result.packed.state_dict())
    result.source, result.bytes_by_source, result.attempts, result.timings
    # receiver keeps serving the now complete weights until receiver.close()

    # or in one call (no downstream serving unless serve=True; then close result.server yourself)
    result = weights_receive(manifest, sources=[...], disk_path=path, device="cpu")
"""

from __future__ import annotations

import collections
import contextlib
import json
import os
import socket
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch._C._distributed_c10d import PrefixStore, TCPStore

from workers.runtime.transport.pair import (
    SOURCE_RANK,
    TARGET_RANK,
    PairGroup,
    backend_for_device,
    local_address_towards,
    pair_group_class,
    store_server,
    timedelta,
)

from .manifest import (
    PackedWeights,
    WeightsManifest,
    WeightsManifestError,
    block_views,
    checksum,
    load_blocks,
)

HELLO_QUEUE = "wx/hello"
DEFAULT_STALL_TIMEOUT_S = 10.0
DEFAULT_CONNECT_TIMEOUT_S = 10.0
# Pieces posted ahead on one link: enough to keep the wire busy while the last one is verified.
WINDOW = 4
_POLL_MIN_S = 0.0005
_POLL_MAX_S = 0.005

ProgressFn = Callable[[int, int], Any]


# --- errors ----------------------------------------------------------------------------------------


class WeightsTransferError(RuntimeError):
    """One source failed to deliver; the receiver moves on to the next one."""

    def __init__(self, message: str, *, stage: str, source: str = "") -> None:
        super().__init__(f"[{stage}] {source + ': ' if source else ''}{message}")
        self.stage = stage
        self.source = source


class WeightsSourceLost(WeightsTransferError):
    """The source's process or connection went away mid-transfer."""


class WeightsTimeout(WeightsTransferError, TimeoutError):
    """No progress within the stall timeout, or the overall deadline passed."""


class WeightsChecksumMismatch(WeightsTransferError):
    """A received piece differs from the manifest's checksum."""


class WeightsRefused(WeightsTransferError):
    """The source does not hold these weights (another ``weights_id``) or another backend."""


class WeightsUnavailable(RuntimeError):
    """Every source and local storage failed: nothing was installed."""

    def __init__(self, message: str, attempts: list[dict[str, Any]]) -> None:
        super().__init__(message)
        self.attempts = attempts


def _classify(exc: BaseException, stage: str, source: str) -> WeightsTransferError:
    if isinstance(exc, WeightsTransferError):
        return exc
    text = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
    lowered = text.lower()
    if isinstance(exc, TimeoutError) or "timed out" in lowered or "timeout" in lowered:
        return WeightsTimeout(text, stage=stage, source=source)
    return WeightsSourceLost(f"{type(exc).__name__}: {text}", stage=stage, source=source)


# --- pacing ----------------------------------------------------------------------------------------


class LinkPacer:
    """A token bucket emulating a link of ``mbps`` megabits per second (shared by a node's links).

    Each piece occupies the link for ``nbytes / rate`` after the previous one, so concurrent links
    through one pacer share its rate, like flows through one NIC. The sender waits for the *start*
    of its piece's slot (``until_start``) and the receiver for the *end* of its slot: a piece counts
    as arrived one serialization time after it started, which is a real link's store-and-forward
    delay, charged once per hop (not once per side).
    """

    def __init__(self, mbps: float) -> None:
        if not mbps > 0:
            raise ValueError(f"link_mbps must be positive, got {mbps!r}")
        self.bytes_per_s = mbps * 1e6 / 8
        self._busy_until = 0.0
        self._lock = threading.Lock()

    def take(self, nbytes: int, *, until_start: bool = False) -> None:
        with self._lock:
            start = max(time.monotonic(), self._busy_until)
            self._busy_until = start + nbytes / self.bytes_per_s
            until = start if until_start else self._busy_until
        delay = until - time.monotonic()
        if delay > 0:
            time.sleep(delay)


def _pacer(link_mbps: float | None) -> LinkPacer | None:
    return None if link_mbps is None else LinkPacer(link_mbps)


# --- holders ---------------------------------------------------------------------------------------


class _Holder:
    """What a server sends from: a manifest, one buffer per block, and which pieces are verified."""

    manifest: WeightsManifest
    buffers: list[torch.Tensor]

    def wait_piece(self, block: int, piece: int, timeout_s: float) -> bool:
        raise NotImplementedError


class _CompleteHolder(_Holder):
    def __init__(self, packed: PackedWeights) -> None:
        self.manifest, self.buffers = packed.manifest, packed.buffers

    def wait_piece(self, block: int, piece: int, timeout_s: float) -> bool:
        return True


class _FillingHolder(_Holder):
    """Buffers being filled by a receiver. Pieces of a block are verified in order, so per block the
    count of verified pieces is all there is to know; ``fail`` wakes every waiting server."""

    def __init__(
        self, manifest: WeightsManifest, device: torch.device, blocks: Sequence[int] | None = None
    ) -> None:
        self.manifest = manifest
        wanted = set(range(len(manifest.blocks))) if blocks is None else set(blocks)
        # A block not wanted (a partial receive: some components only) gets no memory and counts
        # as complete; such a holder is never served (`WeightsReceiver` with ``blocks``).
        self.buffers = [
            torch.empty(b.nbytes if b.index in wanted else 0, dtype=torch.uint8, device=device)
            for b in manifest.blocks
        ]
        self.verified = [self.piece_count(b.index) if b.index not in wanted else 0 for b in manifest.blocks]
        self.failed = False
        self._changed = threading.Condition()

    def piece_count(self, block: int) -> int:
        return len(self.manifest.blocks[block].pieces)

    def missing(self) -> list[tuple[int, int]]:
        with self._changed:
            return [(b, done) for b, done in enumerate(self.verified) if done < self.piece_count(b)]

    def mark(self, block: int, piece: int) -> None:
        with self._changed:
            if piece != self.verified[block]:
                raise RuntimeError(f"piece {piece} of block {block} verified out of order")
            self.verified[block] = piece + 1
            self._changed.notify_all()

    def fail(self) -> None:
        with self._changed:
            self.failed = True
            self._changed.notify_all()

    def wait_piece(self, block: int, piece: int, timeout_s: float) -> bool:
        # Verified pieces stay servable after a failure (their bytes are right); missing ones never come.
        with self._changed:
            self._changed.wait_for(lambda: self.failed or self.verified[block] > piece, timeout=timeout_s)
            return self.verified[block] > piece


# --- server ----------------------------------------------------------------------------------------


def _offered(hello: dict[str, Any]) -> list[str]:
    """The receiver's backends, preferred first (a receiver of an earlier version sent one)."""
    offered = hello.get("backends")
    if isinstance(offered, list) and all(isinstance(b, str) for b in offered):
        return offered
    return [str(hello.get("backend"))]


def _parse_address(address: str) -> tuple[str, int]:
    host, sep, port = address.rpartition(":")
    if not sep or not port.isdigit():
        raise ValueError(f"weights source address must be host:port, got {address!r}")
    return host.strip("[]"), int(port)


def _key(request_id: str, name: str) -> str:
    return f"wx/{request_id}/{name}"


def wire_backends(device: torch.device) -> list[str]:
    """The backends a side can use for ``device``, preferred first: its own (NCCL between GPUs),
    then Gloo through host staging buffers when its weights sit on a GPU, so a GPU worker can
    pull from a CPU host cache (or a CPU holder from a GPU) instead of refusing it."""
    own = backend_for_device(device)
    return [own] if own == "gloo" else [own, "gloo"]


def negotiate_backend(offered: Sequence[str], device: torch.device) -> str | None:
    """The first of the receiver's ``offered`` backends this side can use for ``device`` (or None)."""
    ours = wire_backends(device)
    return next((backend for backend in offered if backend in ours), None)


class WeightServer:
    """Serves any subset of one set of weights to any number of receivers at once.

    One thread polls the hello queue of this server's ``TCPStore``; each accepted request gets its own
    thread and pair group, closed when the receiver has confirmed (or on any failure).
    """

    def __init__(
        self,
        holder: _Holder,
        *,
        device: torch.device | str = "cpu",
        host: str = "127.0.0.1",
        port: int = 0,
        link_mbps: float | None = None,
        stall_timeout_s: float = DEFAULT_STALL_TIMEOUT_S,
        piece_wait_s: float = 600.0,
    ) -> None:
        self.holder = holder
        self.device = torch.device(device)
        self.backend = backend_for_device(self.device)
        self.host = host
        self.stall_timeout_s = stall_timeout_s
        # How long a link waits for a piece its holder does not have yet (an upstream that is slow
        # or falling back); the receiver's own stall timeout usually fires first.
        self.piece_wait_s = piece_wait_s
        self.egress = _pacer(link_mbps)
        self._server: Any = store_server(host, port, timeout=timedelta(60))
        self.port = int(self._server.port)
        self._closed = threading.Event()
        self._links: set[PairGroup] = set()
        self._lock = threading.Lock()
        self.served: list[dict[str, Any]] = []  # one record per finished request (tests, benchmarks)
        # Store connections for the per-request threads, reused: a fresh connection to this very
        # server sometimes took 5 s to open here (torch 2.13, libuv store; 1 in ~20), which a
        # scale-out cannot afford. Two are opened now, more only under concurrent requests.
        self._clients: list[Any] = [self._connect() for _ in range(2)]
        self._thread = threading.Thread(target=self._accept_loop, name="weights-serve", daemon=True)
        self._thread.start()

    @property
    def address(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{host}:{self.port}"

    def close(self) -> None:
        self._closed.set()
        with self._lock:
            links = list(self._links)
        for group in links:
            group.abort()
        self._thread.join(timeout=2)

    def __enter__(self) -> WeightServer:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def _connect(self) -> Any:
        return TCPStore(self.host, self.port, None, False, timedelta(60))

    def _take_client(self) -> Any:
        with self._lock:
            client = self._clients.pop() if self._clients else None
        return client if client is not None else self._connect()

    def _give_client(self, client: Any) -> None:
        with self._lock:
            self._clients.append(client)

    def _accept_loop(self) -> None:
        client = self._connect()
        pause = _POLL_MIN_S
        while not self._closed.is_set():
            # Polled without blocking: TCPStore's blocking queue_pop can lose wakeups (see
            # transport/migration.py), and a poll lets close() stop this thread promptly.
            try:
                raw = client.queue_pop(HELLO_QUEUE, False)
            except Exception as exc:
                if type(exc).__name__ != "QueueEmptyError":
                    return
                self._closed.wait(pause)
                pause = min(pause * 2, _POLL_MAX_S)
                continue
            pause = _POLL_MIN_S
            hello = json.loads(raw)
            threading.Thread(target=self._serve, args=(hello,), name="weights-link", daemon=True).start()

    def _refusal(self, hello: dict[str, Any]) -> str | None:
        if hello.get("weights_id") != self.holder.manifest.weights_id:
            return (
                f"this server holds weights {self.holder.manifest.weights_id}, not {hello.get('weights_id')}"
            )
        if hello.get("piece_bytes") != self.holder.manifest.piece_bytes:
            # Both sides cut blocks into pieces from their own manifest: the cuts must agree.
            return f"pieces of {hello.get('piece_bytes')} B requested, this server cuts {self.holder.manifest.piece_bytes} B"
        if negotiate_backend(_offered(hello), self.device) is None:
            return (
                f"receiver offers {', '.join(_offered(hello))}, this server ({self.device}) speaks "
                f"{', '.join(wire_backends(self.device))}"
            )
        if isinstance(self.holder, _FillingHolder) and self.holder.failed:
            return "this holder failed to obtain the weights"
        return None

    def _serve(self, hello: dict[str, Any]) -> None:
        request_id = str(hello["id"])
        started = time.monotonic()
        record: dict[str, Any] = {"id": request_id, "receiver": hello.get("receiver"), "bytes": 0}
        group: PairGroup | None = None
        client: Any = None
        try:
            client = self._take_client()
            refusal = self._refusal(hello)
            backend = negotiate_backend(_offered(hello), self.device)
            client.set(
                _key(request_id, "accept"),
                json.dumps({"ok": refusal is None, "error": refusal, "backend": backend}),
            )
            if refusal is not None:
                record["error"] = refusal
                return
            staged = backend != self.backend  # Gloo from GPU buffers: each piece goes through host memory
            record["backend"], record["staged"] = backend, staged
            group = pair_group_class(backend)(
                PrefixStore(_key(request_id, "pg/"), client),
                SOURCE_RANK,
                device=torch.device("cpu") if staged else self.device,
                local_host=self.host,
                timeout_s=self.stall_timeout_s,
            )
            with self._lock:
                self._links.add(group)
            record["bytes"] = self._stream(group, hello["requests"], staged=staged)
            client.wait([_key(request_id, "done")], timedelta(self.stall_timeout_s))
            record["ok"] = json.loads(client.get(_key(request_id, "done"))).get("ok", False)
            # Only a connection that finished cleanly goes back (a failed one may hold a half-read reply).
            self._give_client(client)
        except Exception as exc:
            record["error"] = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
        finally:
            if group is not None:
                with self._lock:
                    self._links.discard(group)
                group.abort()
            record["seconds"] = time.monotonic() - started
            self.served.append(record)

    def _stream(self, group: PairGroup, requests: list[list[int]], *, staged: bool = False) -> int:
        holder, manifest = self.holder, self.holder.manifest
        # (handle, host copy): a staged piece's host buffer lives until its send completed.
        window: collections.deque[tuple[Any, torch.Tensor | None]] = collections.deque()
        sent = 0
        for block, first in requests:
            for piece in range(first, len(manifest.blocks[block].pieces)):
                if not holder.wait_piece(block, piece, self.piece_wait_s) or self._closed.is_set():
                    raise WeightsSourceLost("holder has no such piece (it failed or closed)", stage="serve")
                start, stop = manifest.piece_range(block, piece)
                if self.egress is not None:
                    self.egress.take(stop - start, until_start=True)
                piece_data = holder.buffers[block][start:stop]
                host_copy = piece_data.to("cpu") if staged else None
                window.append((group.isend(piece_data if host_copy is None else host_copy), host_copy))
                sent += stop - start
                if len(window) > WINDOW:
                    group.wait(window.popleft()[0], self.stall_timeout_s)
        while window:
            group.wait(window.popleft()[0], self.stall_timeout_s)
        return sent


def weights_serve(
    packed: PackedWeights,
    *,
    device: torch.device | str | None = None,
    host: str = "127.0.0.1",
    port: int = 0,
    link_mbps: float | None = None,
    stall_timeout_s: float = DEFAULT_STALL_TIMEOUT_S,
) -> WeightServer:
    """Serve a complete set of weights (verify it first if it came from somewhere untrusted)."""
    return WeightServer(
        _CompleteHolder(packed),
        device=packed.device if device is None else device,
        host=host,
        port=port,
        link_mbps=link_mbps,
        stall_timeout_s=stall_timeout_s,
    )


# --- receiver --------------------------------------------------------------------------------------


@dataclass
class ReceiveResult:
    """``packed``: the complete, verified weights (``packed.state_dict()`` builds the model); None
    after a partial receive (``blocks=``: `WeightsReceiver.block_tensors`).

    ``source``: where most bytes came from (a ``host:port`` or ``"disk"``); ``bytes_by_source``: every
    source that delivered verified bytes; ``attempts``: one record per source tried, failures with
    their ``stage`` and ``error``; ``timings``: ``connect_s`` (store, hello, pair groups),
    ``transfer_s`` (pieces on the wire and verified), ``disk_s``, ``seconds`` (the whole call)."""

    packed: PackedWeights | None
    source: str
    bytes_by_source: dict[str, int]
    attempts: list[dict[str, Any]]
    timings: dict[str, float]
    server: WeightServer | None = field(default=None, repr=False)

    @property
    def fell_back(self) -> bool:
        return any(not attempt["ok"] for attempt in self.attempts)


class WeightsReceiver:
    """A new worker's side of a chain: receives into its own buffers and serves them downstream.

    Construct it before the transfer starts (its ``address`` must be known to the next receiver of
    the chain); ``receive`` fills it from ``sources`` then ``disk_path``. After a success its server
    keeps serving the complete weights until ``close``.
    """

    def __init__(
        self,
        manifest: WeightsManifest,
        *,
        device: torch.device | str = "cpu",
        host: str = "127.0.0.1",
        port: int = 0,
        link_mbps: float | None = None,
        serve: bool = True,
        stall_timeout_s: float = DEFAULT_STALL_TIMEOUT_S,
        blocks: Sequence[int] | None = None,
    ) -> None:
        if blocks is not None and serve:
            raise ValueError("a partial receive (blocks=...) serves nothing: pass serve=False")
        self.manifest = manifest
        self.device = torch.device(device)
        self.backend = backend_for_device(self.device)
        self.blocks = None if blocks is None else sorted(set(blocks))
        self.holder = _FillingHolder(manifest, self.device, self.blocks)
        self.ingress = _pacer(link_mbps)
        self.server = (
            WeightServer(
                self.holder,
                device=self.device,
                host=host,
                port=port,
                link_mbps=link_mbps,
                stall_timeout_s=stall_timeout_s,
            )
            if serve
            else None
        )
        self._received = False

    @property
    def address(self) -> str | None:
        return None if self.server is None else self.server.address

    def close(self) -> None:
        self.holder.fail()
        if self.server is not None:
            self.server.close()

    def __enter__(self) -> WeightsReceiver:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def receive(
        self,
        sources: Sequence[str] = (),
        *,
        disk_path: str | os.PathLike[str] | None = None,
        timeout_s: float = 600.0,
        stall_timeout_s: float = DEFAULT_STALL_TIMEOUT_S,
        connect_timeout_s: float = DEFAULT_CONNECT_TIMEOUT_S,
        progress: ProgressFn | None = None,
    ) -> ReceiveResult:
        """Fill every block from ``sources`` in order, then ``disk_path``; verified, or raise.

        Raises ``WeightsUnavailable`` (with ``attempts``) when the weights could not be completed;
        then nothing is returned to install and this receiver serves nothing further.
        """
        if self._received:
            raise RuntimeError("a WeightsReceiver receives once")
        self._received = True
        started = time.monotonic()
        deadline = started + timeout_s
        attempts: list[dict[str, Any]] = []
        by_source: dict[str, int] = {}
        timings = {"connect_s": 0.0, "transfer_s": 0.0, "disk_s": 0.0}
        total = self.manifest.total_bytes
        counter = _Progress(total - self._missing_bytes(), total, progress)
        for address in sources:
            if not self.holder.missing():
                break
            attempt: dict[str, Any] = {"source": address, "ok": False}
            attempts.append(attempt)
            try:
                self._pull(address, deadline, stall_timeout_s, connect_timeout_s, counter, timings, attempt)
                attempt["ok"] = True
            except WeightsTransferError as exc:
                attempt.update(stage=exc.stage, error=str(exc), kind=type(exc).__name__)
            if attempt.get("bytes"):
                by_source[address] = by_source.get(address, 0) + attempt["bytes"]
        if self.holder.missing() and disk_path is not None:
            attempt = {"source": "disk", "ok": False}
            attempts.append(attempt)
            disk_started = time.monotonic()
            try:
                attempt["bytes"] = self._read_disk(disk_path, counter)
                attempt["ok"] = True
                by_source["disk"] = attempt["bytes"]
            except (WeightsManifestError, OSError) as exc:
                attempt.update(stage="disk", error=str(exc), kind=type(exc).__name__)
            timings["disk_s"] = time.monotonic() - disk_started
        if self.holder.missing():
            self.holder.fail()
            tried = ", ".join(f"{a['source']}: {a.get('error')}" for a in attempts) or "no source given"
            raise WeightsUnavailable(f"weights {self.manifest.weights_id} incomplete ({tried})", attempts)
        timings["seconds"] = time.monotonic() - started
        if self.blocks is not None:
            source = max(by_source, key=lambda s: by_source[s]) if by_source else "none"
            return ReceiveResult(None, source, by_source, attempts, timings, None)
        packed = PackedWeights(self.manifest, self.holder.buffers)
        source = max(by_source, key=lambda s: by_source[s]) if by_source else "none"
        return ReceiveResult(packed, source, by_source, attempts, timings, self.server)

    def block_tensors(self) -> dict[str, torch.Tensor]:
        """After a partial receive: the named tensors of the received blocks (views, no copy)."""
        out: dict[str, torch.Tensor] = {}
        for index in self.blocks if self.blocks is not None else range(len(self.manifest.blocks)):
            out.update(block_views(self.holder.buffers[index], self.manifest.blocks[index]))
        return out

    def _missing_bytes(self) -> int:
        missing = 0
        for block, first in self.holder.missing():
            missing += self.manifest.blocks[block].nbytes - first * self.manifest.piece_bytes
        return missing

    def _pull(
        self,
        address: str,
        deadline: float,
        stall_timeout_s: float,
        connect_timeout_s: float,
        counter: _Progress,
        timings: dict[str, float],
        attempt: dict[str, Any],
    ) -> None:
        stage = "connect"
        group: PairGroup | None = None
        client: Any = None
        request_id = uuid.uuid4().hex
        connect_started = time.monotonic()
        attempt["bytes"] = 0

        def budget(limit: float) -> float:
            left = deadline - time.monotonic()
            if left <= 0:
                raise WeightsTimeout("overall deadline passed", stage=stage, source=address)
            return min(left, limit)

        try:
            host, port = _parse_address(address)
            client = TCPStore(host, port, None, False, timedelta(budget(connect_timeout_s)))
            requests = self.holder.missing()
            hello = {
                "id": request_id,
                "weights_id": self.manifest.weights_id,
                "piece_bytes": self.manifest.piece_bytes,
                "backend": self.backend,
                "backends": wire_backends(self.device),
                "requests": [list(r) for r in requests],
                "receiver": f"{socket.gethostname()}:{os.getpid()}",
            }
            client.queue_push(HELLO_QUEUE, json.dumps(hello))
            client.wait([_key(request_id, "accept")], timedelta(budget(connect_timeout_s)))
            accept = json.loads(client.get(_key(request_id, "accept")))
            if not accept.get("ok"):
                raise WeightsRefused(str(accept.get("error")), stage=stage, source=address)
            backend = accept.get("backend") or self.backend
            if backend not in wire_backends(self.device):
                raise WeightsRefused(f"source chose backend {backend!r}", stage=stage, source=address)
            # A GPU receiver pulling over Gloo (from a CPU host cache) lands each piece in a host
            # buffer, verifies it there, then copies it to its device buffer.
            staged = backend != self.backend
            attempt["backend"], attempt["staged"] = backend, staged
            group = pair_group_class(backend)(
                PrefixStore(_key(request_id, "pg/"), client),
                TARGET_RANK,
                device=torch.device("cpu") if staged else self.device,
                local_host=local_address_towards(host, port),
                timeout_s=budget(connect_timeout_s),
            )
            timings["connect_s"] += time.monotonic() - connect_started
            stage = "transfer"
            transfer_started = time.monotonic()
            order = [
                (block, piece)
                for block, first in requests
                for piece in range(first, self.holder.piece_count(block))
            ]
            # (handle, host staging buffer or None)
            window: collections.deque[tuple[Any, torch.Tensor | None]] = collections.deque()
            posted = 0

            def post() -> None:
                nonlocal posted
                block, piece = order[posted]
                start, stop = self.manifest.piece_range(block, piece)
                if staged:
                    landing = torch.empty(stop - start, dtype=torch.uint8)
                    window.append((group.irecv(landing), landing))
                else:
                    window.append((group.irecv(self.holder.buffers[block][start:stop]), None))
                posted += 1

            while posted < min(WINDOW, len(order)):
                post()
            for block, piece in order:
                handle, landing = window.popleft()
                group.wait(handle, budget(stall_timeout_s))
                if posted < len(order):
                    post()
                start, stop = self.manifest.piece_range(block, piece)
                if self.ingress is not None:
                    self.ingress.take(stop - start)
                data = self.holder.buffers[block][start:stop] if landing is None else landing
                if checksum(data) != self.manifest.blocks[block].pieces[piece]:
                    stage = "verify"
                    raise WeightsChecksumMismatch(
                        f"piece {piece} of block {self.manifest.blocks[block].name!r} fails its checksum",
                        stage=stage,
                        source=address,
                    )
                if landing is not None:
                    self.holder.buffers[block][start:stop].copy_(landing)
                self.holder.mark(block, piece)
                attempt["bytes"] += stop - start
                counter.add(stop - start)
            timings["transfer_s"] += time.monotonic() - transfer_started
            stage = "done"
            client.set(_key(request_id, "done"), json.dumps({"ok": True}))
        except Exception as exc:
            if client is not None:
                with contextlib.suppress(Exception):
                    client.set(_key(request_id, "done"), json.dumps({"ok": False, "stage": stage}))
            raise _classify(exc, stage, address) from exc
        finally:
            if group is not None:
                group.abort()

    def _read_disk(self, path: str | os.PathLike[str], counter: _Progress) -> int:
        """Read the missing blocks from the safetensors file; verified pieces already held stay."""
        delivered = 0
        for block, first in self.holder.missing():
            entry = self.manifest.blocks[block]
            # Staged, not read in place: a downstream link may be sending this block's verified
            # pieces right now, and load_blocks rewrites the whole buffer before verifying it.
            staging = torch.empty(entry.nbytes, dtype=torch.uint8)
            load_blocks(path, self.manifest, [block], {block: staging})
            for piece in range(first, len(entry.pieces)):
                start, stop = self.manifest.piece_range(block, piece)
                self.holder.buffers[block][start:stop].copy_(staging[start:stop])
                self.holder.mark(block, piece)
                delivered += stop - start
                counter.add(stop - start)
        return delivered


class _Progress:
    def __init__(self, done: int, total: int, callback: ProgressFn | None) -> None:
        self.done, self.total, self.callback = done, total, callback

    def add(self, nbytes: int) -> None:
        self.done += nbytes
        if self.callback is not None:
            self.callback(self.done, self.total)


def chain_sources(chain: Sequence[str], position: int) -> list[str]:
    """Sources for the receiver at ``position`` (1-based) of ``chain = [source, T1, T2, …]``.

    Its upstream first, then every holder further up to the chain's source: when a forwarding
    receiver dies, its downstream pulls from the one before it (which keeps serving).
    """
    if not 1 <= position < len(chain):
        raise ValueError(f"position must be in 1..{len(chain) - 1}, got {position}")
    return [chain[index] for index in range(position - 1, -1, -1)]


def weights_receive(
    manifest: WeightsManifest,
    *,
    sources: Sequence[str] = (),
    disk_path: str | os.PathLike[str] | None = None,
    device: torch.device | str = "cpu",
    host: str = "127.0.0.1",
    port: int = 0,
    link_mbps: float | None = None,
    serve: bool = False,
    timeout_s: float = 600.0,
    stall_timeout_s: float = DEFAULT_STALL_TIMEOUT_S,
    connect_timeout_s: float = DEFAULT_CONNECT_TIMEOUT_S,
    progress: ProgressFn | None = None,
) -> ReceiveResult:
    """One-call receive. With ``serve=True`` the receiver's server stays up in ``result.server``
    (the caller closes it); a chain needs ``WeightsReceiver`` so the address is known beforehand."""
    receiver = WeightsReceiver(
        manifest,
        device=device,
        host=host,
        port=port,
        link_mbps=link_mbps,
        serve=serve,
        stall_timeout_s=stall_timeout_s,
    )
    try:
        result = receiver.receive(
            sources,
            disk_path=disk_path,
            timeout_s=timeout_s,
            stall_timeout_s=stall_timeout_s,
            connect_timeout_s=connect_timeout_s,
            progress=progress,
        )
    except BaseException:
        receiver.close()
        raise
    return result
