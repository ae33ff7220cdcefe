"""Request/response stage services, the client side (issue 15): a worker's connections to the
encoder workers (``E``) that answer its prompts' embeddings and to the decoder workers (``C``) that
decode its finished one-shot jobs (the service side: ``stages.service``).

Encoder protocol (per client, over the E worker's store): the client pushes a hello ``{"link": L}``
on ``ENCODER_HELLO_QUEUE``; both sides then open link ``L/req`` (client → encoder) and ``L/resp``
(encoder → client) in that order. A request is a ``prompt`` `StageMessage` with ``meta`` ``request``
(a per-client counter) and ``prompt``; the answer is the same message with the embeddings as its
tensor (the encoder's `StageRunner`, so its LRU cache of encodings serves every client), or an
``error`` message naming the request. Encodings are a function of the prompt and the weights only
(one prompt, alone), so every encoder replica of a preset answers the same bytes. A decoder worker
speaks the same protocol on ``DECODER_HELLO_QUEUE``: ``job_latents`` in, ``job_frames`` back.
"""

from __future__ import annotations

import itertools
import json
import threading
import time
import uuid
from collections import OrderedDict, deque
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Any

import torch

from workers.runtime.stages.link import (
    DEFAULT_TIMEOUT_S,
    LinkError,
    LinkReceiver,
    LinkSender,
    connect_store,
    open_pair,
)
from workers.runtime.stages.pipeline import StageMessage
from workers.runtime.transport.pair import SOURCE_RANK, TARGET_RANK

ENCODER_HELLO_QUEUE = "enc/hello"
DECODER_HELLO_QUEUE = "dec/hello"


class StageUnavailable(RuntimeError):
    """No stage service (encoder or decoder worker) answered a request (none known, link lost,
    timeout)."""


class EncoderUnavailable(StageUnavailable):
    """No encoder worker answered with the embeddings of a prompt (none known, link lost, timeout)."""


class DecoderUnavailable(StageUnavailable):
    """No decoder worker answered with a finished job's frames (none known, link lost, timeout)."""


class StageClient:
    """One worker's connection to one request/response stage service (`StageService`; module
    docstring: protocol) — an encoder (`EncoderClient`) or a decoder (`DecoderClient`).

    ``request`` never waits for the service; a thread reads the answers (in order, one link) and
    completes their futures. A broken link fails every pending future with ``unavailable``."""

    HELLO_QUEUE = ENCODER_HELLO_QUEUE
    LINK_PREFIX = "enc"
    WHAT = "encoder"
    unavailable: type[StageUnavailable] = StageUnavailable

    def __init__(
        self,
        address: str,
        *,
        device: torch.device | str = "cpu",
        worker: str = "",
        timeout_s: float = DEFAULT_TIMEOUT_S,
    ) -> None:
        self.address = address
        self.worker = worker
        self.device = torch.device(device)
        self.timeout_s = timeout_s
        store = connect_store(address, timeout_s=timeout_s)
        link = f"{self.LINK_PREFIX}/{uuid.uuid4().hex}"
        store.queue_push(self.HELLO_QUEUE, json.dumps({"link": link}))
        self.sender = LinkSender(
            open_pair(store, f"{link}/req", SOURCE_RANK, device=self.device, timeout_s=timeout_s),
            timeout_s=timeout_s,
        )
        self.receiver = LinkReceiver(
            open_pair(store, f"{link}/resp", TARGET_RANK, device=self.device, timeout_s=timeout_s),
            timeout_s=timeout_s,
        )
        self._store = store
        self._ids = itertools.count()
        self._pending: dict[int, Future[torch.Tensor]] = {}
        self._lock = threading.Lock()
        self.broken: BaseException | None = None
        self._reader = threading.Thread(target=self._read, name=f"{self.WHAT}-client", daemon=True)
        self._reader.start()

    @property
    def who(self) -> str:
        return f"{self.WHAT} {self.worker or self.address}"

    def send(
        self, kind: str, meta: dict[str, Any], tensor: torch.Tensor | None = None
    ) -> Future[torch.Tensor]:
        """Send one request (``meta`` gains its ``request`` number); the future holds the answer's
        tensor."""
        future: Future[torch.Tensor] = Future()
        with self._lock:
            if self.broken is not None:
                future.set_exception(self.unavailable(f"{self.who}: {self.broken}"))
                return future
            request_id = next(self._ids)
            self._pending[request_id] = future
        try:
            self.sender.send(StageMessage(kind, {**meta, "request": request_id}, tensor))
        except LinkError as exc:
            self._fail(exc)
        return future

    def close(self) -> None:
        self._fail(self.unavailable("client closed"))
        self.sender.close()
        self.receiver.close()

    def _read(self) -> None:
        while True:
            try:
                message = self.receiver.recv()
            except Exception as exc:  # LinkError, or the group closed under us
                self._fail(exc)
                return
            about = message.meta.get("meta", {}) if message.kind == "error" else message.meta
            with self._lock:
                future = self._pending.pop(int(about.get("request", -1)), None)
            if future is None:
                continue
            if message.kind == "error" or message.tensor is None:
                future.set_exception(
                    self.unavailable(str(message.meta.get("error", f"no answer from {self.who}")))
                )
            else:
                future.set_result(message.tensor)

    def _fail(self, exc: BaseException) -> None:
        with self._lock:
            if self.broken is None:
                self.broken = exc
            pending, self._pending = self._pending, {}
        for future in pending.values():
            if not future.done():
                future.set_exception(self.unavailable(f"{self.who}: {exc}"))


class EncoderClient(StageClient):
    """One diffusion worker's connection to one encoder worker."""

    unavailable = EncoderUnavailable

    def request(self, prompt: str) -> Future[torch.Tensor]:
        return self.send("prompt", {"prompt": prompt})

    def encode(self, prompt: str) -> torch.Tensor:
        """One round trip (blocks up to ``timeout_s``)."""
        return _result(self.request(prompt), self.timeout_s, self.worker or self.address)


class DecoderClient(StageClient):
    """One ``D``/``ED`` worker's connection to one decoder worker (``C``): a finished job's
    latents and meta go out as ``job_latents``, its frames come back (``job_frames``)."""

    HELLO_QUEUE = DECODER_HELLO_QUEUE
    LINK_PREFIX = "dec"
    WHAT = "decoder"
    unavailable = DecoderUnavailable

    def decode_job(self, latents: torch.Tensor, meta: dict[str, Any]) -> torch.Tensor:
        """A finished job's frames, uint8 ``[F, H, W, 3]`` (blocks up to ``timeout_s``)."""
        future = self.send(
            "job_latents", {"job": str(meta.get("job", "")), "meta": dict(meta)}, latents.contiguous()
        )
        return _result(future, self.timeout_s, self.worker or self.address, DecoderUnavailable)


def _result(
    future: Future[torch.Tensor],
    timeout_s: float,
    who: str,
    unavailable: type[StageUnavailable] = EncoderUnavailable,
) -> torch.Tensor:
    try:
        return future.result(timeout_s)
    except FutureTimeout:
        what = "decoder" if unavailable is DecoderUnavailable else "encoder"
        raise unavailable(f"{what} {who} did not answer within {timeout_s:.1f}s") from None


class Decoders:
    """A ``D``/``ED`` worker's decoder workers: one `DecoderClient` per address, the one in use
    chosen by the last job command's ``decoder`` (`use`)."""

    def __init__(self, *, device: torch.device | str = "cpu", timeout_s: float = DEFAULT_TIMEOUT_S) -> None:
        self.device = torch.device(device)
        self.timeout_s = timeout_s
        self._clients: dict[str, DecoderClient] = {}
        self.client: DecoderClient | None = None
        self.round_trips_ms: deque[float] = deque(maxlen=256)

    @property
    def known(self) -> bool:
        return self.client is not None

    def use(self, address: str, worker: str = "") -> None:
        client = self._clients.get(address)
        if client is None or client.broken is not None:
            if client is not None:
                client.close()
            try:
                client = DecoderClient(address, device=self.device, worker=worker, timeout_s=self.timeout_s)
            except Exception as exc:  # store or pair-group set-up failed
                raise DecoderUnavailable(
                    f"cannot reach decoder {worker or address} at {address}: {exc}"
                ) from exc
            self._clients[address] = client
        self.client = client

    def decode_job(self, latents: torch.Tensor, meta: dict[str, Any]) -> torch.Tensor:
        if self.client is None:
            raise DecoderUnavailable("no decoder worker is known (job_run names one: decoder)")
        started = time.perf_counter()
        frames = self.client.decode_job(latents, meta)
        self.round_trips_ms.append((time.perf_counter() - started) * 1000.0)
        return frames

    def close(self) -> None:
        for client in self._clients.values():
            client.close()
        self._clients.clear()
        self.client = None


class PromptEncodings:
    """The embeddings a diffusion worker has or has asked for, by prompt text (an LRU of
    ``cache_size`` answers), fetched from the encoder worker in use (`use`: connecting waits up to
    ``connect_timeout_s``, an answer up to ``timeout_s``)."""

    def __init__(
        self,
        *,
        device: torch.device | str = "cpu",
        cache_size: int = 64,
        timeout_s: float = DEFAULT_TIMEOUT_S,
        connect_timeout_s: float = 10.0,
    ) -> None:
        self.device = torch.device(device)
        self.cache_size = max(1, cache_size)
        self.timeout_s = timeout_s
        self.connect_timeout_s = connect_timeout_s
        self._clients: dict[str, EncoderClient] = {}
        self.client: EncoderClient | None = None
        self._cache: OrderedDict[str, Future[torch.Tensor]] = OrderedDict()
        self.round_trips_ms: deque[float] = deque(maxlen=256)

    @property
    def known(self) -> bool:
        return self.client is not None

    def use(self, address: str, worker: str = "") -> None:
        """Fetch from the encoder at ``address`` from now on (connects once per address; a broken
        connection is replaced). Raises `EncoderUnavailable` when it cannot connect."""
        client = self._clients.get(address)
        if client is None or client.broken is not None:
            if client is not None:
                client.close()
            try:
                client = EncoderClient(
                    address, device=self.device, worker=worker, timeout_s=self.connect_timeout_s
                )
            except Exception as exc:  # store or pair-group set-up failed
                raise EncoderUnavailable(
                    f"cannot reach encoder {worker or address} at {address}: {exc}"
                ) from exc
            self._clients[address] = client
        self.client = client

    def prefetch(self, prompt: str) -> Future[torch.Tensor]:
        future = self._cache.get(prompt)
        if future is not None and not (future.done() and future.exception() is not None):
            self._cache.move_to_end(prompt)
            return future
        if self.client is None or self.client.broken is not None:
            # Not cached: asked again once a command names an encoder (`use` reconnects). Never a
            # reconnect here: this runs in the daemon's hot loop, which must not wait on a dead peer.
            lost = (
                "no encoder worker is known" if self.client is None else f"encoder lost: {self.client.broken}"
            )
            future = Future()
            future.set_exception(EncoderUnavailable(lost))
            return future
        started = time.perf_counter()
        future = self.client.request(prompt)
        future.add_done_callback(
            lambda fut: self.round_trips_ms.append((time.perf_counter() - started) * 1000.0)
        )
        self._cache[prompt] = future
        while len(self._cache) > self.cache_size:
            self._cache.popitem(last=False)
        return future

    def ready(self, prompt: str) -> bool:
        """Whether the embeddings are at hand (asks for them when not yet asked)."""
        try:
            future = self.prefetch(prompt)
        except EncoderUnavailable:
            return False
        return future.done() and future.exception() is None

    def wait_reason(self, prompt: str) -> str:
        """Why the embeddings of ``prompt`` are not at hand (for the heartbeat)."""
        if self.client is None:
            return "no encoder worker is known"
        who = self.client.worker or self.client.address
        if self.client.broken is not None:
            return f"encoder {who} lost: {self.client.broken}"
        future = self._cache.get(prompt)
        if future is not None and future.done() and future.exception() is not None:
            return f"encoder {who}: {future.exception()}"
        return f"waiting for encoder {who}'s answer"

    def get(self, prompt: str) -> torch.Tensor:
        future = self.prefetch(prompt)
        return _result(future, self.timeout_s, "in use").to(self.device)

    def close(self) -> None:
        for client in self._clients.values():
            client.close()
        self._clients.clear()
        self.client = None
