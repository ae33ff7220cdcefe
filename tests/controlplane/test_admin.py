from __future__ import annotations

import pytest
from django.test import Client

from gpu.models import GpuWorker
from tests.factories import ChunkRecordFactory, GpuWorkerFactory, SessionFactory

pytestmark = pytest.mark.django_db


@pytest.fixture
def admin_client_(db):
    from django.contrib.auth import get_user_model

    user = get_user_model().objects.create_superuser("root", "root@example.com", "pw-for-tests-1")
    client = Client()
    client.force_login(user)
    return client


def test_every_model_has_a_working_changelist(admin_client_):
    ChunkRecordFactory()
    for url in [
        "/admin/streams/generationsession/",
        "/admin/streams/sessionevent/",
        "/admin/streams/chunkrecord/",
        "/admin/streams/chunklatencyrollup/",
        "/admin/streams/job/",
        "/admin/gpu/gpuworker/",
        "/admin/gpu/costledgerentry/",
        "/admin/scheduling/schedulerdecision/",
        "/admin/scheduling/migration/",
        "/admin/scheduling/scalingaction/",
        "/admin/scheduling/schedulerconfig/",
    ]:
        assert admin_client_.get(url).status_code == 200, url
    assert admin_client_.get("/admin/streams/chunkrecord/add/").status_code == 403  # audit tables read-only


def test_admin_actions_drain_workers_and_terminate_sessions(admin_client_):
    worker = GpuWorkerFactory()
    session = SessionFactory()
    admin_client_.post(
        "/admin/gpu/gpuworker/", {"action": "drain_workers", "_selected_action": [worker.pk]}, follow=True
    )
    worker.refresh_from_db()
    assert worker.status == GpuWorker.Status.DRAINING
    admin_client_.post(
        "/admin/streams/generationsession/",
        {"action": "terminate_sessions", "_selected_action": [session.pk]},
        follow=True,
    )
    session.refresh_from_db()
    assert session.status == "terminated"
    assert session.events.get(kind="depart").detail["reason"] == "admin:root"
