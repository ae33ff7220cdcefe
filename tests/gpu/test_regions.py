"""Regions in PostgreSQL: the default region, validation of limits and RTTs, the read API."""

from __future__ import annotations

import pytest
from django.core.exceptions import ValidationError

from gpu.models import GpuWorker, Region
from gpu.provisioners.registry import provisioner_for, provisioners_by_backend
from tests.factories import GpuWorkerFactory


@pytest.mark.django_db
def test_the_local_region_needs_no_row(user_api):
    # given a migrated database and a worker without a region
    GpuWorkerFactory(status=GpuWorker.Status.READY)
    # then no region row is required, and none is listed until an operator adds one
    assert not Region.objects.exists()
    assert user_api.get("/api/regions/").json()["results"] == []


@pytest.mark.django_db
@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("gpu_limits", {"H100": -1}),
        ("gpu_limits", {"H100": 1.5}),
        ("gpu_limits", ["H100"]),
        ("rtt_ms", {"nyc": -3}),
        ("rtt_ms", {"nyc": "fast"}),
        ("rtt_ms", {"": 3}),
        ("provisioner", "gpu-cloud"),
    ],
)
def test_region_validation_names_the_field(field, value):
    # given a region with one malformed JSON field
    region = Region(name="bad", **{field: value})
    # when it is validated, then the error names that field
    with pytest.raises(ValidationError) as info:
        region.full_clean()
    assert field in info.value.message_dict


@pytest.mark.django_db
def test_regions_api_lists_regions_with_live_workers(user_api, api):
    # given the local region's row, a second region with one live and one released worker, and a
    # live worker without a region (in the local region)
    Region.objects.create(name=Region.DEFAULT_NAME)
    east = Region.objects.create(name="east", price_multiplier=1.2, gpu_limits={"H100": 8}, rtt_ms={"nyc": 3})
    GpuWorkerFactory(region=east, status=GpuWorker.Status.PROVISIONING)
    GpuWorkerFactory(region=east, status=GpuWorker.Status.FAILED)
    GpuWorkerFactory(status=GpuWorker.Status.READY)
    # when a signed-in user reads the regions
    response = user_api.get("/api/regions/")
    # then both regions are listed with their data, east counts its live worker only and the local
    # region counts the worker without a region
    assert response.status_code == 200
    rows = {r["name"]: r for r in response.json()["results"]}
    assert set(rows) == {"east", "local"}
    assert rows["local"]["workers"] == 1
    assert rows["east"] == {
        "id": east.id,
        "name": "east",
        "price_multiplier": 1.2,
        "gpu_limits": {"H100": 8},
        "rtt_ms": {"nyc": 3.0},
        "provisioner": "",
        "workers": 1,
    }
    # and an anonymous client is refused
    assert api.get("/api/regions/").status_code in (401, 403)


@pytest.mark.django_db
def test_each_backend_in_use_serves_the_regions_that_name_it(settings):
    # given the local backend by setting, one region naming no backend, one naming static and one
    # naming local explicitly
    settings.STREAMSERVE = {**settings.STREAMSERVE, "PROVISIONER": "local", "STATIC_WORKERS": ""}
    plain = Region.objects.create(name="plain")
    hand = Region.objects.create(name="hand", provisioner="static")
    named = Region.objects.create(name="named", provisioner="local")
    Region(name="ok", provisioner="static").full_clean()
    # then scale-out asks each region's backend, the setting's for the local region (no row)
    assert [provisioner_for(r).name for r in (None, plain, hand, named)] == [
        "local",
        "local",
        "static",
        "local",
    ]
    # and the tick gets one provisioner per backend, scoped to the regions that name it
    scopes = {p.name: p.regions for p in provisioners_by_backend()}
    assert scopes == {"local": {None, plain.pk, named.pk}, "static": {hand.pk}}
