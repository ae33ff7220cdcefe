"""The API against its own OpenAPI schema, fuzzed by schemathesis (bounded examples per operation).

Every operation of ``/api/schema/`` is called in-process (Django's WSGI handler, the test database)
with generated valid and invalid inputs, on generated ids and on ids of existing rows. A response
must never be a server error, must use a documented status code and content type, and must conform
to the documented response schema; a schema-valid request must not be rejected, a schema-invalid one
must not be accepted.
"""

from __future__ import annotations

from datetime import timedelta

import pytest
import schemathesis
from django.conf import settings as django_settings
from django.core.signals import request_finished, request_started
from django.core.wsgi import get_wsgi_application
from django.db import close_old_connections, transaction
from django.test import override_settings
from django.urls import get_resolver
from django.utils import timezone
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis.errors import Unsatisfiable
from rest_framework.authtoken.models import Token
from schemathesis import GenerationMode
from schemathesis.checks import not_a_server_error
from schemathesis.specs.openapi.checks import positive_data_acceptance

from gpu.models import Region
from scheduling.models import Migration, ScalingAction, SchedulerDecision
from sessions.models import Tenant, TenantMembership
from tests.factories import ChunkRecordFactory, GpuWorkerFactory, JobFactory, SessionFactory, StaffFactory

# ~1 min alone on the 2-core box; the bound leaves room for a loaded machine.
pytestmark = [pytest.mark.django_db, pytest.mark.slow, pytest.mark.timeout(900)]

WSGI = get_wsgi_application()
EXAMPLES = 12

# Rules across fields or against other rows, which a JSON schema cannot state: a request that
# satisfies the schema may still be refused with a 400 naming the field, and that is right. (A
# refusal because of the object's current state is a documented 409, which valid data may get.)
CROSS_FIELD_RULES = {
    "PUT /api/scheduler/config/": "min_gpus ≤ max_gpus; policy names a loadable policy class",
    "PATCH /api/scheduler/config/": "min_gpus ≤ max_gpus; policy names a loadable policy class",
    "GET /api/audit/cost/": "start < end; at most 10,000 buckets in the range",
    "GET /api/audit/latency/": "start < end; at most 10,000 buckets in the range",
    "GET /api/audit/jobs/": "start < end; at most 10,000 buckets in the range",
    "GET /api/audit/placements/": "start < end; a range of at most 10,000 days",
    "GET /api/audit/region-moves/": "start < end; at most 10,000 buckets in the range",
    "POST /api/jobs/": "a video has frames, an image none; the model's resolutions; slo_s or a future deadline; "
    "tenant names one the user belongs to",
    "POST /api/sessions/": "origin names an origin some region has an RTT for (Region.rtt_ms); "
    "tenant names one the user belongs to",
    "GET /api/audit/tenants/": "start < end; at most 10,000 buckets in the range",
    "GET /api/tenants/{id}/usage/": "start < end; at most 10,000 buckets in the range",
    "POST /api/tenants/": "name is unique",
    "PUT /api/tenants/{id}/": "name is unique",
    "PATCH /api/tenants/{id}/": "name is unique",
    "POST /api/tenants/{id}/members/": "username names an existing user",
    "DELETE /api/tenants/{id}/members/": "username names a member of the tenant",
    "POST /api/sessions/{id}/migrate/": "target names an existing worker",
    "POST /v1/videos": "size is one of the model's resolutions; seconds make 2..JOB_MAX_FRAMES frames at its fps",
    "POST /v1/images/generations": "size is one of the model's resolutions",
    "GET /v1/videos": "after names one of the user's videos",
}
# Operations whose documented answer here is a server error: no worker runs in this test.
SERVER_ERRORS = {
    "POST /v1/images/generations": "504: the images are not ready within OPENAI_IMAGES_TIMEOUT_S",
}


@pytest.fixture
def existing(db) -> dict[str, str]:
    """One row behind each kind of path id, owned by the staff user who calls the API."""
    staff = StaffFactory()
    worker, other = GpuWorkerFactory(), GpuWorkerFactory()
    session = SessionFactory(owner=staff, worker=worker, status="executing", state_location="worker")
    ChunkRecordFactory(session=session, worker=worker)
    now = timezone.now()
    decision = SchedulerDecision.objects.create(
        trigger="tick", decided_at=now, policy="turboserve", active_sessions=1, budget=2, target_budget=2,
        duration_ms=0.3,
    )  # fmt: skip
    migration = Migration.objects.create(
        session=session,
        source=worker,
        target=other,
        reason="rebalance",
        started_at=now - timedelta(seconds=1),
    )
    action = ScalingAction.objects.create(
        created_at=now, direction="out", from_budget=1, to_budget=2, reason="load", decision=decision
    )
    job = JobFactory(owner=staff)
    tenant = Tenant.objects.create(name="vision")
    TenantMembership.objects.create(tenant=tenant, user=staff, is_default=True)
    return {
        "token": Token.objects.create(user=staff).key,
        "/api/jobs/": str(job.pk),
        "/api/tenants/": str(tenant.pk),
        "/api/sessions/": str(session.pk),
        "/api/workers/": str(worker.pk),
        "/api/decisions/": str(decision.pk),
        "/api/migrations/": str(migration.pk),
        "/api/scaling-actions/": str(action.pk),
        "/api/regions/": str(Region.objects.create(name="east", rtt_ms={"nyc": 3.0}).pk),
    }


@pytest.fixture
def in_process_api(existing):
    # As Django's test client does: a request must not close the test's connection (its transaction
    # is rolled back after the test).
    request_started.disconnect(close_old_connections)
    request_finished.disconnect(close_old_connections)
    # Every view is imported before the override below: a view class takes DRF's throttle classes
    # when it is defined, so one first imported under the override would stay unthrottled for the
    # rest of the run (found by the OpenAI API's throttle test running after this one).
    get_resolver().url_patterns  # noqa: B018
    try:
        # Throttling is tested on its own; here it would only turn later examples into 429s. An image
        # request waits for its images: not long, since nothing makes them here.
        with override_settings(
            REST_FRAMEWORK={**django_settings.REST_FRAMEWORK, "DEFAULT_THROTTLE_CLASSES": []},
            STREAMSERVE={**django_settings.STREAMSERVE, "OPENAI_IMAGES_TIMEOUT_S": 0.01},
        ):
            yield schemathesis.openapi.from_wsgi(
                "/api/schema/", WSGI, headers={"Authorization": f"Token {existing['token']}"}
            )
    finally:
        request_started.connect(close_old_connections)
        request_finished.connect(close_old_connections)


def _known_id(path: str, existing: dict[str, str]) -> dict[str, str] | None:
    if "{id}" not in path:
        return None
    return {"id": next(value for prefix, value in existing.items() if path.startswith(prefix))}


def fuzz(operation, *, mode, path_parameters, headers, excluded) -> None:
    """Up to EXAMPLES generated calls of one operation; raises schemathesis' failures."""

    @given(case=operation.as_strategy(generation_mode=mode, path_parameters=path_parameters))
    @settings(
        max_examples=EXAMPLES,
        deadline=None,
        phases=[Phase.generate],
        suppress_health_check=list(HealthCheck),
        database=None,
    )
    def call(case):
        # A savepoint per request: one failed statement must not poison the next ones.
        with transaction.atomic():
            case.call_and_validate(headers=headers, excluded_checks=excluded)

    call()


def test_api_conforms_to_its_schema(in_process_api, existing):
    headers = {"Authorization": f"Token {existing['token']}"}
    failures: dict[str, str] = {}
    for result in in_process_api.get_all_operations():
        operation = result.ok()
        excluded = [positive_data_acceptance] if operation.label in CROSS_FIELD_RULES else []
        if operation.label in SERVER_ERRORS:
            excluded.append(not_a_server_error)
        known = _known_id(operation.path, existing)
        for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE):
            for path_parameters in [None, known] if known else [None]:
                label = f"{operation.label} [{mode.value}{', existing id' if path_parameters else ''}]"
                try:
                    fuzz(
                        operation,
                        mode=mode,
                        path_parameters=path_parameters,
                        headers=headers,
                        excluded=excluded,
                    )
                except Unsatisfiable:
                    continue  # no invalid request exists for an operation without inputs
                except (AssertionError, BaseExceptionGroup) as exc:  # schemathesis failures
                    failures[label] = str(exc)
    assert not failures, "\n\n".join(f"{label}:\n{error}" for label, error in failures.items())
