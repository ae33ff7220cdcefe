"""The static provisioner: hands out idle configured workers, refuses the rest, stops nothing."""

from __future__ import annotations

from datetime import timedelta

import pytest
from django.core.exceptions import ImproperlyConfigured

from gpu.models import GpuWorker
from gpu.provisioners import get_provisioner
from gpu.provisioners.static import StaticProvisioner, parse_static_workers
from gpu.services import worker_mark_ready

pytestmark = pytest.mark.django_db
Status = GpuWorker.Status

CONFIGURED = "gpu-a@10.0.0.5:cuda:0/h100,gpu-b@10.0.0.5:cuda:1/h100,cpu-1@localhost:cpu"


def test_parse_static_workers():
    workers = parse_static_workers(CONFIGURED)
    assert [(w.name, w.host, w.device, w.gpu_type, w.device_index) for w in workers] == [
        ("gpu-a", "10.0.0.5", "cuda:0", "h100", 0),
        ("gpu-b", "10.0.0.5", "cuda:1", "h100", 1),
        ("cpu-1", "localhost", "cpu", "cpu", None),
    ]
    assert parse_static_workers("x@h:cuda:3")[0].gpu_type == "cuda"
    for bad, reason in [
        ("gpu-a", "not name@host:device"),
        ("gpu-a@host", "not name@host:device"),
        ("gpu-a@host:tpu:0", "device must be cpu or cuda:N"),
        ("a@h:cpu,a@h:cuda:0", "listed twice: a"),
    ]:
        with pytest.raises(ValueError, match=reason):
            parse_static_workers(bad)


def test_malformed_setting_fails_loudly(settings):
    settings.STREAMSERVE = {**settings.STREAMSERVE, "STATIC_WORKERS": "gpu-a@nowhere"}
    with pytest.raises(ImproperlyConfigured, match="STATIC_WORKERS is malformed"):
        get_provisioner("static")


def test_request_hands_out_idle_configured_workers_of_the_type_and_refuses_the_rest():
    provisioner = StaticProvisioner(workers=CONFIGURED)

    first = provisioner.request(count=3, gpu_type="h100", preset="wan-1.3b")

    assert [r.name for r in first.started] == ["gpu-a", "gpu-b"]
    assert first.shortfall == "2 of 2 static worker(s) of type h100 idle"
    rows = GpuWorker.objects.filter(provider="static").order_by("name")
    assert [(w.name, w.host, w.device, w.device_index, w.status) for w in rows] == [
        ("gpu-a", "10.0.0.5", "cuda:0", 0, Status.PROVISIONING),
        ("gpu-b", "10.0.0.5", "cuda:1", 1, Status.PROVISIONING),
    ]
    assert rows[0].external_id == "gpu-a@10.0.0.5:cuda:0/h100"
    refused = provisioner.request(count=1, gpu_type="h100")
    assert refused.started == [] and refused.shortfall == "0 of 2 static worker(s) of type h100 idle"
    unknown = provisioner.request(count=1, gpu_type="b300")
    assert unknown.started == [] and "no static worker of type b300" in unknown.shortfall
    assert "cpu, h100" in unknown.shortfall
    assert StaticProvisioner(workers="").request(count=1).shortfall.startswith("STATIC_WORKERS is empty")


def test_release_marks_released_and_the_name_can_be_handed_out_again():
    provisioner = StaticProvisioner(workers=CONFIGURED)
    worker = GpuWorker.objects.get(pk=provisioner.request(count=1, gpu_type="cpu").worker_ids[0])
    worker_mark_ready(worker=worker)

    released = provisioner.release(worker)

    assert released.ok and released.detail == "static worker left running (started by hand)"
    worker.refresh_from_db()
    assert worker.status == Status.RELEASED
    again = provisioner.request(count=1, gpu_type="cpu")
    assert [r.name for r in again.started] == ["cpu-1"]
    # The earlier lifecycle keeps its id (ledger, chunks) under an archived name.
    worker.refresh_from_db()
    assert worker.name == f"cpu-1#{worker.pk}" and worker.status == Status.RELEASED
    assert GpuWorker.objects.get(name="cpu-1").status == Status.PROVISIONING


def test_a_static_worker_that_never_comes_up_fails_at_the_timeout_and_another_is_tried():
    provisioner = StaticProvisioner(workers=CONFIGURED, provision_timeout_s=30, max_retries=1)
    worker = GpuWorker.objects.get(pk=provisioner.request(count=1, gpu_type="h100").worker_ids[0])

    result = provisioner.reconcile(worker.requested_at + timedelta(seconds=31))

    assert result.failed[0].worker.name == "gpu-a"
    assert [r.name for r in result.replacements[0].started] == ["gpu-b"]
