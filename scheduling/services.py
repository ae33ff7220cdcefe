"""Writes of the scheduling app that are not part of a scheduler run (see ``scheduling.live``)."""

from __future__ import annotations

from django.db import transaction

# Periodic tasks: (name, task, seconds). The tick detects lost workers within a few heartbeats,
# reconciles the provisioner and rebalances/autoscales on fresh state.
BEAT_SCHEDULE = (
    ("scheduler tick", "scheduling.tasks.scheduler_tick", 2),
    ("audit maintenance", "scheduling.tasks.audit_maintenance", 60),
)


@transaction.atomic
def beat_schedule_install(*, tick_s: float | None = None) -> None:
    """Make sure the beat rows exist (django-celery-beat); operators edit their periods in the admin.

    ``tick_s`` overrides the tick period (tests and demos use a faster tick).
    """
    from django_celery_beat.models import IntervalSchedule, PeriodicTask

    for name, task, seconds in BEAT_SCHEDULE:
        every = int(tick_s) if (tick_s and task.endswith("scheduler_tick")) else seconds
        interval, _ = IntervalSchedule.objects.get_or_create(every=every, period=IntervalSchedule.SECONDS)
        periodic, created = PeriodicTask.objects.get_or_create(
            name=name, defaults={"task": task, "interval": interval}
        )
        if tick_s and not created and periodic.interval_id != interval.pk:
            periodic.interval = interval
            periodic.save(update_fields=["interval"])
