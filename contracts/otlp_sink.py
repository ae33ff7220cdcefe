"""A stand-in for an OpenTelemetry collector: an OTLP/HTTP trace receiver on a local port that keeps
every span it is sent, decoded (``opentelemetry-proto``, which the OTLP exporter depends on). The
traces' end-to-end test checks what the processes export with it; ``bench_delivery --tracing on``
and ``bench_decision_run --tracing on`` export to it, so tracing's cost is measured with a real
export and nothing else listening.
"""

from __future__ import annotations

import gzip
import threading
from collections import Counter, defaultdict
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


class OtlpSink:
    """An OTLP/HTTP trace receiver on a local port: every span it is sent, decoded, with its
    process's ``service.name``."""

    def __init__(self) -> None:
        from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
            ExportTraceServiceRequest,
            ExportTraceServiceResponse,
        )

        self.spans: list[dict] = []
        self.lock = threading.Lock()
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
                if self.headers.get("Content-Encoding") == "gzip":
                    body = gzip.decompress(body)
                request = ExportTraceServiceRequest()
                request.ParseFromString(body)
                receiver.add(request)
                answer = ExportTraceServiceResponse().SerializeToString()
                self.send_response(200)
                self.send_header("Content-Type", "application/x-protobuf")
                self.send_header("Content-Length", str(len(answer)))
                self.end_headers()
                self.wfile.write(answer)

            def log_message(self, *args) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.port = self.server.server_address[1]
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def add(self, request) -> None:
        spans = []
        for resource_spans in request.resource_spans:
            resource = {a.key: _value(a.value) for a in resource_spans.resource.attributes}
            for scope_spans in resource_spans.scope_spans:
                for span in scope_spans.spans:
                    spans.append(
                        {
                            "name": span.name,
                            "service": resource.get("service.name"),
                            "trace_id": span.trace_id.hex(),
                            "span_id": span.span_id.hex(),
                            "parent_span_id": span.parent_span_id.hex(),
                            "attributes": {a.key: _value(a.value) for a in span.attributes},
                            "events": [
                                {"name": e.name, "attributes": {a.key: _value(a.value) for a in e.attributes}}
                                for e in span.events
                            ],
                        }
                    )
        with self.lock:
            self.spans.extend(spans)

    def traces(self) -> dict[str, list[dict]]:
        by_trace = defaultdict(list)
        with self.lock:
            for span in self.spans:
                by_trace[span["trace_id"]].append(span)
        return by_trace

    def names(self) -> dict[str, int]:
        """How many spans of each name were received."""
        with self.lock:
            return dict(Counter(span["name"] for span in self.spans))

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def _value(any_value):
    kind = any_value.WhichOneof("value")
    if kind == "array_value":
        return [_value(v) for v in any_value.array_value.values]
    return getattr(any_value, kind) if kind else None
