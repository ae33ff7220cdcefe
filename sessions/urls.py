from __future__ import annotations

from django.urls import path

from sessions import views

urlpatterns = [
    path("", views.generate, name="generate"),
    path("jobs/", views.jobs_page, name="jobs"),
]
