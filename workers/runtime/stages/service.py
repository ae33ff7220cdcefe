"""Request/response stage services, the service side (issue 15): an ``E`` worker's encoder pool
and a ``C`` worker's decoder, answering many clients (``stages.clients``: the protocol) at the
store the worker already hosts for migrations (its ``migration_address``).
"""

from __future__ import annotations

import json
import logging
import queue
import statistics
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch._C._distributed_c10d import TCPStore

from workers.runtime.stages.clients import DECODER_HELLO_QUEUE, ENCODER_HELLO_QUEUE
from workers.runtime.stages.contract import Stage, StagedModel
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

_POLL_MIN_S, _POLL_MAX_S = 0.001, 0.05


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
