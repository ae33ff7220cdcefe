"""An action the object's current state refuses is a 409 in the API's error shape (``{"detail"}``),
documented in the schema; bad input stays a 400 naming the field."""

from __future__ import annotations

import pytest
from django.utils import timezone

from gpu.models import GpuWorker
from scheduling.models import Migration
from sessions.models import SessionEvent
from tests.factories import GpuWorkerFactory, SessionFactory

pytestmark = pytest.mark.django_db


@pytest.fixture
def terminated(user, user_api):
    session = SessionFactory(owner=user)
    assert user_api.post(f"/api/sessions/{session.pk}/terminate/").json()["status"] == "terminated"
    return session


@pytest.mark.parametrize("action", ["pause", "resume"])
def test_pausing_or_resuming_a_terminated_session_is_a_409(user_api, terminated, action):
    events = terminated.events.count()

    response = user_api.post(f"/api/sessions/{terminated.pk}/{action}/")

    assert response.status_code == 409
    assert response.json() == {"detail": "the session is terminated; start a new session"}
    assert terminated.events.count() == events


def test_a_prompt_for_a_terminated_session_is_a_409_and_bad_text_still_a_400(user_api, terminated):
    late = user_api.post(f"/api/sessions/{terminated.pk}/prompts/", {"text": "too late"}, format="json")
    assert late.status_code == 409 and "terminated" in late.json()["detail"]
    assert terminated.prompts.count() == 1
    assert not terminated.events.filter(kind=SessionEvent.Kind.PROMPT).exists()

    # Input is checked first: an empty prompt is the text's fault whatever the session's state.
    empty = user_api.post(f"/api/sessions/{terminated.pk}/prompts/", {"text": ""}, format="json")
    assert empty.status_code == 400 and "text" in empty.json()


@pytest.mark.parametrize("status", [GpuWorker.Status.RELEASED, GpuWorker.Status.PROVISIONING])
def test_draining_a_worker_that_is_not_ready_is_a_409(staff_api, status):
    worker = GpuWorkerFactory(
        status=status,
        ready_at=None if status == GpuWorker.Status.PROVISIONING else timezone.now(),
        released_at=timezone.now() if status == GpuWorker.Status.RELEASED else None,
    )

    response = staff_api.post(f"/api/workers/{worker.pk}/drain/")

    assert response.status_code == 409
    assert status in response.json()["detail"]
    worker.refresh_from_db()
    assert worker.status == status


def test_a_migration_to_a_worker_that_cannot_take_it_is_a_409_and_an_unknown_one_a_400(staff_api):
    source = GpuWorkerFactory(gpu_type="cpu")
    draining = GpuWorkerFactory(gpu_type="cpu", status=GpuWorker.Status.DRAINING)
    session = SessionFactory(status="executing", worker=source, state_location="worker")
    url = f"/api/sessions/{session.pk}/migrate/"

    unknown = staff_api.post(url, {"target": "nobody"}, format="json")
    assert unknown.status_code == 400 and "no worker is named 'nobody'" in unknown.json()["target"][0]

    not_ready = staff_api.post(url, {"target": draining.name}, format="json")
    assert not_ready.status_code == 409 and "not a ready worker" in not_ready.json()["detail"]

    own = staff_api.post(url, {"target": source.name}, format="json")
    assert own.status_code == 409 and "already runs on" in own.json()["detail"]

    queued = SessionFactory(status="queued", queue_position=1)
    target = GpuWorkerFactory(gpu_type="cpu")
    idle = staff_api.post(f"/api/sessions/{queued.pk}/migrate/", {"target": target.name}, format="json")
    assert idle.status_code == 409 and "only executing sessions migrate" in idle.json()["detail"]
    assert not Migration.objects.exists()


@pytest.mark.parametrize(
    ("path", "method"),
    [
        ("/api/sessions/{id}/pause/", "post"),
        ("/api/sessions/{id}/resume/", "post"),
        ("/api/sessions/{id}/prompts/", "post"),
        ("/api/workers/{id}/drain/", "post"),
        ("/api/sessions/{id}/migrate/", "post"),
    ],
)
def test_the_schema_documents_each_409_with_the_error_shape(user_api, path, method):
    schema = user_api.get("/api/schema/", HTTP_ACCEPT="application/vnd.oai.openapi+json").json()

    conflict = schema["paths"][path][method]["responses"]["409"]

    assert conflict["description"].startswith("State conflict: ")
    assert conflict["content"]["application/json"]["schema"] == {"$ref": "#/components/schemas/Error"}


def test_actions_that_no_state_refuses_document_no_409(user_api):
    schema = user_api.get("/api/schema/", HTTP_ACCEPT="application/vnd.oai.openapi+json").json()

    # terminate and cancel are idempotent: an ended session or job answers 200 as it is.
    assert "409" not in schema["paths"]["/api/sessions/{id}/terminate/"]["post"]["responses"]
    assert "409" not in schema["paths"]["/api/jobs/{id}/cancel/"]["post"]["responses"]
