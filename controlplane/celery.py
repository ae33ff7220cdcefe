"""The Celery application: the scheduler's event-driven runs and the periodic tick execute here."""

from __future__ import annotations

import os

from celery import Celery

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "controlplane.settings")

app = Celery("streamserve")
app.config_from_object("django.conf:settings", namespace="CELERY")
app.autodiscover_tasks()
