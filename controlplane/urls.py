from __future__ import annotations

from django.conf import settings
from django.contrib import admin
from django.urls import include, path
from drf_spectacular.views import SpectacularAPIView, SpectacularSwaggerView

# settings.API_SCHEMA_ACCESS: "off" serves neither the schema nor its docs page; otherwise the
# schema view's permission (SPECTACULAR_SETTINGS["SERVE_PERMISSIONS"]) says who may read them.
schema_urls = (
    []
    if settings.API_SCHEMA_ACCESS == "off"
    else [
        path("api/schema/", SpectacularAPIView.as_view(), name="schema"),
        path("api/docs/", SpectacularSwaggerView.as_view(url_name="schema"), name="api-docs"),
    ]
)

handler404 = "contracts.http.api.page_not_found"
handler500 = "contracts.http.api.server_error"

urlpatterns = [
    path("admin/", admin.site.urls),
    path("accounts/", include("django.contrib.auth.urls")),
    *schema_urls,
    path("api/", include("controlplane.api_urls")),
    # OpenAI's Images and Videos API over the one-shot jobs (docs/openai.md).
    path("v1/", include("sessions.openai.urls")),
    path("", include("sessions.urls")),
    path("", include("scheduling.urls")),  # the operator console and /metrics
]
