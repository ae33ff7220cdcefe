"""A session carries its user origin (body field or the ORIGIN_HEADER header) and its region."""

from __future__ import annotations

import pytest

from gpu.models import Region
from sessions.models import GenerationSession

pytestmark = pytest.mark.django_db

BODY = {"prompt": "a lighthouse at dusk", "model": "tiny", "resolution": "64x64"}


@pytest.fixture
def regions(db):
    Region.objects.create(name="east", rtt_ms={"nyc": 3, "sfo": 70})
    Region.objects.create(name="west", rtt_ms={"nyc": 70, "sfo": 3})


def test_origin_from_body_is_stored_and_shown(user_api, regions):
    # given known origins, when a session is created with an origin in the body
    response = user_api.post("/api/sessions/", {**BODY, "origin": "sfo"}, format="json")
    # then it is stored, and shown with the region (not routed yet: null)
    assert response.status_code == 201, response.content
    assert (response.json()["origin"], response.json()["region"]) == ("sfo", None)
    assert GenerationSession.objects.get().origin == "sfo"


def test_origin_from_the_configured_header(user_api, regions, settings):
    # given a deployment whose proxy sets X-Edge-Origin
    settings.STREAMSERVE = {**settings.STREAMSERVE, "ORIGIN_HEADER": "X-Edge-Origin"}
    # when the body has no origin but the header does
    response = user_api.post("/api/sessions/", BODY, format="json", HTTP_X_EDGE_ORIGIN="nyc")
    # then the header's origin is the session's
    assert response.status_code == 201, response.content
    assert response.json()["origin"] == "nyc"


@pytest.mark.parametrize("via", ["body", "header"])
def test_unknown_origin_is_a_400_naming_the_field(user_api, regions, via):
    # when the origin is one no region has an RTT for
    extra = {"HTTP_X_STREAMSERVE_ORIGIN": "mars"} if via == "header" else {}
    body = {**BODY, "origin": "mars"} if via == "body" else BODY
    response = user_api.post("/api/sessions/", body, format="json", **extra)
    # then nothing is created and the error names the field and the known origins
    assert response.status_code == 400
    assert "origin" in response.json()
    assert "nyc, sfo" in str(response.json()["origin"])
    assert GenerationSession.objects.count() == 0


def test_no_origin_stays_empty(user_api):
    response = user_api.post("/api/sessions/", BODY, format="json")
    assert response.status_code == 201
    assert response.json()["origin"] == ""
