from __future__ import annotations

from django.conf import settings
from django.urls import path

from scheduling import views
from scheduling.metrics import metrics_view

urlpatterns = [
    path("console/", views.console_page, name="console"),
    path("console/audit/", views.audit_page, name="console-audit"),
    path("console/snapshot/", views.console_snapshot, name="console-snapshot"),
    path("console/workers/<int:worker_id>/drain/", views.console_worker_drain, name="console-worker-drain"),
    path(
        "console/sessions/<uuid:session_id>/terminate/",
        views.console_session_terminate,
        name="console-session-terminate",
    ),
    path("console/config/", views.console_config, name="console-config"),
]
if settings.STREAMSERVE["METRICS_ENABLED"]:
    # Prometheus exposition (scheduling/metrics.py) at the path Prometheus scrapes by default.
    urlpatterns.append(path("metrics", metrics_view, name="metrics"))
