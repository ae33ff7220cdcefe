"""Tracing's wiring: each entry point (the ASGI app, a Celery worker process, beat, a GPU worker)
calls ``tracing_configure`` with its process kind once, before it serves anything.

Off (``OTEL_ENABLED`` unset or false) it returns at once, importing nothing of OpenTelemetry. On,
it starts the exporter (``contracts.tracing``) under the process's service name and instruments
what the process uses: Django's requests (web), Celery's task publish and run (trace context in the
task's headers), psycopg's queries.
"""

from __future__ import annotations

from django.conf import settings

PROCESSES = ("web", "celery", "beat", "worker")


def tracing_configure(process: str) -> bool:
    """Start tracing in this process if the settings turn it on; returns whether they do."""
    if process not in PROCESSES:
        raise ValueError(f"unknown process kind {process!r}; known: {', '.join(PROCESSES)}")
    conf = settings.TRACING
    if not conf["ENABLED"]:
        return False
    # Only when tracing is on: off, no OpenTelemetry module is imported (docs/observability.md).
    from contracts import tracing

    if tracing.ON:
        return True
    tracing.tracing_start(
        service_name=conf["SERVICE_NAMES"][process],
        endpoint=conf["ENDPOINT"],
        chunk_sample_rate=conf["CHUNK_SAMPLE_RATE"],
    )
    from opentelemetry.instrumentation.celery import CeleryInstrumentor
    from opentelemetry.instrumentation.psycopg import PsycopgInstrumentor

    if process == "web":
        from opentelemetry.instrumentation.django import DjangoInstrumentor

        # Probes and scrapes are not requests anyone follows.
        DjangoInstrumentor().instrument(excluded_urls="/healthz,/readyz,/metrics,/static/")
    # The instrumentation finds a sent task by name in the app's registry, and a task it cannot
    # find leaves its publish span open and current for good: load the task modules here (a Celery
    # worker or beat has them already; the web and GPU worker processes only send by name).
    from controlplane.celery import app

    app.loader.import_default_modules()
    CeleryInstrumentor().instrument()
    PsycopgInstrumentor().instrument(skip_dep_check=True)
    return True
