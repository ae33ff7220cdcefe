"""Seed the beat schedule as django-celery-beat rows, so operators can change periods in the admin."""

from django.db import migrations

SCHEDULE = [
    # (name, task, seconds): the tick detects lost workers within a few heartbeats.
    ("scheduler tick", "scheduling.tasks.scheduler_tick", 2),
    ("audit maintenance", "scheduling.tasks.audit_maintenance", 60),
]


def seed(apps, schema_editor):
    IntervalSchedule = apps.get_model("django_celery_beat", "IntervalSchedule")
    PeriodicTask = apps.get_model("django_celery_beat", "PeriodicTask")
    for name, task, seconds in SCHEDULE:
        interval, _ = IntervalSchedule.objects.get_or_create(every=seconds, period="seconds")
        PeriodicTask.objects.get_or_create(name=name, defaults={"task": task, "interval": interval})


def unseed(apps, schema_editor):
    PeriodicTask = apps.get_model("django_celery_beat", "PeriodicTask")
    PeriodicTask.objects.filter(name__in=[name for name, _, _ in SCHEDULE]).delete()


class Migration(migrations.Migration):
    dependencies = [
        ("scheduling", "0002_live_loop"),
        ("django_celery_beat", "0019_alter_periodictasks_options"),
    ]

    operations = [migrations.RunPython(seed, unseed)]
