"""OpenTelemetry traces, free when off (docs/observability.md, "Traces").

Every process imports this module; only a process whose tracing is on (``tracing_start``, called
by its entry point through ``controlplane.tracing``) imports the SDK, from ``contracts.otel``. Off,
nothing of OpenTelemetry is imported and the hot paths (a chunk's publish on the worker, its
delivery on each socket) pay one test of the module flag ``ON``::

    if tracing.ON and tracing.chunk_sampled():
        ...

A trace crosses processes as a W3C ``traceparent`` string: in a chunk's channel-layer message
(``traceparent`` beside its header), in a worker command's JSON body, in a Celery task's headers
(the Celery instrumentation), so every helper here takes and gives that string, never an SDK object.
"""

from __future__ import annotations

import random
from contextlib import AbstractContextManager, nullcontext
from typing import Any

ON = False  # whether this process exports spans; read on hot paths, so a plain module attribute
_tracing: Any = None  # contracts.otel.Tracing while ON
_random = random.Random()

# Span names (docs/observability.md lists them with their attributes).
CHUNK = "chunk"  # the worker: from the chunk handed to the publisher to its send
CHUNK_PUBLISH = "chunk.publish"  # the worker: record appended and message sent to the group
CHUNK_RECEIVE = "chunk.receive"  # a web process: the message taken by one socket's consumer
CHUNK_SEND = "chunk.send"  # a web process: the binary frame written to the socket
SCHEDULER_EVENT = "scheduler.event"  # the process where the event happened: the task enqueued
SCHEDULER_DECISION = "scheduler.decision"  # Celery: one pool's decision run
COMMAND_SEND = "command.send"  # Celery: a command appended to its worker's stream
WORKER_COMMAND = "worker.command"  # the worker: the command applied
WORKER_ANSWER = "worker.answer"  # the worker: its answer given
COMMAND_ANSWERED = "command.answered"  # the worker's reporter: the answer recorded in PostgreSQL


def tracing_start(
    *,
    service_name: str,
    endpoint: str,
    chunk_sample_rate: float,
    exporter: Any = None,
) -> None:
    """Export this process's spans to the OTLP/HTTP ``endpoint`` (``http://host:4318``) under
    ``service_name``; a chunk's trace starts on ``chunk_sample_rate`` of the chunks (0…1).
    ``exporter``: another span exporter (tests). Idempotent."""
    global ON, _tracing
    if ON:
        return
    # Only when tracing is on: off, no OpenTelemetry module is imported (docs/observability.md).
    from contracts import otel

    _tracing = otel.Tracing(
        service_name=service_name, endpoint=endpoint, chunk_sample_rate=chunk_sample_rate, exporter=exporter
    )
    ON = True


def tracing_stop() -> None:
    """Export what is buffered and stop (also done at interpreter exit)."""
    global ON, _tracing
    if _tracing is not None:
        _tracing.shutdown()
    ON, _tracing = False, None


def chunk_sampled() -> bool:
    """Whether a chunk starts a trace (call only when ``ON``)."""
    return _random.random() < _tracing.chunk_sample_rate


def span(
    name: str,
    *,
    parent: str | None = None,
    kind: str = "internal",
    attributes: dict[str, Any] | None = None,
    start_ns: int | None = None,
) -> AbstractContextManager[Any]:
    """A span around a block, current inside it: a child of ``parent`` (a ``traceparent``) if
    given, else of the current span. ``kind``: internal, producer, consumer, client or server.
    Off: a context manager that does nothing and yields None."""
    if not ON:
        return nullcontext(None)
    return _tracing.span(name, parent=parent, kind=kind, attributes=attributes, start_ns=start_ns)


def traceparent() -> str | None:
    """The current span's W3C ``traceparent`` (None: off, or no span recorded here)."""
    if not ON:
        return None
    return _tracing.traceparent()


def attributes_set(attributes: dict[str, Any]) -> None:
    """Set attributes on the current span (nothing when off)."""
    if ON:
        _tracing.attributes_set(attributes)


def event_add(name: str, attributes: dict[str, Any]) -> None:
    """Add an event to the current span (nothing when off)."""
    if ON:
        _tracing.event_add(name, attributes)
