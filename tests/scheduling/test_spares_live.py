"""Boot-aware spares in the live loop (issue 27), on real PostgreSQL and Redis: the decision record
carries the spare rule's inputs and answer, the console shows them, and the setting switches it."""

from __future__ import annotations

import pytest
from django.utils import timezone

from scheduling.console import cluster_snapshot
from scheduling.live.run import scheduler_run
from scheduling.models import ScalingAction, SchedulerConfig, SchedulerDecision
from tests.factories import GpuWorkerFactory, SessionFactory

pytestmark = pytest.mark.django_db


@pytest.fixture
def one_worker_two_users(db):
    SchedulerConfig.objects.update_or_create(pk=1, defaults={"scale_in_cooldown_s": 0.0, "min_gpus": 0})
    # The factory's worker was requested 30 s before it became ready: the measured boot.
    worker = GpuWorkerFactory()
    for _ in range(2):
        SessionFactory(activity="active", last_active_at=timezone.now())
    return worker


def test_off_records_the_headroom_as_before(one_worker_two_users, settings):
    assert settings.STREAMSERVE["SPARE_POLICY"] == "off"
    scheduler_run(trigger="tick")
    record = SchedulerDecision.objects.order_by("pk").last()
    spares = record.inputs["spares"]
    assert spares["policy"] == "off"
    assert spares["delay_source"] == "stated"


def test_boot_aware_spares_are_recorded_with_the_measured_boot_and_scale_out(one_worker_two_users, settings):
    # given boot-aware spares with a floor far above what one worker holds
    settings.STREAMSERVE = {
        **settings.STREAMSERVE,
        "SPARE_POLICY": "boot-aware",
        "SPARE_MARGIN_Z": 1.0,
        "SPARE_MIN_SESSIONS": 50.0,
    }
    # when the scheduler ticks
    scheduler_run(trigger="tick")
    # then its decision carries the rule's inputs: the delay is the pool's measured boot
    record = SchedulerDecision.objects.order_by("pk").last()
    spares = record.inputs["spares"]
    assert spares["policy"] == "boot-aware"
    assert spares["delay_source"] == "predicted"
    assert spares["delay_s"] == pytest.approx(30.0)
    assert spares["margin_z"] == 1.0
    assert spares["target"] == 50.0 and spares["why"].startswith("floor 50")
    # and the pool scales out for the spares
    assert ScalingAction.objects.filter(direction="out").exists()
    # and the console shows the target and why
    details = [item["detail"] for item in cluster_snapshot()["timeline"] if item["kind"] == "decision"]
    assert any("spare target 50.0 (boot-aware: floor 50" in d for d in details)
