"""The Celery application: the scheduler's event-driven runs and the periodic tick execute here."""

from __future__ import annotations

import os

from celery import Celery
from celery.signals import beat_init, worker_process_init

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "controlplane.settings")

app = Celery("streamserve")
app.config_from_object("django.conf:settings", namespace="CELERY")
app.autodiscover_tasks()


# Tracing (docs/observability.md) starts in each process that runs tasks, after the fork: an exporter's
# thread does not survive one. Beat sends the periodic tasks.
@worker_process_init.connect(weak=False)
def _tracing_worker_process(**_kwargs) -> None:
    # Only when tracing is on: off, no OpenTelemetry module is imported (docs/observability.md).
    from controlplane.tracing import tracing_configure

    tracing_configure("celery")


@beat_init.connect(weak=False)
def _tracing_beat(**_kwargs) -> None:
    # Only when tracing is on: off, no OpenTelemetry module is imported (docs/observability.md).
    from controlplane.tracing import tracing_configure

    tracing_configure("beat")
