from __future__ import annotations

from django.urls import path
from rest_framework.routers import DefaultRouter

from gpu.api import CostAuditView, GpuWorkerViewSet, ParameterPoolView, RegionViewSet
from scheduling.api import (
    MigrationViewSet,
    RegionMovesAuditView,
    ScalingActionViewSet,
    SchedulerConfigView,
    SchedulerDecisionViewSet,
    SessionMigrateView,
    StagePlacementAuditView,
)
from sessions.api import (
    JobAuditView,
    JobViewSet,
    LatencyAuditView,
    ModelCatalogView,
    SessionViewSet,
    TenantUsageAuditView,
    TenantViewSet,
)

router = DefaultRouter()
router.register("sessions", SessionViewSet, basename="session")
router.register("jobs", JobViewSet, basename="job")
router.register("tenants", TenantViewSet, basename="tenant")
router.register("workers", GpuWorkerViewSet, basename="worker")
router.register("regions", RegionViewSet, basename="region")
router.register("decisions", SchedulerDecisionViewSet, basename="decision")
router.register("migrations", MigrationViewSet, basename="migration")
router.register("scaling-actions", ScalingActionViewSet, basename="scaling-action")

urlpatterns = [
    path("models/", ModelCatalogView.as_view(), name="model-catalog"),
    path("scheduler/config/", SchedulerConfigView.as_view(), name="scheduler-config"),
    path("audit/cost/", CostAuditView.as_view(), name="audit-cost"),
    path("parameter-pool/", ParameterPoolView.as_view(), name="parameter-pool"),
    path("audit/latency/", LatencyAuditView.as_view(), name="audit-latency"),
    path("audit/jobs/", JobAuditView.as_view(), name="audit-jobs"),
    path("audit/tenants/", TenantUsageAuditView.as_view(), name="audit-tenants"),
    path("audit/placements/", StagePlacementAuditView.as_view(), name="audit-placements"),
    path("audit/region-moves/", RegionMovesAuditView.as_view(), name="audit-region-moves"),
    # The operator's request lives with the scheduler; the URL stays under the session it moves.
    path("sessions/<uuid:pk>/migrate/", SessionMigrateView.as_view(), name="session-migrate"),
    *router.urls,
]
