"""Seed the beat row of the viewer rule (``sessions.tasks.sessions_viewer_check``, every 2 s) on a
database whose periodic tasks were seeded before it existed; ``beat_schedule_install`` ensures the
same row at every platform start (both read ``settings.PERIODIC_TASKS``)."""

from django.db import migrations

NAME = "session viewers"
TASK = "sessions.tasks.sessions_viewer_check"
EVERY_S = 2  # history: the period is settings.PERIODIC_TASKS's, edited in the admin afterwards


def seed(apps, schema_editor):
    IntervalSchedule = apps.get_model("django_celery_beat", "IntervalSchedule")
    PeriodicTask = apps.get_model("django_celery_beat", "PeriodicTask")
    interval, _ = IntervalSchedule.objects.get_or_create(every=EVERY_S, period="seconds")
    PeriodicTask.objects.get_or_create(name=NAME, defaults={"task": TASK, "interval": interval})


def unseed(apps, schema_editor):
    PeriodicTask = apps.get_model("django_celery_beat", "PeriodicTask")
    PeriodicTask.objects.filter(name=NAME, task=TASK).delete()


class Migration(migrations.Migration):
    dependencies = [
        ("streams", "0006_job_deleted_at"),
        ("django_celery_beat", "0019_alter_periodictasks_options"),
    ]

    operations = [migrations.RunPython(seed, unseed)]
