"""API inputs the database cannot store are 400s naming the field; per-user limits; exposure settings."""

from __future__ import annotations

import importlib
from datetime import timedelta

import pytest
from django.core.cache import cache
from django.test import Client
from django.urls import clear_url_caches
from django.utils import timezone
from rest_framework.throttling import UserRateThrottle

import controlplane.urls
import scheduling.urls
from scheduling.models import Migration, ScalingAction, SchedulerConfig, SchedulerDecision
from tests.factories import GpuWorkerFactory, SessionFactory

pytestmark = pytest.mark.django_db

# PostgreSQL stores UTC displacements up to ±15:59; ISO-8601 allows up to ±23:59.
FAR_OFFSET = "2026-01-01T00:00:00+16:00"


def test_far_utc_offsets_filter_sessions_instead_of_a_500(user_api, user):
    """Defect 4: `?created_after=…+16:00` was a 500 DataError on every session endpoint."""
    session = SessionFactory(owner=user)
    session.created_at = timezone.now()
    session.save(update_fields=["created_at"])
    listed = user_api.get("/api/sessions/", {"created_after": FAR_OFFSET})
    assert listed.status_code == 200 and listed.json()["count"] == 1
    before = user_api.get("/api/sessions/", {"created_before": "2026-01-01T00:00:00-23:59"})
    assert before.status_code == 200 and before.json()["count"] == 0
    # The list filters do not apply to one session's routes: its detail is not a 404 either.
    for route in ("", "events/", "chunks/", "prompts/"):
        response = user_api.get(f"/api/sessions/{session.pk}/{route}", {"created_after": FAR_OFFSET})
        assert response.status_code == 200, (route, response.content)


@pytest.mark.parametrize(
    ("value", "count"),
    [
        ("0001-01-01T00:00:00+05:00", 1),  # before year 1 in UTC: clamped, everything is after it
        ("9999-12-31T23:00:00-05:00", 0),  # after year 9999 in UTC: clamped, nothing is after it
    ],
)
def test_instants_beyond_the_representable_years_are_clamped(user_api, user, value, count):
    SessionFactory(owner=user)
    response = user_api.get("/api/sessions/", {"created_after": value})
    assert response.status_code == 200 and response.json()["count"] == count


def test_history_time_windows_accept_any_offset(staff_api):
    now = timezone.now()
    decision = SchedulerDecision.objects.create(
        trigger="tick", decided_at=now, policy="turboserve", active_sessions=0, budget=1, target_budget=1,
        duration_ms=0.1,
    )  # fmt: skip
    a, b = GpuWorkerFactory(), GpuWorkerFactory()
    Migration.objects.create(session=SessionFactory(), source=a, target=b, reason="rebalance", started_at=now)
    ScalingAction.objects.create(created_at=now, direction="out", from_budget=1, to_budget=2, reason="load")
    for url in ("/api/decisions/", "/api/migrations/", "/api/scaling-actions/"):
        after = staff_api.get(url, {"after": (now - timedelta(hours=20)).strftime("%Y-%m-%dT%H:%M:%S+23:30")})
        assert after.status_code == 200 and after.json()["count"] == 1, (url, after.content)
        before = staff_api.get(url, {"before": "2000-01-01T00:00:00-18:00"})
        assert before.status_code == 200 and before.json()["count"] == 0
    assert decision.pk


@pytest.mark.parametrize("url", ["/api/audit/cost/", "/api/audit/latency/"])
def test_audit_ranges_accept_far_offsets_and_refuse_bad_input_by_name(staff_api, url):
    ok = staff_api.get(url, {"start": "2026-01-01T00:00:00+16:00", "end": "2026-01-01T06:00:00-16:00"})
    assert ok.status_code == 200, ok.content
    for params, field in [
        ({"end": ""}, "end"),
        ({"start": "2026-13-01T00:00:00Z"}, "start"),
        ({"start": "2026-01-01T00:00:00+24:00"}, "start"),
        ({"format": "xml"}, "format"),
    ]:
        bad = staff_api.get(url, params)
        assert bad.status_code == 400 and field in bad.json(), (params, bad.content)


@pytest.mark.parametrize(
    ("params", "field"),
    [
        ({"limit": "abc"}, "limit"),
        ({"limit": "0"}, "limit"),
        ({"limit": "100000"}, "limit"),
        ({"offset": "-1"}, "offset"),
        ({"offset": str(2**63)}, "offset"),
        ({"status": ""}, "status"),
        ({"status": "dancing"}, "status"),
        ({"owner": "nul\x00byte"}, "owner"),
        ({"created_after": "yesterday"}, "created_after"),
    ],
)
def test_malformed_list_parameters_are_a_400_naming_them(user_api, params, field):
    response = user_api.get("/api/sessions/", params)
    assert response.status_code == 400 and field in response.json(), response.content


@pytest.mark.parametrize(
    ("changes", "field"),
    [
        ({"slo_ms": 7.1e16}, "slo_ms"),  # the value schemathesis found accepted
        ({"slo_ms": 0}, "slo_ms"),
        ({"max_gpus": 2**31 - 1}, "max_gpus"),
        ({"queue_max": 10**9}, "queue_max"),
        ({"scale_in_cooldown_s": -1}, "scale_in_cooldown_s"),
        ({"scale_in_cooldown_s": 1e12}, "scale_in_cooldown_s"),
        ({"target_utilization": 0}, "target_utilization"),
        ({"policy": 5}, "policy"),
    ],
)
def test_scheduler_config_fields_are_bounded(staff_api, changes, field):
    response = staff_api.patch("/api/scheduler/config/", changes)
    assert response.status_code == 400 and field in response.json(), response.content
    assert SchedulerConfig.load().slo_ms == 1000.0


def test_prompts_the_database_cannot_store_are_a_400_naming_the_field(user_api, user):
    session = SessionFactory(owner=user)
    # JSON as a client may write it: "\ud800" is a lone surrogate once decoded.
    for text in ("snow\\u0000fall", "snow \\ud800 fall"):
        response = user_api.post(
            f"/api/sessions/{session.pk}/prompts/", f'{{"text": "{text}"}}', content_type="application/json"
        )
        assert response.status_code == 400 and "text" in response.json(), response.content
        created = user_api.post(
            "/api/sessions/", f'{{"prompt": "{text}", "model": "tiny"}}', content_type="application/json"
        )
        assert created.status_code == 400 and "prompt" in created.json(), created.content


def test_unknown_api_urls_answer_json_not_a_debug_page(user_api):
    response = user_api.get("/api/decisions/1.5/")
    assert response.status_code == 404 and response["Content-Type"] == "application/json"


def test_the_model_catalogue_is_a_list(user_api):
    body = user_api.get("/api/models/").json()
    assert isinstance(body, list) and body[0]["name"] and body[0]["resolutions"]


def test_live_sessions_per_user_are_limited(user_api, user, settings):
    settings.STREAMSERVE = {**settings.STREAMSERVE, "MAX_LIVE_SESSIONS_PER_USER": 2}
    SessionFactory(owner=user, status="terminated", terminated_at=timezone.now())  # ended: not counted
    for _ in range(2):
        assert user_api.post("/api/sessions/", {"prompt": "a fox", "model": "tiny"}).status_code == 201
    refused = user_api.post("/api/sessions/", {"prompt": "a third fox", "model": "tiny"})
    assert refused.status_code == 429 and "limit is 2" in refused.json()["detail"]


def test_api_requests_are_throttled_per_user(user_api, settings):
    cache.clear()
    settings.REST_FRAMEWORK = {
        **settings.REST_FRAMEWORK,
        "DEFAULT_THROTTLE_RATES": {"user": "3/minute", "anon": "3/minute"},
    }
    # DRF reads its rates when the throttle class is defined.
    settings_rates = UserRateThrottle.THROTTLE_RATES
    UserRateThrottle.THROTTLE_RATES = settings.REST_FRAMEWORK["DEFAULT_THROTTLE_RATES"]
    try:
        codes = [user_api.get("/api/models/").status_code for _ in range(4)]
    finally:
        UserRateThrottle.THROTTLE_RATES = settings_rates
        cache.clear()
    assert codes == [200, 200, 200, 429]


@pytest.fixture
def reload_urls():
    yield
    clear_url_caches()


def _urls_with(settings, **overrides):
    """The URL modules read the exposure settings when imported: import them again under them."""
    for name, value in overrides.items():
        setattr(settings, name, value)
    importlib.reload(scheduling.urls)
    importlib.reload(controlplane.urls)
    clear_url_caches()


def test_schema_needs_a_login_by_default_and_can_be_public_or_off(user_api, settings, reload_urls):
    assert Client().get("/api/schema/").status_code in (401, 403)
    assert user_api.get("/api/schema/").status_code == 200
    try:
        _urls_with(settings, API_SCHEMA_ACCESS="off")
        assert user_api.get("/api/schema/").status_code == 404
        assert user_api.get("/api/docs/").status_code == 404
    finally:
        _urls_with(settings, API_SCHEMA_ACCESS="authenticated")


def test_metrics_can_be_switched_off(settings, reload_urls):
    assert Client().get("/metrics").status_code == 200
    try:
        _urls_with(settings, STREAMSERVE={**settings.STREAMSERVE, "METRICS_ENABLED": False})
        assert Client().get("/metrics").status_code == 404
    finally:
        _urls_with(settings, STREAMSERVE={**settings.STREAMSERVE, "METRICS_ENABLED": True})
