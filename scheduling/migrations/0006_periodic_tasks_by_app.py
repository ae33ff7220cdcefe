"""The audit maintenance task is split by the app whose data it keeps: its beat row gives way to the
rows of ``settings.PERIODIC_TASKS`` (the one declaration, also read by ``beat_schedule_install``).

The new rows take over the retired row's schedule and enabled flag, so a period an operator set in
the admin survives the split.
"""

from django.conf import settings
from django.db import migrations

RETIRED_NAME = "audit maintenance"
RETIRED_TASK = "scheduling.tasks.audit_maintenance"
RETIRED_EVERY_S = 60
# The tasks that replaced it (history, not the schedule: periods and row names are in settings).
SPLIT_INTO = ("gpu.tasks.ledger_accrue", "sessions.tasks.chunk_rollup", "sessions.tasks.chunk_records_prune")
SCHEDULE_FIELDS = ("interval", "crontab", "solar", "clocked")


def split(apps, schema_editor):
    IntervalSchedule = apps.get_model("django_celery_beat", "IntervalSchedule")
    PeriodicTask = apps.get_model("django_celery_beat", "PeriodicTask")
    retired = PeriodicTask.objects.filter(task=RETIRED_TASK).order_by("pk").first()
    for name, entry in settings.PERIODIC_TASKS.items():
        if PeriodicTask.objects.filter(name=name).exists():
            continue
        if retired is not None and entry["task"] in SPLIT_INTO:
            inherited = {field: getattr(retired, field) for field in SCHEDULE_FIELDS}
            PeriodicTask.objects.create(name=name, task=entry["task"], enabled=retired.enabled, **inherited)
        else:
            interval, _ = IntervalSchedule.objects.get_or_create(every=entry["every_s"], period="seconds")
            PeriodicTask.objects.create(name=name, task=entry["task"], interval=interval)
    PeriodicTask.objects.filter(task=RETIRED_TASK).delete()


def unsplit(apps, schema_editor):
    IntervalSchedule = apps.get_model("django_celery_beat", "IntervalSchedule")
    PeriodicTask = apps.get_model("django_celery_beat", "PeriodicTask")
    replacement = PeriodicTask.objects.filter(task__in=SPLIT_INTO).order_by("pk").first()
    if not PeriodicTask.objects.filter(name=RETIRED_NAME).exists():
        if replacement is not None:
            inherited = {field: getattr(replacement, field) for field in SCHEDULE_FIELDS}
            PeriodicTask.objects.create(
                name=RETIRED_NAME, task=RETIRED_TASK, enabled=replacement.enabled, **inherited
            )
        else:
            interval, _ = IntervalSchedule.objects.get_or_create(every=RETIRED_EVERY_S, period="seconds")
            PeriodicTask.objects.create(name=RETIRED_NAME, task=RETIRED_TASK, interval=interval)
    PeriodicTask.objects.filter(task__in=SPLIT_INTO).delete()


class Migration(migrations.Migration):
    dependencies = [
        ("scheduling", "0005_event_vocabulary"),
        ("django_celery_beat", "0019_alter_periodictasks_options"),
    ]

    operations = [migrations.RunPython(split, unsplit)]
