"""Session-state migration between two worker processes (TurboServe §6.1, three-step protocol).

Pairing. Every worker runs one ``MigrationListener``: a ``TCPStore`` server on an ephemeral port whose
``host:port`` the worker advertises (the control plane carries it in the migrate command). A source
connects to that store as a client, pushes a *hello* onto the listener's queue and, once accepted,
both sides build a dedicated two-rank backend group (``ProcessGroupGloo`` / ``ProcessGroupNCCL``)
directly on a ``PrefixStore`` unique to this pair link. There is no global world: workers joining or
leaving the pool never touch anyone else's communicators, and concurrent migrations to the same
target use disjoint prefixes. After a success both sides keep the group for the pair's next
migration (``MigrationSender`` / listener link cache, idle timeout, discarded on any failure).
The rendezvous is keyed by (session, epoch): the listener files every queued hello and each
``receive`` claims only its own, so any number of migrations into one worker run at once.

Protocol (the store carries only small control records; every state byte goes over the pair group):
  source                                   target (``receive``)
  hello  ── store queue ──────────────▶   claim own hello, accept/refuse ──▶ store ``accept``
  build pair group (rank 0)                build pair group (rank 1)
  header, manifest, segments, trailer ───▶ allocate, receive, checksum, compare      (§6.1 step ii)
                                           install(manifest, tensors)
  wait ``result``  ◀── store ──────────── ``result`` = ok | error(stage)
  return SendReport → caller flips ownership with the epoch in the manifest          (§6.1 step iii)
The source never frees or modifies its tensors; on any error before ``result`` = ok it raises and the
caller keeps the session where it was.
"""

from __future__ import annotations

import contextlib
import copy
import json
import os
import socket
import threading
import time
import uuid
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

import torch
from torch._C._distributed_c10d import PrefixStore, TCPStore

from . import wire
from .errors import (
    ChecksumMismatch,
    ManifestError,
    MigrationError,
    MigrationRejected,
    MigrationTimeout,
    PeerLost,
)
from .pair import (
    SOURCE_RANK,
    TARGET_RANK,
    PairGroup,
    backend_for_device,
    local_address_towards,
    pair_group_class,
    store_server,
    timedelta,
)

StateTensors = dict[str, torch.Tensor]
InstallFn = Callable[[dict[str, Any], StateTensors], Any]
AllocateFn = Callable[[dict[str, Any]], StateTensors]
ProgressFn = Callable[[int, int], Any]

HELLO_QUEUE = "mig/hello"
# Longest wait for any single message once the transfer has started. It bounds how long a side waits
# when its peer died without Gloo noticing the closed connection (it does not always, see
# docs/migration.md); a 16 MiB segment needs well under a second even on a loaded CPU box.
DEFAULT_STALL_TIMEOUT_S = 10.0
_POLL_MIN_S = 0.0002
_POLL_MAX_S = 0.005
_HEADER_LEN = 4  # int64: wire version, manifest bytes, pack_below, segment_bytes
# How long a hello that does not say how long its source waits stays claimable.
_UNANNOUNCED_ACCEPT_S = 60.0


@dataclass(frozen=True)
class SendReport:
    """``connect_s``: store connection, hello/accept and pair-group setup; ``transfer_s``: header,
    manifest, payload and trailer on the wire; ``ack_s``: waiting for the target's verify + install;
    ``seconds``: the whole call. ``nbytes`` counts state bytes only (not the manifest)."""

    session_id: str
    epoch: int
    backend: str
    peer: str
    nbytes: int
    n_tensors: int
    connect_s: float
    transfer_s: float
    ack_s: float
    seconds: float
    reused_link: bool = False

    @property
    def gbps(self) -> float:
        """State bytes over the whole call (rendezvous to ack), in GB/s."""
        return self.nbytes / self.seconds / 1e9 if self.seconds > 0 else 0.0

    @property
    def transfer_gbps(self) -> float:
        return self.nbytes / self.transfer_s / 1e9 if self.transfer_s > 0 else 0.0


@dataclass(frozen=True)
class ReceiveReport:
    """``connect_s``: from popping the source's hello to a ready pair group; ``transfer_s``: header
    to trailer (allocation and checksums included); ``install_s``: the caller's ``install``;
    ``seconds``: the whole call, including waiting for a source to show up."""

    session_id: str
    epoch: int
    backend: str
    source: str
    nbytes: int
    n_tensors: int
    connect_s: float
    transfer_s: float
    install_s: float
    seconds: float
    manifest: dict[str, Any] = field(repr=False)

    @property
    def gbps(self) -> float:
        return self.nbytes / self.seconds / 1e9 if self.seconds > 0 else 0.0

    @property
    def transfer_gbps(self) -> float:
        return self.nbytes / self.transfer_s / 1e9 if self.transfer_s > 0 else 0.0


class _Deadline:
    def __init__(self, timeout_s: float, stall_s: float = float("inf")) -> None:
        if not timeout_s > 0 or not stall_s > 0:
            raise ValueError(f"timeouts must be positive, got {timeout_s!r} / {stall_s!r}")
        self.timeout_s = timeout_s
        self.stall_s = stall_s
        self.started = time.monotonic()
        self.at = self.started + timeout_s

    def step(self, stage: str) -> float:
        """Budget for one message: the time left, but no more than the stall timeout."""
        return min(self.left(stage), self.stall_s)

    def left(self, stage: str) -> float:
        left = self.at - time.monotonic()
        if left <= 0:
            raise MigrationTimeout(f"deadline of {self.timeout_s:.1f}s exceeded", stage=stage)
        return left

    def elapsed(self) -> float:
        return time.monotonic() - self.started


def _wait(group: PairGroup, handle: Any, deadline: _Deadline, stage: str, what: str) -> None:
    budget = deadline.step(stage)
    try:
        group.wait(handle, budget)
    except Exception as exc:
        error = _classify(exc, stage)
        if isinstance(error, MigrationTimeout):
            limit = "stall timeout" if budget >= deadline.stall_s else "deadline"
            raise MigrationTimeout(
                f"{what} did not complete within {budget:.1f}s ({limit})", stage=stage
            ) from exc
        raise error from exc


def _classify(exc: BaseException, stage: str) -> MigrationError:
    """Map torch.distributed / socket errors onto the transport's error types."""
    if isinstance(exc, MigrationError):
        return exc
    text = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
    lowered = text.lower()
    if isinstance(exc, TimeoutError) or "timed out" in lowered or "timeout" in lowered:
        return MigrationTimeout(text, stage=stage)
    network = isinstance(exc, ConnectionError | OSError) or type(exc).__name__ == "DistNetworkError"
    if network or any(
        word in lowered for word in ("connection", "closed", "reset", "broken pipe", "refused", "peer")
    ):
        return PeerLost(text, stage=stage)
    return MigrationError(f"{type(exc).__name__}: {text}", stage=stage)


def _key(migration_id: str, name: str) -> str:
    return f"mig/{migration_id}/{name}"


def _link_prefix(link_id: str) -> str:
    return f"link/{link_id}/pg/"


def _parse_address(address: str) -> tuple[str, int]:
    host, sep, port = address.rpartition(":")
    if not sep or not port.isdigit():
        raise ValueError(f"migration address must be host:port, got {address!r}")
    return host.strip("[]"), int(port)


def _header(manifest_len: int, pack_below: int, segment_bytes: int, device: torch.device) -> torch.Tensor:
    values = [wire.WIRE_VERSION, manifest_len, pack_below, segment_bytes]
    return torch.tensor(values, dtype=torch.int64, device=device)


def _stage_packed(segment: wire.Segment, views: list[torch.Tensor], device: torch.device) -> torch.Tensor:
    staging = torch.empty(segment.nbytes, dtype=torch.uint8, device=device)
    for piece in segment.pieces:
        staging[piece.offset : piece.offset + piece.stop - piece.start].copy_(
            views[piece.index][piece.start : piece.stop]
        )
    return staging


@dataclass
class _Link:
    """A connected pair group kept between migrations of one source→target pair."""

    link_id: str
    client: Any
    group: PairGroup
    last_used: float

    def discard(self) -> None:
        self.group.abort()


@dataclass(frozen=True)
class _HelloKey:
    """What a hello offers, and what a receive waits for (``epoch=None``: any epoch)."""

    session_id: str
    epoch: int | None

    @classmethod
    def of(cls, hello: dict[str, Any]) -> _HelloKey:
        return cls(str(hello.get("session_id")), int(hello.get("epoch", -1)))

    def matches(self, offered: _HelloKey) -> bool:
        return self.session_id == offered.session_id and self.epoch in (None, offered.epoch)


@dataclass
class _PendingHello:
    hello: dict[str, Any]
    key: _HelloKey
    expires: float  # monotonic time after which its source no longer waits for an accept


class _StaleLink(Exception):
    """The target no longer knows a cached link (it expired there, or the target restarted)."""


class MigrationSender:
    """Source side with a per-target cache of pair groups (idle ones are closed after ``idle_timeout_s``).

    Building a group costs a few ms with Gloo and typically hundreds of ms with NCCL (communicator
    creation), so consecutive migrations to the same target reuse one. A link is used by one
    migration at a time (concurrent sends to one target open more links) and is discarded on any
    failure, so a broken or half-drained group is never reused. ``idle_timeout_s=0`` disables reuse.
    """

    def __init__(self, device: torch.device | str = "cpu", *, idle_timeout_s: float = 60.0) -> None:
        self.device = torch.device(device)
        self.backend = backend_for_device(self.device)
        self.idle_timeout_s = idle_timeout_s
        self._idle: dict[str, list[_Link]] = {}
        self._lock = threading.Lock()

    def close(self) -> None:
        with self._lock:
            links = [link for idle in self._idle.values() for link in idle]
            self._idle.clear()
        for link in links:
            link.discard()

    def __enter__(self) -> MigrationSender:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def _take(self, address: str) -> _Link | None:
        now = time.monotonic()
        expired: list[_Link] = []
        taken = None
        with self._lock:
            idle = self._idle.get(address, [])
            while idle:
                link = idle.pop()
                if now - link.last_used <= self.idle_timeout_s:
                    taken = link
                    break
                expired.append(link)
        for link in expired:
            link.discard()
        return taken

    def _give_back(self, address: str, link: _Link) -> None:
        if self.idle_timeout_s <= 0:
            link.discard()
            return
        link.last_used = time.monotonic()
        with self._lock:
            self._idle.setdefault(address, []).append(link)

    def send(
        self,
        address: str,
        manifest: dict[str, Any],
        tensors: StateTensors,
        *,
        timeout_s: float,
        session_id: str,
        epoch: int,
        pack_below: int = wire.DEFAULT_PACK_BELOW,
        segment_bytes: int = wire.DEFAULT_SEGMENT_BYTES,
        progress: ProgressFn | None = None,
        stall_timeout_s: float = DEFAULT_STALL_TIMEOUT_S,
    ) -> SendReport:
        """Push a frozen state region to the listener at ``address`` and wait for its ack.

        Returns only after the target verified the bytes and installed them (§6.1 step ii); the caller
        then flips ownership to ``epoch``. Raises a ``MigrationError`` otherwise; ``tensors`` are never
        modified or freed here, so the session continues on the source.
        """
        deadline = _Deadline(timeout_s, stall_timeout_s)
        specs = wire.check_region(manifest, tensors, self.device)
        if segment_bytes <= 0 or pack_below < 0:
            raise ValueError("segment_bytes must be positive and pack_below non-negative")
        outgoing = copy.deepcopy(manifest)
        outgoing.setdefault("meta", {})
        outgoing["meta"].update(session_id=session_id, epoch=int(epoch))
        job = _Outgoing(
            address=address,
            specs=specs,
            tensors=tensors,
            manifest_bytes=wire.encode_manifest(outgoing),
            session_id=session_id,
            epoch=int(epoch),
            pack_below=pack_below,
            segment_bytes=segment_bytes,
            progress=progress,
        )
        link = self._take(address)
        if link is not None:
            try:
                return self._send_on(job, link, deadline)
            except _StaleLink:
                pass  # the target dropped it: fall through to a fresh link within the same deadline
        return self._send_on(job, None, deadline)

    def _send_on(self, job: _Outgoing, link: _Link | None, deadline: _Deadline) -> SendReport:
        host, port = _parse_address(job.address)
        reused = link is not None
        stage = "connect"
        migration_id = uuid.uuid4().hex
        client: Any = link.client if link is not None else None
        group: PairGroup | None = link.group if link is not None else None
        try:
            if client is None:
                client = TCPStore(host, port, None, False, timedelta(deadline.left(stage)))
            else:
                client.set_timeout(timedelta(deadline.left(stage)))  # this call's deadline, not the first's
            link_id = link.link_id if link is not None else uuid.uuid4().hex
            hello = {
                "id": migration_id,
                "link": link_id,
                "new_link": not reused,
                "keep_link": self.idle_timeout_s > 0,
                "session_id": job.session_id,
                "epoch": job.epoch,
                "backend": self.backend,
                "wire_version": wire.WIRE_VERSION,
                "manifest_bytes": job.manifest_bytes.numel(),
                "source": f"{socket.gethostname()}:{os.getpid()}",
                # After this the source no longer waits for an accept: the target forgets the hello.
                "accept_within_s": deadline.left(stage),
            }
            try:
                client.queue_push(HELLO_QUEUE, json.dumps(hello))
            except Exception as exc:
                if reused:  # the cached store connection died with the old target process
                    raise _StaleLink() from exc
                raise
            stage = "rendezvous"
            try:
                client.wait([_key(migration_id, "accept")], timedelta(deadline.left(stage)))
            except Exception as exc:
                # Leave a tombstone so a listener that pops this hello later skips it instead of waiting.
                _best_effort(lambda: client.set(_key(migration_id, "cancelled"), "1"))
                error = _classify(exc, stage)
                if isinstance(error, MigrationTimeout):
                    error = MigrationTimeout(
                        f"target at {job.address} did not accept within {deadline.timeout_s:.1f}s",
                        stage=stage,
                    )
                raise error from exc
            accept = json.loads(client.get(_key(migration_id, "accept")))
            if accept.get("stale_link") and reused:
                raise _StaleLink()
            if not accept.get("ok"):
                raise MigrationRejected(f"target refused: {accept.get('error')}", stage=stage)
            if group is None:
                group = pair_group_class(self.backend)(
                    PrefixStore(_link_prefix(link_id), client),
                    SOURCE_RANK,
                    device=self.device,
                    local_host=local_address_towards(host, port),
                    timeout_s=deadline.left(stage),
                )
            connect_s = deadline.elapsed()

            stage = "transfer"
            transfer_started = time.monotonic()
            nbytes = _send_region(group, job, deadline)
            transfer_s = time.monotonic() - transfer_started

            stage = "ack"
            ack_started = time.monotonic()
            client.wait([_key(migration_id, "result")], timedelta(deadline.left(stage)))
            result = json.loads(client.get(_key(migration_id, "result")))
            ack_s = time.monotonic() - ack_started
            if not result.get("ok"):
                remote_stage = result.get("stage", "ack")
                error_type = {"verify": ChecksumMismatch, "install": MigrationRejected}.get(
                    remote_stage, MigrationError
                )
                raise error_type(f"target reported: {result.get('error')}", stage=remote_stage)
            seconds = deadline.elapsed()
            _best_effort(lambda: client.delete_key(_key(migration_id, "result")))
            self._give_back(job.address, _Link(link_id, client, group, time.monotonic()))
            group = None
            return SendReport(
                session_id=job.session_id,
                epoch=job.epoch,
                backend=self.backend,
                peer=job.address,
                nbytes=nbytes,
                n_tensors=len(job.specs),
                connect_s=connect_s,
                transfer_s=transfer_s,
                ack_s=ack_s,
                seconds=seconds,
                reused_link=reused,
            )
        except _StaleLink:
            raise
        except Exception as exc:
            raise _classify(exc, stage) from exc
        finally:
            if group is not None:
                # Breaking the connection makes a target blocked in recv fail now, not at its timeout;
                # a failed link is never reused.
                group.abort()


@dataclass
class _Outgoing:
    address: str
    specs: list[wire.TensorSpec]
    tensors: StateTensors
    manifest_bytes: torch.Tensor
    session_id: str
    epoch: int
    pack_below: int
    segment_bytes: int
    progress: ProgressFn | None


def _send_region(group: PairGroup, job: _Outgoing, deadline: _Deadline) -> int:
    """Header, manifest, segments, trailer; returns the state bytes sent."""
    device = group.device
    views = [wire.byte_view(job.tensors[spec.name]) for spec in job.specs]
    segments = wire.plan_segments(job.specs, pack_below=job.pack_below, segment_bytes=job.segment_bytes)
    nbytes = sum(spec.nbytes for spec in job.specs)
    header = _header(job.manifest_bytes.numel(), job.pack_below, job.segment_bytes, device)
    # Everything is posted at once: the backend streams it in order while this thread computes the
    # checksums of the same (read-only) bytes.
    handles = [group.isend(header), group.isend(job.manifest_bytes.to(device))]
    buffers = []
    for segment in segments:
        if segment.packed:
            buffer = _stage_packed(segment, views, device)
        else:
            piece = segment.pieces[0]
            buffer = views[piece.index][piece.start : piece.stop]
        buffers.append(buffer)
        handles.append(group.isend(buffer))
    checksum = wire.RunningChecksum(len(job.specs), device)
    for index, view in enumerate(views):
        checksum.update(index, view, 0)
    trailer = checksum.result()
    sent = 0
    for position, handle in enumerate(handles):
        _wait(group, handle, deadline, "transfer", f"send of message {position}")
        if position >= 2:
            sent += segments[position - 2].nbytes
            if job.progress is not None:
                job.progress(sent, nbytes)
    _wait(group, group.isend(trailer), deadline, "transfer", "send of the checksum trailer")
    return nbytes


def send_state(
    address: str,
    manifest: dict[str, Any],
    tensors: StateTensors,
    *,
    device: torch.device | str,
    timeout_s: float,
    session_id: str,
    epoch: int,
    pack_below: int = wire.DEFAULT_PACK_BELOW,
    segment_bytes: int = wire.DEFAULT_SEGMENT_BYTES,
    progress: ProgressFn | None = None,
    stall_timeout_s: float = DEFAULT_STALL_TIMEOUT_S,
) -> SendReport:
    """One-shot ``MigrationSender.send`` on a fresh pair group that is closed afterwards."""
    with MigrationSender(device, idle_timeout_s=0) as sender:
        return sender.send(
            address,
            manifest,
            tensors,
            timeout_s=timeout_s,
            session_id=session_id,
            epoch=epoch,
            pack_below=pack_below,
            segment_bytes=segment_bytes,
            progress=progress,
            stall_timeout_s=stall_timeout_s,
        )


def _best_effort(action: Callable[[], Any]) -> None:
    with contextlib.suppress(Exception):
        action()


class MigrationListener:
    """Target side: one per worker, advertised as ``address``; ``receive`` handles one migration.

    ``receive`` may run in a background thread (see ``receive_in_background``) while the engine keeps
    stepping other sessions; several receives may run at once, each on its own connection.
    """

    def __init__(
        self,
        device: torch.device | str = "cpu",
        host: str = "127.0.0.1",
        port: int = 0,
        *,
        link_idle_timeout_s: float = 120.0,
    ) -> None:
        self.device = torch.device(device)
        self.backend = backend_for_device(self.device)
        self.host = host
        # Longer than a sender's default idle timeout, so a source normally forgets a link first;
        # when it does not, the source is told the link is stale and opens a new one.
        self.link_idle_timeout_s = link_idle_timeout_s
        # The server side of the rendezvous store lives in this process for the listener's lifetime.
        self._server: Any = store_server(host, port, timeout=timedelta(60))
        self.port = int(self._server.port)
        self._closed = False
        self._links: dict[str, _Link] = {}
        self._clients: list[Any] = []
        self._lock = threading.Lock()
        # Hellos popped off the store's queue but not yet claimed, in arrival order, and the keys
        # (session, epoch) that receives are waiting for; both guarded by ``_hello_lock``.
        self._hello_lock = threading.Lock()
        self._pending: list[_PendingHello] = []
        self._awaited: list[_HelloKey] = []

    def _take_client(self, deadline: _Deadline) -> Any:
        # Each receive needs its own connection (queue_pop blocks it), but not a new one each time.
        with self._lock:
            client = self._clients.pop() if self._clients else None
        if client is None:
            return TCPStore(self.host, self.port, None, False, timedelta(deadline.left("rendezvous")))
        client.set_timeout(timedelta(deadline.left("rendezvous")))
        return client

    def _give_client(self, client: Any) -> None:
        with self._lock:
            self._clients.append(client)

    def _take_link(self, link_id: str) -> _Link | None:
        with self._lock:
            return self._links.pop(link_id, None)

    def _keep_link(self, link: _Link) -> None:
        link.last_used = time.monotonic()
        with self._lock:
            self._links[link.link_id] = link

    def _expire_links(self) -> None:
        now = time.monotonic()
        with self._lock:
            expired = [k for k in self._links.values() if now - k.last_used > self.link_idle_timeout_s]
            for link in expired:
                del self._links[link.link_id]
        for link in expired:
            link.discard()

    @property
    def address(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{host}:{self.port}"

    def close(self) -> None:
        self._closed = True
        with self._lock:
            links = list(self._links.values())
            self._links.clear()
            self._clients.clear()
        for link in links:
            link.discard()
        self._server = None

    def __enter__(self) -> MigrationListener:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def receive_in_background(
        self, timeout_s: float, install: InstallFn, **kwargs: Any
    ) -> Future[ReceiveReport]:
        future: Future[ReceiveReport] = Future()

        def run() -> None:
            if not future.set_running_or_notify_cancel():
                return
            try:
                future.set_result(self.receive(timeout_s, install, **kwargs))
            except BaseException as exc:
                future.set_exception(exc)

        threading.Thread(target=run, name="migration-receive", daemon=True).start()
        return future

    def receive(
        self,
        timeout_s: float,
        install: InstallFn,
        *,
        session_id: str | None = None,
        epoch: int | None = None,
        allocate: AllocateFn | None = None,
        progress: ProgressFn | None = None,
        stall_timeout_s: float = DEFAULT_STALL_TIMEOUT_S,
    ) -> ReceiveReport:
        """Wait for one source, receive its state region, verify it, ``install`` it, then ack.

        ``install(manifest, tensors)`` is the engine's import; raising there rejects the migration
        (both sides raise ``MigrationRejected``). ``allocate(manifest)`` may hand back preallocated
        tensors to receive into (default: fresh ``torch.empty`` on this listener's device). With
        ``session_id`` (and ``epoch``) set, this receive takes only the hello of that session (at
        that epoch), whenever it arrives: any number of receives, each for its own migration, can
        wait at once. Without them it takes the oldest hello no keyed receive is waiting for.
        """
        if self._closed:
            raise RuntimeError("listener is closed")
        if epoch is not None and session_id is None:
            raise ValueError("a receive keyed by epoch must name the session too")
        deadline = _Deadline(timeout_s, stall_timeout_s)
        wanted = None if session_id is None else _HelloKey(session_id, None if epoch is None else int(epoch))
        stage = "rendezvous"
        client: Any = None
        group: PairGroup | None = None
        migration_id = ""
        if wanted is not None:
            with self._hello_lock:
                self._awaited.append(wanted)
        try:
            self._expire_links()
            client = self._take_client(deadline)
            while True:
                hello = self._next_hello(client, deadline, timeout_s, wanted)
                migration_id = hello["id"]
                connect_started = time.monotonic()
                link_id = hello.get("link", migration_id)
                link = None if hello.get("new_link", True) else self._take_link(link_id)
                if hello.get("new_link", True) or link is not None:
                    break
                # A link this listener no longer has: the source retries on a new one, so wait for it.
                stale = {"ok": False, "stale_link": True, "error": f"unknown link {link_id}"}
                client.set(_key(migration_id, "accept"), json.dumps(stale))
                migration_id = ""
            refusal = self._refusal(hello)
            if link is not None:
                group, link_store = link.group, link.client
            client.set(_key(migration_id, "accept"), json.dumps({"ok": refusal is None, "error": refusal}))
            if refusal is not None:
                raise MigrationRejected(refusal, stage=stage)
            if link is None:
                link_store = client
                group = pair_group_class(self.backend)(
                    PrefixStore(_link_prefix(link_id), client),
                    TARGET_RANK,
                    device=self.device,
                    local_host=self.host,
                    timeout_s=deadline.left(stage),
                )

            stage = "manifest"
            transfer_started = time.monotonic()
            # The hello announced the manifest's length, so header and manifest are received in one
            # round trip; the header on the wire still has to agree with it.
            announced = int(hello["manifest_bytes"])
            header = torch.empty(_HEADER_LEN, dtype=torch.int64, device=self.device)
            manifest_buffer = torch.empty(announced, dtype=torch.uint8, device=self.device)
            header_handle, manifest_handle = group.irecv(header), group.irecv(manifest_buffer)
            _wait(group, header_handle, deadline, stage, "receive of the header")
            version, manifest_len, pack_below, segment_bytes = (int(v) for v in header.tolist())
            if version != wire.WIRE_VERSION or manifest_len != announced:
                raise ManifestError(
                    f"header says wire version {version} and {manifest_len} manifest bytes, expected "
                    f"{wire.WIRE_VERSION} and {announced}",
                    stage=stage,
                )
            _wait(group, manifest_handle, deadline, stage, "receive of the manifest")
            manifest = wire.decode_manifest(manifest_buffer)
            specs = wire.tensor_specs(manifest)
            meta = manifest.get("meta", {})
            if meta.get("session_id") != hello["session_id"] or meta.get("epoch") != hello["epoch"]:
                raise ManifestError("manifest meta does not match the hello (session_id/epoch)", stage=stage)
            tensors = self._allocate(manifest, specs, allocate)

            stage = "transfer"
            views = [wire.byte_view(tensors[spec.name]) for spec in specs]
            segments = wire.plan_segments(specs, pack_below=pack_below, segment_bytes=segment_bytes)
            nbytes = sum(spec.nbytes for spec in specs)
            buffers: list[torch.Tensor] = []
            handles = []
            for segment in segments:
                if segment.packed:
                    buffer = torch.empty(segment.nbytes, dtype=torch.uint8, device=self.device)
                else:
                    piece = segment.pieces[0]
                    buffer = views[piece.index][piece.start : piece.stop]
                buffers.append(buffer)
                handles.append(group.irecv(buffer))
            expected = torch.empty((len(specs), 2), dtype=torch.int64, device=self.device)
            trailer_handle = group.irecv(expected)
            checksum = wire.RunningChecksum(len(specs), self.device)
            received = 0
            for index, (segment, buffer, handle) in enumerate(zip(segments, buffers, handles, strict=True)):
                _wait(group, handle, deadline, stage, f"receive of segment {index}")
                for piece in segment.pieces:
                    if segment.packed:
                        chunk = buffer[piece.offset : piece.offset + piece.stop - piece.start]
                        views[piece.index][piece.start : piece.stop].copy_(chunk)
                    else:
                        chunk = buffer
                    checksum.update(piece.index, chunk, piece.start)
                received += segment.nbytes
                if progress is not None:
                    progress(received, nbytes)
            _wait(group, trailer_handle, deadline, stage, "receive of the checksum trailer")
            transfer_s = time.monotonic() - transfer_started

            stage = "verify"
            actual = checksum.result()
            if not torch.equal(actual, expected):
                bad = [specs[i].name for i in range(len(specs)) if not torch.equal(actual[i], expected[i])]
                raise ChecksumMismatch(f"received bytes differ from the source's for {bad}", stage=stage)

            stage = "install"
            install_started = time.monotonic()
            try:
                install(manifest, tensors)
            except Exception as exc:
                raise MigrationRejected(
                    f"install refused the state: {type(exc).__name__}: {exc}", stage=stage
                ) from exc
            install_s = time.monotonic() - install_started

            stage = "ack"
            # Cache the link before the source can see the ack: its next hello on this link must find it.
            if hello.get("keep_link", True):
                self._keep_link(_Link(link_id, link_store, group, time.monotonic()))
                group = None
            else:
                group.close()
                group = None
            client.set(_key(migration_id, "result"), json.dumps({"ok": True}))
            seconds = deadline.elapsed()
            # Housekeeping off the source's critical path (it is already reading the result).
            _best_effort(lambda: client.delete_key(_key(migration_id, "accept")))
            if link_store is not client or not hello.get("keep_link", True):
                self._give_client(client)  # a kept new link keeps its client as the group's store
            return ReceiveReport(
                session_id=hello["session_id"],
                epoch=hello["epoch"],
                backend=self.backend,
                source=hello["source"],
                nbytes=nbytes,
                n_tensors=len(specs),
                connect_s=transfer_started - connect_started,
                transfer_s=transfer_s,
                install_s=install_s,
                seconds=seconds,
                manifest=manifest,
            )
        except Exception as exc:
            error = _classify(exc, stage)
            if client is not None and migration_id:
                # Tell the source why, so both sides raise the same story (best effort: it may be gone).
                record = {"ok": False, "stage": error.stage, "error": str(error)}
                _best_effort(lambda: client.set(_key(migration_id, "result"), json.dumps(record)))
            raise error from exc
        finally:
            if wanted is not None:
                with self._hello_lock:
                    self._awaited.remove(wanted)
            if group is not None:
                group.abort()

    def _next_hello(
        self, client: Any, deadline: _Deadline, timeout_s: float, wanted: _HelloKey | None
    ) -> dict[str, Any]:
        what = "a state region" if wanted is None else f"session {wanted.session_id!r}"
        if wanted is not None and wanted.epoch is not None:
            what += f" at epoch {wanted.epoch}"
        no_source = f"no source offered {what} within {timeout_s:.1f}s"
        pause = _POLL_MIN_S
        while True:
            # TCPStore's blocking queue_pop loses wakeups (torch 2.13: a hello pushed while a pop is
            # blocking stays queued until the pop times out), so the hello queue is polled without
            # blocking, backing off to a few ms. Whoever polls moves every queued hello into
            # ``_pending``; each receive then claims only its own (rendezvous keyed by session and
            # epoch), so concurrent migrations into this worker never take each other's hellos.
            with self._hello_lock:
                self._drain_hellos(client)
                hello = self._claim_hello(wanted)
            if hello is None:
                if deadline.at - time.monotonic() <= 0:
                    raise MigrationTimeout(no_source, stage="rendezvous")
                time.sleep(min(pause, max(deadline.at - time.monotonic(), 0.0)))
                pause = min(pause * 2, _POLL_MAX_S)
                continue
            if not client.check([_key(hello["id"], "cancelled")]):
                return hello

    def _drain_hellos(self, client: Any) -> None:
        """Move every hello queued on the store into ``_pending`` (caller holds ``_hello_lock``)."""
        while True:
            try:
                raw = client.queue_pop(HELLO_QUEUE, False)
            except Exception as exc:
                if type(exc).__name__ != "QueueEmptyError":
                    raise
                return
            hello = json.loads(raw)
            expires = time.monotonic() + float(hello.get("accept_within_s", _UNANNOUNCED_ACCEPT_S))
            self._pending.append(_PendingHello(hello, _HelloKey.of(hello), expires))

    def _claim_hello(self, wanted: _HelloKey | None) -> dict[str, Any] | None:
        """The oldest pending hello for ``wanted``; with no key, the oldest no keyed receive awaits.
        Hellos whose source stopped waiting for an accept are dropped (caller holds the lock)."""
        now = time.monotonic()
        self._pending = [p for p in self._pending if p.expires > now]
        for index, pending in enumerate(self._pending):
            if wanted is not None:
                taken = wanted.matches(pending.key)
            else:
                taken = not any(awaited.matches(pending.key) for awaited in self._awaited)
            if taken:
                del self._pending[index]
                return pending.hello
        return None

    def _refusal(self, hello: dict[str, Any]) -> str | None:
        if hello.get("backend") != self.backend:
            return f"source uses {hello.get('backend')}, this worker ({self.device}) uses {self.backend}"
        if hello.get("wire_version") != wire.WIRE_VERSION:
            return f"wire version {hello.get('wire_version')}, expected {wire.WIRE_VERSION}"
        return None

    def _allocate(
        self, manifest: dict[str, Any], specs: list[wire.TensorSpec], allocate: AllocateFn | None
    ) -> StateTensors:
        if allocate is None:
            return {
                spec.name: torch.empty(spec.shape, dtype=spec.dtype, device=self.device) for spec in specs
            }
        tensors = allocate(manifest)
        wire.check_region(manifest, tensors, self.device)
        if not all(t.is_contiguous() for t in tensors.values()):
            raise ManifestError("allocate() must return contiguous tensors", stage="manifest")
        return tensors
