"""The OpenTelemetry SDK behind ``contracts.tracing``: imported only by a process whose tracing is on.

The sampler keeps whole traces and only ours: a span whose parent was sampled is kept (ParentBased),
and a span that starts a trace is kept only if it is one a person follows — an HTTP request (the
Django instrumentation's server spans), a scheduler event or decision, a worker command, a chunk
picked by the chunk sample rate (``contracts.tracing.chunk_sampled`` decides before the span
exists) or a Celery task of the scheduler's events. The database queries, Redis commands and
periodic tasks that run outside those (the worker's heartbeat, the record ingest every second, the
beat tick) would otherwise be a trace each: they are dropped.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor
from opentelemetry.sdk.trace.sampling import (
    ALWAYS_OFF,
    ALWAYS_ON,
    ParentBased,
    Sampler,
    SamplingResult,
)
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from contracts import tracing

_KINDS = {
    "internal": trace.SpanKind.INTERNAL,
    "producer": trace.SpanKind.PRODUCER,
    "consumer": trace.SpanKind.CONSUMER,
    "client": trace.SpanKind.CLIENT,
    "server": trace.SpanKind.SERVER,
}
# Roots kept besides HTTP requests: ours, and the Celery instrumentation's spans of the event task
# (``apply_async/<task>`` where it is sent, ``run/<task>`` where it runs) when no span of ours is
# around them (an event sent by a process whose tracing is off).
ROOT_NAMES = frozenset(
    {
        tracing.CHUNK,
        tracing.SCHEDULER_EVENT,
        tracing.SCHEDULER_DECISION,
        tracing.WORKER_COMMAND,
        "apply_async/scheduling.tasks.scheduler_event",
        "run/scheduling.tasks.scheduler_event",
    }
)


class OurRoots(Sampler):
    """Keeps a trace's first span if it is an HTTP request or one of ``ROOT_NAMES``."""

    def should_sample(
        self, parent_context, trace_id, name, kind=None, attributes=None, links=None, trace_state=None
    ) -> SamplingResult:
        keep = kind == trace.SpanKind.SERVER or name in ROOT_NAMES
        return (ALWAYS_ON if keep else ALWAYS_OFF).should_sample(
            parent_context, trace_id, name, kind, attributes, links, trace_state
        )

    def get_description(self) -> str:
        return "StreamServeRoots"


class Tracing:
    def __init__(self, *, service_name: str, endpoint: str, chunk_sample_rate: float, exporter: Any) -> None:
        self.chunk_sample_rate = chunk_sample_rate
        self.provider = TracerProvider(
            resource=Resource.create({"service.name": service_name}),
            sampler=ParentBased(root=OurRoots()),
        )
        if exporter is None:
            exporter = OTLPSpanExporter(endpoint=endpoint.rstrip("/") + "/v1/traces")
        self.provider.add_span_processor(BatchSpanProcessor(exporter))
        trace.set_tracer_provider(self.provider)
        self.tracer = self.provider.get_tracer("streamserve")
        self.propagator = TraceContextTextMapPropagator()

    def shutdown(self) -> None:
        self.provider.shutdown()

    @contextmanager
    def span(
        self,
        name: str,
        *,
        parent: str | None,
        kind: str,
        attributes: dict[str, Any] | None,
        start_ns: int | None,
    ) -> Iterator[Any]:
        context = self.propagator.extract({"traceparent": parent}) if parent else None
        with self.tracer.start_as_current_span(
            name, context=context, kind=_KINDS[kind], attributes=_clean(attributes), start_time=start_ns
        ) as current:
            yield current

    def traceparent(self) -> str | None:
        carrier: dict[str, str] = {}
        self.propagator.inject(carrier, context=otel_context.get_current())
        return carrier.get("traceparent")

    def attributes_set(self, attributes: dict[str, Any]) -> None:
        current = trace.get_current_span()
        if current.is_recording():
            current.set_attributes(_clean(attributes))

    def event_add(self, name: str, attributes: dict[str, Any]) -> None:
        current = trace.get_current_span()
        if current.is_recording():
            current.add_event(name, _clean(attributes))


def _clean(attributes: dict[str, Any] | None) -> dict[str, Any] | None:
    """Attribute values OpenTelemetry takes: None dropped, anything else not a scalar (or list of
    them) as its string."""
    if not attributes:
        return attributes
    out: dict[str, Any] = {}
    for key, value in attributes.items():
        if value is None:
            continue
        if isinstance(value, bool | int | float | str):
            out[key] = value
        elif isinstance(value, list | tuple) and all(isinstance(v, bool | int | float | str) for v in value):
            out[key] = list(value)
        else:
            out[key] = str(value)
    return out
