"""Writes of the scheduling app that are not part of a scheduler run (see ``scheduling.live``)."""

from __future__ import annotations

from django.conf import settings
from django.db import transaction
from django_celery_beat.models import IntervalSchedule, PeriodicTask

from scheduling.live.enqueue import SCHEDULER_TICK


@transaction.atomic
def beat_schedule_install(*, tick_s: float | None = None) -> None:
    """Make sure the rows of ``settings.PERIODIC_TASKS`` exist; operators edit their periods in the admin.

    ``tick_s`` overrides the tick period (tests and demos use a faster tick).
    """
    for name, entry in settings.PERIODIC_TASKS.items():
        is_tick = entry["task"] == SCHEDULER_TICK
        every = int(tick_s) if (tick_s and is_tick) else entry["every_s"]
        interval, _ = IntervalSchedule.objects.get_or_create(every=every, period=IntervalSchedule.SECONDS)
        periodic, created = PeriodicTask.objects.get_or_create(
            name=name, defaults={"task": entry["task"], "interval": interval}
        )
        if tick_s and not created and periodic.interval_id != interval.pk:
            periodic.interval = interval
            periodic.save(update_fields=["interval"])
