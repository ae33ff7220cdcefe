from __future__ import annotations

import pytest
from rest_framework.authtoken.models import Token
from rest_framework.test import APIClient

from sessions.models import GenerationSession, SessionEvent
from tests.factories import ChunkRecordFactory, GpuWorkerFactory, SessionFactory

pytestmark = pytest.mark.django_db


def create(client, **overrides):
    body = {"prompt": "a lighthouse at dusk", "model": "tiny", "resolution": "64x64", "seed": 7, **overrides}
    return client.post("/api/sessions/", body, format="json")


def test_create_records_session_prompt_and_arrive_active_events(user_api, user):
    response = create(user_api)
    assert response.status_code == 201, response.content
    body = response.json()
    assert body["status"] == "queued"
    assert body["activity"] == "active"
    assert body["prompt"] == "a lighthouse at dusk"
    assert (body["width"], body["height"], body["fps"], body["seed"]) == (64, 64, 8, 7)
    session = GenerationSession.objects.get(pk=body["id"])
    assert session.owner == user
    assert list(session.events.values_list("kind", flat=True)) == ["arrive", "active"]
    assert session.prompts.get().from_chunk == 0


def test_seed_defaults_to_a_random_value(user_api):
    response = create(user_api, seed=None)
    assert response.status_code == 400  # explicit null is not an integer
    body = {"prompt": "x", "model": "tiny"}
    response = user_api.post("/api/sessions/", body, format="json")
    assert response.status_code == 201
    assert isinstance(response.json()["seed"], int)
    assert response.json()["resolution"] == "64x64"  # the preset's default


@pytest.mark.parametrize(
    ("overrides", "field", "reason"),
    [
        ({"model": "sora-9"}, "model", "not a valid choice"),
        ({"resolution": "1920x1080"}, "resolution", "not supported"),
        ({"resolution": "wide"}, "resolution", "WIDTHxHEIGHT"),
        ({"prompt": "   "}, "prompt", "must not be empty"),
        ({"prompt": "x" * 2001}, "prompt", "at most 2000"),
        ({"seed": -1}, "seed", "greater than or equal to 0"),
        ({"seed": "abc"}, "seed", "valid integer"),
    ],
)
def test_create_rejects_bad_input_with_field_and_reason(user_api, overrides, field, reason):
    response = create(user_api, **overrides)
    assert response.status_code == 400
    errors = response.json()
    assert field in errors, errors
    assert reason in str(errors[field])
    assert GenerationSession.objects.count() == 0


def test_anonymous_requests_get_401(api):
    session = SessionFactory()
    for method, url in [
        ("get", "/api/sessions/"),
        ("post", "/api/sessions/"),
        ("get", f"/api/sessions/{session.pk}/"),
        ("post", f"/api/sessions/{session.pk}/terminate/"),
        ("get", "/api/workers/"),
        ("get", "/api/audit/cost/"),
    ]:
        assert getattr(api, method)(url).status_code == 401, url


def test_token_authentication_works_for_integrators(user):
    token = Token.objects.create(user=user)
    client = APIClient()
    client.credentials(HTTP_AUTHORIZATION=f"Token {token.key}")
    assert create(client).status_code == 201
    assert client.get("/api/sessions/").json()["count"] == 1


def test_session_authentication_works_for_the_browser(user):
    client = APIClient(enforce_csrf_checks=True)
    assert client.login(username=user.username, password="pw-for-tests-1")
    assert client.get("/api/sessions/").status_code == 200
    # Writes from a browser session need the CSRF token, as any form would.
    assert create(client).status_code == 403


def test_users_see_only_their_own_sessions_and_staff_see_all(user_api, staff_api, user, other_user):
    mine = SessionFactory(owner=user)
    theirs = SessionFactory(owner=other_user)
    listed = {s["id"] for s in user_api.get("/api/sessions/").json()["results"]}
    assert listed == {str(mine.pk)}
    assert user_api.get(f"/api/sessions/{theirs.pk}/").status_code == 404
    staff_listed = {s["id"] for s in staff_api.get("/api/sessions/").json()["results"]}
    assert staff_listed == {str(mine.pk), str(theirs.pk)}


@pytest.mark.parametrize(
    ("method", "suffix", "body"),
    [
        ("get", "", None),
        ("get", "prompts/", None),
        ("post", "prompts/", {"text": "hijack"}),
        ("post", "pause/", None),
        ("post", "resume/", None),
        ("post", "terminate/", None),
        ("get", "chunks/", None),
        ("get", "events/", None),
    ],
)
def test_cross_user_access_is_404_on_every_session_endpoint(user_api, other_user, method, suffix, body):
    theirs = SessionFactory(owner=other_user)
    response = getattr(user_api, method)(f"/api/sessions/{theirs.pk}/{suffix}", body, format="json")
    assert response.status_code == 404
    theirs.refresh_from_db()
    assert theirs.status == "queued" and theirs.prompts.count() == 1 and theirs.events.count() == 0


def test_prompt_applies_from_the_next_chunk(user_api, user):
    session = SessionFactory(owner=user, chunks_generated=5)
    response = user_api.post(f"/api/sessions/{session.pk}/prompts/", {"text": "now it rains"}, format="json")
    assert response.status_code == 201
    assert response.json()["from_chunk"] == 5
    assert session.prompt_at(4).text == "a red fox in the snow"
    assert session.prompt_at(5).text == "now it rains"
    history = user_api.get(f"/api/sessions/{session.pk}/prompts/").json()
    assert [p["text"] for p in history] == ["a red fox in the snow", "now it rains"]
    assert session.events.filter(kind=SessionEvent.Kind.PROMPT).count() == 1


def test_prompt_on_terminated_session_is_409(user_api, user):
    session = SessionFactory(owner=user)
    user_api.post(f"/api/sessions/{session.pk}/terminate/")
    response = user_api.post(f"/api/sessions/{session.pk}/prompts/", {"text": "too late"}, format="json")
    assert response.status_code == 409
    assert "terminated" in response.json()["detail"]
    assert session.prompts.count() == 1


def test_pause_resume_are_idempotent_and_record_events_once(user_api, user):
    session = SessionFactory(owner=user, activity="active")
    for _ in range(2):
        assert user_api.post(f"/api/sessions/{session.pk}/pause/").json()["activity"] == "idle"
    for _ in range(2):
        assert user_api.post(f"/api/sessions/{session.pk}/resume/").json()["activity"] == "active"
    assert list(session.events.values_list("kind", flat=True)) == ["idle", "active"]


def test_terminate_is_idempotent_and_frees_the_worker(user_api, user):
    worker = GpuWorkerFactory()
    session = SessionFactory(owner=user, status="executing", worker=worker, state_location="worker")
    first = user_api.post(f"/api/sessions/{session.pk}/terminate/")
    second = user_api.post(f"/api/sessions/{session.pk}/terminate/")
    assert first.status_code == second.status_code == 200
    assert first.json()["status"] == "terminated" and first.json()["worker"] is None
    assert second.json()["terminated_at"] == first.json()["terminated_at"]
    depart = session.events.get(kind="depart")
    assert depart.detail["held_by"] == [worker.name]
    assert user_api.post(f"/api/sessions/{session.pk}/pause/").status_code == 409


def test_chunk_records_are_listed_in_order_and_filterable(user_api, user):
    session = SessionFactory(owner=user)
    worker = GpuWorkerFactory()
    for index in (2, 0, 1):
        ChunkRecordFactory(session=session, chunk_index=index, worker=worker, batch_size=index + 1)
    body = user_api.get(f"/api/sessions/{session.pk}/chunks/").json()
    assert [c["chunk_index"] for c in body["results"]] == [0, 1, 2]
    assert body["results"][0]["worker"] == worker.name
    filtered = user_api.get(f"/api/sessions/{session.pk}/chunks/?since_index=1").json()
    assert [c["chunk_index"] for c in filtered["results"]] == [1, 2]
    # indices and batch sizes are whole numbers: a fraction is a 400 naming the parameter
    for param in ("since_index", "batch_size"):
        refused = user_api.get(f"/api/sessions/{session.pk}/chunks/?{param}=0.6")
        assert refused.status_code == 400 and param in refused.json()


def test_list_filters_ordering_and_pagination(user_api, user):
    for i in range(3):
        SessionFactory(owner=user, chunks_generated=i)
    SessionFactory(owner=user, status="terminated", terminated_at="2026-01-01T00:00:00Z")
    assert user_api.get("/api/sessions/?status=terminated").json()["count"] == 1
    ordered = user_api.get("/api/sessions/?ordering=-chunks_generated&status=queued").json()["results"]
    assert [s["chunks_generated"] for s in ordered] == [2, 1, 0]
    page = user_api.get("/api/sessions/?limit=2&offset=0").json()
    assert page["count"] == 4 and len(page["results"]) == 2 and page["next"]
    assert user_api.get("/api/sessions/?ordering=nonsense").status_code == 200  # unknown fields ignored


def test_model_catalog_lists_presets(user_api):
    names = {m["name"] for m in user_api.get("/api/models/").json()}
    assert {"tiny", "small", "wan-1.3b"} <= names


def test_openapi_schema_and_docs_are_served(user_api):
    schema = user_api.get("/api/schema/")
    assert schema.status_code == 200
    assert b"/api/sessions/{id}/terminate/" in schema.content
    assert user_api.get("/api/docs/").status_code == 200
