"""Live stage workers (issue 15): a worker daemon hosting a role's stages, and the encoder pool.

A worker daemon (``manage.py gpuworker --stages ROLE``) runs any role:

- ``EDC`` — the monolithic worker, unchanged: its `ChunkEngine` holds the model itself.
- ``DC`` — a diffusion worker with no encoder weights. Its engine holds a `StagedStreamingModel`:
  a `StreamingVideoModel` over a `StagedModel` (diffuse and decode only) whose session state is
  built from prompt *embeddings* (``init_diffusion_state`` on a zeroed region) and whose step is
  diffuse → decode. The embeddings come from an encoder worker through an `EncoderClient`.
- ``E`` — an encoder worker: no sessions, no chunks. Its `EncoderService` answers encode requests
  from many ``DC`` workers, one pair of hand-off links (``stages/link.py``) per client, rendezvous
  on the store the worker already hosts for migrations (its ``migration_address``).
- ``C`` — a decoder worker: no sessions, no jobs. Its `DecoderService` decodes finished one-shot
  jobs' latents for ``D``/``ED`` workers (`DecoderClient`), the same request/response `StageService`
  as the encoder's on its own hello queue.
- ``D``, ``ED`` — one-shot job workers: a stream keeps decode next to diffuse (its causal VAE's
  per-session decoder cache), so they refuse sessions; a job's prompt is encoded on an ``E`` worker
  (``D``) or here (``ED``), its final latents decoded on the ``C`` worker its ``job_run`` names.

The split state. A ``DC`` session's region holds its diffusion state *and* its decoder cache, laid
out as the monolithic model's state region (``StagedModel.state_layout``; the decoder cache is the
tensors named in ``DECODER_CACHE``, empty for a stateless decoder) with the same metadata (prompt
schedule, active prompt, counters). Offload, migration and checkpoints therefore move both parts in
one copy, exactly as they move a monolithic state, and a session moves between an ``EDC`` and a
``DC`` worker (or a worker changes role under it) without conversion. A prompt switch stays text in
the schedule; the diffusion worker asks the encoder for its embeddings when the switch is set
(`StagedStreamingModel.set_prompt` prefetches) and the engine runs a session only once the encoding
of the prompt due at its next chunk is at hand (`step_ready`), so a slow or lost encoder delays that
session and never corrupts it.

Encoder protocol (per client, over the E worker's store): the client pushes a hello ``{"link": L}``
on ``ENCODER_HELLO_QUEUE``; both sides then open link ``L/req`` (client → encoder) and ``L/resp``
(encoder → client) in that order. A request is a ``prompt`` `StageMessage` with ``meta`` ``request``
(a per-client counter) and ``prompt``; the answer is the same message with the embeddings as its
tensor (the encoder's `StageRunner`, so its LRU cache of encodings serves every client), or an
``error`` message naming the request. Encodings are a function of the prompt and the weights only
(one prompt, alone), so every encoder replica of a preset answers the same bytes.
"""

from __future__ import annotations

import contextlib
import gc
import itertools
import json
import logging
import queue
import statistics
import threading
import time
import uuid
from collections import OrderedDict, deque
from collections.abc import Callable, Iterator, Mapping
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass
from typing import Any

import torch
from torch._C._distributed_c10d import TCPStore

from workers.runtime.models.base import Layout, SessionState, StagewiseModel, allocate_region
from workers.runtime.stages.contract import (
    Stage,
    StagedModel,
    parse_role,
    role_name,
    staged_class,
)
from workers.runtime.stages.link import (
    DEFAULT_TIMEOUT_S,
    LinkError,
    LinkReceiver,
    LinkSender,
    connect_store,
    open_pair,
)
from workers.runtime.stages.pipeline import StageMessage, StageProtocolError, StageRunner
from workers.runtime.transport.pair import SOURCE_RANK, TARGET_RANK

logger = logging.getLogger("workers.stages")

ENCODER_HELLO_QUEUE = "enc/hello"
DECODER_HELLO_QUEUE = "dec/hello"
# Roles whose worker runs no sessions and no jobs: a request/response stage service.
SERVICE_ROLES = ("E", "C")
_POLL_MIN_S, _POLL_MAX_S = 0.001, 0.05


class StageUnavailable(RuntimeError):
    """No stage service (encoder or decoder worker) answered a request (none known, link lost,
    timeout)."""


class EncoderUnavailable(StageUnavailable):
    """No encoder worker answered with the embeddings of a prompt (none known, link lost, timeout)."""


class DecoderUnavailable(StageUnavailable):
    """No decoder worker answered with a finished job's frames (none known, link lost, timeout)."""


def daemon_role(role: str) -> str:
    """The canonical role for the worker daemon (every role: ``D`` and ``ED`` run one-shot jobs only,
    ``E`` and ``C`` serve requests); `RoleError` (a `ValueError`) names the valid roles."""
    return role_name(parse_role(role))


# --- the diffusion worker's side ----------------------------------------------------------------------


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


class StagedStreamingModel(StagewiseModel):
    """The model of a ``DC`` worker's `ChunkEngine` (module docstring): the `StagedModel`'s diffuse
    and decode, the prompt embeddings from `PromptEncodings`; generation is `StagewiseModel.generate`
    (scheduled embeddings → diffuse → decode), the same code as the monolithic model's, so a ``DC``
    worker's chunks are bit-identical to an ``EDC`` worker's."""

    def __init__(
        self, staged: StagedModel, encodings: PromptEncodings, decoders: Decoders | None = None
    ) -> None:
        inner = staged.model
        self.staged = staged
        self.inner = inner
        self.encodings = encodings
        # A D or ED worker's decoder workers: a finished job's latents are decoded there.
        self.decoders = decoders or Decoders(device=inner.device, timeout_s=encodings.timeout_s)
        self.preset = inner.preset
        self.device = inner.device
        self.width, self.height, self.fps = inner.width, inner.height, inner.fps
        self.frames_per_chunk = inner.frames_per_chunk
        self.DECODER_CACHE = inner.DECODER_CACHE
        self.net = inner.net  # type: ignore[attr-defined]
        self.transferable_weights = False  # a partial network is no parameter-pool source

    @property
    def stages(self) -> frozenset[Stage]:
        return self.staged.stages

    # -- sessions --------------------------------------------------------------------------------

    def create_state(
        self, prompt: str, seed: int, options: dict[str, Any] | None = None, *, start_chunk: int = 0
    ) -> SessionState:
        """The diffusion state and the decoder cache, zeroed and filled from the prompt's
        embeddings (``init_diffusion_state``), in the monolithic state region's layout."""
        self.staged.require(Stage.DIFFUSE)
        self.staged.require(Stage.DECODE)
        self.inner.state_bytes_for(options)  # refuses options the model does not take
        embeddings = self.encodings.get(prompt)
        region, tensors = allocate_region(self.staged.state_layout(), self.device)
        region.zero_()
        state = SessionState(tensors=tensors, meta={}, region=region)
        self.staged.init_diffusion_state(state, seed, embeddings)
        counters = {k: v for k, v in state.meta.items()}
        state.meta = self.session_meta(prompt, seed, options, start_chunk, counters)
        return state

    def set_prompt(self, state: SessionState, prompt: str, from_chunk: int) -> None:
        super().set_prompt(state, prompt, from_chunk)
        if prompt != state.meta["active_prompt"] and self.encodings.known:
            self.encodings.prefetch(prompt)  # the round trip overlaps the chunks before the switch

    def step_ready(self, state: SessionState) -> bool:
        prompt = self.prompt_for_chunk(state, state.next_chunk)
        return prompt == state.meta["active_prompt"] or self.encodings.ready(prompt)

    def encode_prompt(self, prompt: str) -> torch.Tensor:
        return self.encodings.get(prompt)

    def diffuse(self, states: list[SessionState], embeddings: list[torch.Tensor | None]) -> torch.Tensor:
        return self.staged.diffuse(states, embeddings)

    def decode(self, latents: torch.Tensor, caches: list[dict[str, torch.Tensor]]) -> torch.Tensor:
        return self.staged.decode(latents, caches)

    def expected_layout(self, meta: dict[str, Any]) -> Layout:
        return self.inner.expected_layout(meta)

    # -- one-shot jobs: the model's own split at its encode (`StagedModel.create_job`) ------------

    def check_job(self, *, kind: str, width: int, height: int, frames: int, steps: int) -> None:
        self.staged.require_job_step()
        if Stage.DECODE not in self.stages and not self.decoders.known:
            raise DecoderUnavailable(
                f"a {role_name(self.stages)} worker decodes jobs on a decoder worker; none is known"
            )
        self.inner.check_job(kind=kind, width=width, height=height, frames=frames, steps=steps)

    def create_job(
        self, *, kind: str, prompt: str, seed: int, width: int, height: int, frames: int, steps: int
    ) -> SessionState:
        """The job's region at step 0 from its prompt's embeddings, fetched from the encoder worker
        (one round trip; `EncoderUnavailable` when none answers). Checked before anything is asked."""
        self.check_job(kind=kind, width=width, height=height, frames=frames, steps=steps)
        # An ED worker encodes its own prompt; a DC or D worker asks its encoder worker.
        local = Stage.ENCODE in self.stages
        embeddings = self.staged.encode(prompt) if local else self.encodings.get(prompt)
        return self.staged.create_job(
            embeddings,
            kind=kind,
            prompt=prompt,
            seed=seed,
            width=width,
            height=height,
            frames=frames,
            steps=steps,
        )

    def job_layout(self, meta: dict[str, Any]) -> Layout:
        return self.inner.job_layout(meta)

    @contextlib.contextmanager
    def abandon_on(self, flag: threading.Event | None) -> Iterator[None]:
        """The flag is the wrapped model's too: its `job_step` (run through the `StagedModel`) checks
        it at the same block boundaries as on an ``EDC`` worker (``check_abandon``)."""
        with super().abandon_on(flag), self.inner.abandon_on(flag):
            yield

    def job_step(self, states: list[SessionState]) -> None:
        self.staged.job_step(states)

    def job_frames(self, state: SessionState) -> torch.Tensor:
        """A finished job's frames: decoded here (``DC``), or on the decoder worker in use (``D``,
        ``ED``: one round trip of its final latents and meta, `DecoderUnavailable` when none
        answers) by the same `decode_job` call, so the frames are the same bytes."""
        if Stage.DECODE in self.stages:
            return self.inner.job_frames(state)
        return self.decoders.decode_job(state.tensors["latents"], state.meta)

    def state_bytes_for(self, options: dict[str, Any] | None = None) -> int:
        return self.inner.state_bytes_for(options)

    def describe(self) -> dict[str, Any]:
        return {**self.inner.describe(), "stage_role": role_name(self.staged.stages)}  # type: ignore[attr-defined]


# --- the encoder worker's side ---------------------------------------------------------------------


@dataclass
class _Client:
    link: str
    receiver: LinkReceiver
    sender: LinkSender


class StageService:
    """A request/response stage endpoint at a worker's store (module docstring: protocol): an
    ``E`` worker's encoder pool (`EncoderService`) or a ``C`` worker's decoder (`DecoderService`).

    An acceptor thread takes hellos off the store's ``HELLO_QUEUE`` and opens each client's links;
    one reader thread per client queues its requests; `serve_one` runs the oldest request through
    the worker's `StageRunner` and answers it — one bounded unit of work, run by `start`'s thread or
    driven by a test."""

    STAGE = Stage.ENCODE
    HELLO_QUEUE = ENCODER_HELLO_QUEUE
    WORKER = "E"

    def __init__(
        self,
        staged: StagedModel,
        store_address: str,
        *,
        device: torch.device | str = "cpu",
        cache_size: int = 64,
        timeout_s: float = DEFAULT_TIMEOUT_S,
    ) -> None:
        staged.require(self.STAGE)
        self.runner = StageRunner(staged, encoding_cache_size=cache_size)
        self.address = store_address
        self.device = torch.device(device)
        self.timeout_s = timeout_s
        self.requests: queue.Queue[tuple[_Client, StageMessage]] = queue.Queue()
        self.clients: list[_Client] = []
        self.served = 0
        self.serve_ms: deque[float] = deque(maxlen=256)
        self._stopping = threading.Event()
        self._threads: list[threading.Thread] = []
        self._store: TCPStore = connect_store(store_address, timeout_s=timeout_s)
        self._spawn(self._accept, f"{self.WORKER}-accept")

    def start(self) -> None:
        """Serve requests on a thread of their own (the worker's hot loop)."""
        self._spawn(self._serve_forever, f"{self.WORKER}-serve")

    def serve_one(self, timeout_s: float = 0.1) -> bool:
        """Answer the oldest request (waiting up to ``timeout_s`` for one)."""
        try:
            client, message = self.requests.get(timeout=timeout_s)
        except queue.Empty:
            return False
        started = time.perf_counter()
        try:
            answers = self.runner.handle(message)
            if len(answers) != 1 or answers[0].tensor is None:
                raise StageProtocolError(f"a {self.WORKER} worker does not serve {message.kind} messages")
            (answer,) = answers
        except StageProtocolError as exc:
            answer = StageMessage(
                "error",
                {"worker": self.WORKER, "error": str(exc), "message": message.kind, "meta": message.meta},
            )
        except Exception as exc:  # the stage itself failed (a bad shape): the client's request fails
            logger.exception("%s.request_failed kind=%s", self.WORKER, message.kind)
            answer = StageMessage(
                "error",
                {
                    "worker": self.WORKER,
                    "error": f"{type(exc).__name__}: {exc}",
                    "message": message.kind,
                    "meta": message.meta,
                },
            )
        self.serve_ms.append((time.perf_counter() - started) * 1000.0)
        try:
            client.sender.send(answer)
        except LinkError:
            logger.warning("%s.client_lost link=%s", self.WORKER, client.link)
        self.served += 1
        return True

    def load(self) -> dict[str, Any]:
        """The load a heartbeat reports."""
        samples = list(self.serve_ms)
        return {
            "queue": self.requests.qsize(),
            "served": self.served,
            "clients": len(self.clients),
            "p50": round(statistics.median(samples), 3) if samples else 0.0,
        }

    def close(self) -> None:
        self._stopping.set()
        for client in list(self.clients):
            client.sender.close()
            client.receiver.close()
        for thread in self._threads:
            thread.join(timeout=2)

    # -- threads ---------------------------------------------------------------------------------

    def _spawn(self, target: Callable[..., None], name: str, *args: Any) -> None:
        thread = threading.Thread(target=target, args=args, name=name, daemon=True)
        self._threads.append(thread)
        thread.start()

    def _serve_forever(self) -> None:
        while not self._stopping.is_set():
            self.serve_one(0.1)

    def _accept(self) -> None:
        pause = _POLL_MIN_S
        while not self._stopping.is_set():
            try:
                # Polled: TCPStore's blocking queue_pop loses wakeups (see transport.migration).
                raw = self._store.queue_pop(self.HELLO_QUEUE, False)
            except Exception as exc:
                if type(exc).__name__ != "QueueEmptyError":
                    logger.warning("%s.accept_failed address=%s error=%s", self.WORKER, self.address, exc)
                    return
                time.sleep(pause)
                pause = min(pause * 2, _POLL_MAX_S)
                continue
            pause = _POLL_MIN_S
            link = str(json.loads(raw)["link"])
            self._spawn(self._open_client, f"{self.WORKER}-open-{link[-6:]}", link)

    def _open_client(self, link: str) -> None:
        try:
            store = connect_store(self.address, timeout_s=self.timeout_s)
            receiver = LinkReceiver(
                open_pair(store, f"{link}/req", TARGET_RANK, device=self.device, timeout_s=self.timeout_s),
                timeout_s=self.timeout_s,
            )
            sender = LinkSender(
                open_pair(store, f"{link}/resp", SOURCE_RANK, device=self.device, timeout_s=self.timeout_s),
                timeout_s=self.timeout_s,
            )
        except Exception as exc:
            logger.warning("%s.client_failed link=%s error=%s", self.WORKER, link, exc)
            return
        client = _Client(link, receiver, sender)
        self.clients.append(client)
        while not self._stopping.is_set():
            try:
                message = receiver.recv()
            except Exception:  # the client went away (or we are closing)
                break
            self.requests.put((client, message))
        if client in self.clients:
            self.clients.remove(client)
        sender.close()


class EncoderService(StageService):
    """An ``E`` worker's encoder pool endpoint: ``prompt`` requests answered with their embeddings
    (the `StageRunner`'s LRU cache of encodings serves every client)."""

    def load(self) -> dict[str, Any]:
        load = super().load()
        return {
            "queue": load["queue"],
            "served": load["served"],
            "encode_ms_p50": load["p50"],
            "clients": load["clients"],
            "cache_hits": self.runner.encode_hits,
            "cache_misses": self.runner.encode_misses,
        }


class DecoderService(StageService):
    """A ``C`` worker's decoder endpoint: a finished one-shot job's ``job_latents`` (its final
    latents and meta) answered with its ``job_frames`` (`StagedModel.decode_job`, the same call an
    ``EDC`` worker's `job_frames` makes, so the frames are bit-identical)."""

    STAGE = Stage.DECODE
    HELLO_QUEUE = DECODER_HELLO_QUEUE
    WORKER = "C"

    def load(self) -> dict[str, Any]:
        load = super().load()
        return {
            "queue": load["queue"],
            "served": load["served"],
            "decode_ms_p50": load["p50"],
            "clients": load["clients"],
        }


# --- role changes --------------------------------------------------------------------------------


# Loads the named network components' weights for a stage a worker adds at run time:
# ``components -> (tensors by name, source, detail)``, source one of peer, host-cache, local, seed
# (``workers.weights_loading.StageWeightsFetcher`` pulls them from the parameter pool).
StageLoader = Callable[[list[str]], tuple[Mapping[str, torch.Tensor], str, str]]


def restage(
    model: StagewiseModel,
    stages: tuple[Stage, ...],
    *,
    weights_path: str | None = None,
    weights: Mapping[str, torch.Tensor] | None = None,
    loader: StageLoader | None = None,
) -> tuple[StagedModel, str, str]:
    """The same model re-cut to host ``stages``: the components of stages it lacks are built and
    loaded (through ``loader``, else from ``weights_path``/``weights`` or the preset's own weights,
    as a stage worker's are), those of stages it no longer hosts are dropped (their memory freed once
    nothing else holds them). Returns the adapter over the model (the network object is changed in
    place), where the loaded weights came from (``""`` when nothing was loaded) and a detail."""
    adapter = staged_class(model.preset)
    net = model.net  # type: ignore[attr-defined]
    hosted = {
        stage
        for stage in Stage
        if all(getattr(net, name, None) is not None for name in adapter.COMPONENTS[stage])
    }
    missing = tuple(stage for stage in stages if stage not in hosted)
    source = detail = ""
    if missing:
        kwargs: dict[str, Any] = {"stages": missing, "device": model.device}
        if loader is not None:
            weights, source, detail = loader(adapter.components_for(missing))
        elif weights is None:
            source, detail = ("local", weights_path) if weights_path is not None else ("seed", "preset seed")
        if weights_path is not None and weights is None:
            kwargs["weights_path"] = weights_path
        if weights is not None:
            kwargs["weights"] = weights
        donor = adapter.from_preset(model.preset, **kwargs)
        for stage in missing:
            for name in adapter.COMPONENTS[stage]:
                setattr(net, name, getattr(donor.net, name))
    for stage in hosted - set(stages):
        for name in adapter.COMPONENTS[stage]:
            setattr(net, name, None)
    return adapter(model, tuple(stages)), source, detail


def hosted_stages(model: StagewiseModel) -> tuple[Stage, ...]:
    """The stages whose components ``model``'s network holds now."""
    adapter = staged_class(model.preset)
    net = model.net  # type: ignore[attr-defined]
    return tuple(
        stage
        for stage in Stage
        if all(getattr(net, name, None) is not None for name in adapter.COMPONENTS[stage])
    )


def resident_weight_bytes(model: StagewiseModel, extra: list[torch.Tensor] = ()) -> int:  # type: ignore[assignment]
    """Bytes of weight memory ``model`` keeps alive: the storages behind its network's parameters
    and buffers (a view of a packed pool buffer counts its whole buffer), plus ``extra`` tensors
    (the pool copy), each storage once."""
    net = model.net  # type: ignore[attr-defined]
    storages: dict[tuple[str, int], int] = {}
    for tensor in (*net.parameters(), *net.buffers(), *extra):
        if tensor.device.type == "meta":
            continue
        storage = tensor.untyped_storage()
        storages[(str(tensor.device), storage.data_ptr())] = storage.nbytes()
    return sum(storages.values())


def prompt_at(meta: Mapping[str, Any], chunk: int) -> str:
    """The prompt in force at ``chunk`` under a session meta's schedule."""
    schedule = meta["prompt_schedule"]
    prompt = schedule[0][1]
    for start, text in schedule:
        if int(start) <= chunk:
            prompt = text
    return prompt


def pending_switch(meta: Mapping[str, Any]) -> int | None:
    """The first chunk at which a session's state still needs a prompt's embeddings (a switch due
    at its next chunk or scheduled later), or None when every prompt it will use is installed."""
    next_chunk = int(meta["next_chunk"])
    schedule = meta.get("prompt_schedule") or []
    in_force = None
    for start, text in schedule:
        if int(start) <= next_chunk:
            in_force = text
    if in_force is not None and in_force != meta.get("active_prompt"):
        return next_chunk
    later = [int(start) for start, _ in schedule if int(start) > next_chunk]
    return min(later) if later else None


# --- the worker daemon's role ------------------------------------------------------------------


class RoleRefused(RuntimeError):
    """A role change the worker cannot make now (the reason names the session or the role)."""


class PoolCopy:
    """A worker's packed copy of the whole model in the parameter pool (the model's weights are
    views of its buffers). ``release`` takes the worker out of the pool and lets go of the copy:
    ``workers.weights_loading.PooledCopy`` is the real one."""

    def tensors(self) -> list[torch.Tensor]:
        return []

    def release(self) -> None:
        """Leave the pool; the buffers are freed once nothing views them."""


class StageHost:
    """What a worker daemon's role decides: its engine's model (monolithic or `StagedStreamingModel`),
    the encoder it fetches embeddings from (``DC``) or the encoder service it runs (``E``), and how
    it changes role at run time (`set_role`). The daemon calls it from its loop only.

    ``pool_copy``: the worker's copy in the parameter pool, released when the worker drops a stage
    (a partial copy is no source, and its dropped blocks' memory must go back). ``loader``: where a
    stage added at run time loads its components from (`StageLoader`; default: ``weights_path`` or
    the preset's seed)."""

    def __init__(
        self,
        engine: Any,
        *,
        store_address: str | None = None,
        weights_path: str | None = None,
        timeout_s: float = DEFAULT_TIMEOUT_S,
        pool_copy: PoolCopy | None = None,
        loader: StageLoader | None = None,
    ) -> None:
        self.engine = engine
        self.store_address = store_address
        self.weights_path = weights_path
        self.timeout_s = timeout_s
        self.pool_copy = pool_copy
        self.loader = loader
        # Sessions waiting for a prompt's embeddings, with the reason (the heartbeat reports them).
        self.waiting: dict[str, str] = {}
        model = engine.model
        if isinstance(model, StagedStreamingModel):
            self.role = role_name(model.stages)
            self.encodings = model.encodings
        else:
            self.role = "EDC"
            self.encodings = PromptEncodings(device=engine.device, timeout_s=timeout_s)
        self.service: StageService | None = None
        if self.role in SERVICE_ROLES:
            self.service = self._service(model.staged, self.role)

    @property
    def needs_encoder(self) -> bool:
        """Whether sessions and jobs here take their embeddings from an encoder worker."""
        return "D" in self.role and "E" not in self.role

    @property
    def needs_decoder(self) -> bool:
        """Whether jobs here are decoded on a decoder worker (``D``, ``ED``)."""
        return "D" in self.role and "C" not in self.role

    @property
    def holds_sessions(self) -> bool:
        return "D" in self.role and "C" in self.role

    @property
    def runs_jobs(self) -> bool:
        return "D" in self.role

    @property
    def sessions_refused(self) -> str:
        """Why this worker takes no sessions (``""`` when it does)."""
        if self.holds_sessions:
            return ""
        if self.runs_jobs:
            return (
                f"role {self.role} runs one-shot jobs only: a stream needs decode next to diffuse "
                "(its causal VAE keeps a per-session decoder cache); start it on an EDC or DC worker"
            )
        return f"role {self.role} holds no sessions: start them on a diffusion worker"

    @property
    def decoders(self) -> Decoders | None:
        model = self.engine.model
        return model.decoders if isinstance(model, StagedStreamingModel) else None

    def start(self) -> None:
        if self.service is not None:
            self.service.start()

    def use_encoder(self, spec: Any) -> None:
        """``{"worker": name, "address": host:port}`` from a command; `ValueError` names the field."""
        if not isinstance(spec, Mapping) or not isinstance(spec.get("address"), str) or not spec["address"]:
            raise ValueError(f"encoder: required for role {self.role} ({{'worker': .., 'address': ..}})")
        self.encodings.use(spec["address"], str(spec.get("worker", "")))

    def use_decoder(self, spec: Any) -> None:
        """``{"worker": name, "address": host:port}`` from a job command; `ValueError` names the field."""
        if not isinstance(spec, Mapping) or not isinstance(spec.get("address"), str) or not spec["address"]:
            raise ValueError(f"decoder: required for role {self.role} ({{'worker': .., 'address': ..}})")
        decoders = self.decoders
        assert decoders is not None  # a D or ED worker runs a StagedStreamingModel
        decoders.use(spec["address"], str(spec.get("worker", "")))

    def set_role(self, role: str, sessions: Mapping[str, Mapping[str, Any]]) -> dict[str, Any]:
        """Become ``role``; ``sessions`` is the meta of every session this worker holds (resident,
        parked or arriving). Refuses (`RoleRefused`) when a session needs a stage the role drops, or
        a prompt encoding no encoder is known to provide."""
        try:
            target = daemon_role(role)
        except ValueError as exc:  # RoleError is a ValueError
            raise RoleRefused(str(exc)) from exc
        if target == self.role:
            return {"role": target, "load_ms": 0.0, "loaded": "", "dropped": ""}
        stages = parse_role(target)
        if sessions and not (Stage.DIFFUSE in stages and Stage.DECODE in stages):
            sid = next(iter(sessions))
            raise RoleRefused(
                f"session {sid} (and {len(sessions) - 1} more) needs diffuse and decode, which role {target} drops"
            )
        if Stage.ENCODE not in stages and not self.encodings.known:
            for sid, meta in sessions.items():
                chunk = pending_switch(meta)
                if chunk is not None:
                    raise RoleRefused(
                        f"session {sid} needs a prompt's embeddings at chunk {chunk} and no encoder is "
                        f"known to this worker (send set_role with an encoder)"
                    )
        if target in SERVICE_ROLES and self.store_address is None:
            raise RoleRefused(f"role {target} serves at the worker's store address; this worker has none")
        model = self.engine.model
        inner = model.inner if isinstance(model, StagedStreamingModel) else model
        before = set(hosted_stages(inner))
        bytes_before = self.weights_bytes()
        started = time.perf_counter()
        if self.service is not None:
            self.service.close()
            self.service = None
        staged, source, detail = restage(inner, stages, weights_path=self.weights_path, loader=self.loader)
        if set(stages) != set(Stage) and self.pool_copy is not None:
            # A partial model is no pool source: leave the pool and free the dropped blocks.
            self.pool_copy.release()
            self.pool_copy = None
        gc.collect()  # the dropped modules may sit in reference cycles
        if inner.device.type == "cuda":
            torch.cuda.synchronize(inner.device)
            torch.cuda.empty_cache()  # the dropped stages' weights go back to the device
        load_ms = (time.perf_counter() - started) * 1000.0
        decoders = self.decoders
        self.engine.model = (
            inner if target == "EDC" else StagedStreamingModel(staged, self.encodings, decoders)
        )
        if target in SERVICE_ROLES:
            self.service = self._service(staged, target)
            self.service.start()
        self.role = target
        return {
            "role": target,
            "load_ms": round(load_ms, 3),
            "loaded": role_name(frozenset(set(stages) - before)),
            "dropped": role_name(frozenset(before - set(stages))),
            "source": source,
            "source_detail": detail,
            "weights_bytes_before": bytes_before,
            "weights_bytes": self.weights_bytes(),
        }

    def weights_bytes(self) -> int:
        """Weight memory this worker keeps alive now (model and pool copy, `resident_weight_bytes`)."""
        model = self.engine.model
        inner = model.inner if isinstance(model, StagedStreamingModel) else model
        extra = self.pool_copy.tensors() if self.pool_copy is not None else []
        return resident_weight_bytes(inner, extra)

    def note_waiting(self, metas: Mapping[str, Mapping[str, Any]]) -> None:
        """Record which of these (due, not generated) sessions wait for a prompt's embeddings, and
        why; called by the daemon after each step."""
        waiting: dict[str, str] = {}
        if self.needs_encoder:
            for sid, meta in metas.items():
                prompt = prompt_at(meta, int(meta["next_chunk"]))
                if prompt != meta.get("active_prompt") and not self.encodings.ready(prompt):
                    waiting[sid] = self.encodings.wait_reason(prompt)
        self.waiting = waiting

    def report(self) -> dict[str, Any]:
        """What the heartbeat adds to the telemetry: the role, and an encoder's load."""
        fields: dict[str, Any] = {"stage_role": self.role}
        if self.service is not None:
            fields["encoder" if self.role == "E" else "decoder"] = self.service.load()
            fields["session_capacity"] = 0
        elif self.needs_encoder and self.encodings.round_trips_ms:
            fields["encode_round_trip_ms_p50"] = round(statistics.median(self.encodings.round_trips_ms), 3)
        if not self.holds_sessions:
            fields["session_capacity"] = 0
        decoders = self.decoders
        if self.needs_decoder and decoders is not None and decoders.round_trips_ms:
            fields["decode_round_trip_ms_p50"] = round(statistics.median(decoders.round_trips_ms), 3)
        waiting = self.waiting
        if waiting:
            fields["encoder_wait"] = {"sessions": sorted(waiting), "reason": next(iter(waiting.values()))}
        return fields

    def close(self) -> None:
        if self.service is not None:
            self.service.close()
        self.encodings.close()
        if self.decoders is not None:
            self.decoders.close()

    def _service(self, staged: StagedModel, role: str) -> StageService:
        if self.store_address is None:
            raise RoleRefused(f"role {role} serves at the worker's store address; this worker has none")
        service = EncoderService if role == "E" else DecoderService
        return service(staged, self.store_address, device=self.engine.device, timeout_s=self.timeout_s)


def staged_engine_model(
    preset: str,
    role: str,
    *,
    device: torch.device | str = "cpu",
    weights_path: str | None = None,
    timeout_s: float = DEFAULT_TIMEOUT_S,
) -> StagedStreamingModel:
    """The engine model of a worker of a split role (``ED``, ``DC``, ``D``, ``E``, ``C``), with
    only its stages' weights loaded."""
    name = daemon_role(role)
    if name == "EDC":
        raise ValueError("an EDC worker runs the monolithic model")
    kwargs: dict[str, Any] = {"stages": parse_role(name), "device": device}
    if weights_path is not None:
        kwargs["weights_path"] = weights_path
    staged = staged_class(preset).from_preset(preset, **kwargs)
    return StagedStreamingModel(
        staged,
        PromptEncodings(device=staged.device, timeout_s=timeout_s),
        Decoders(device=staged.device, timeout_s=timeout_s),
    )
