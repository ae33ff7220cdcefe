from celery.signals import beat_init
from django.apps import AppConfig


class SchedulingConfig(AppConfig):
    name = "scheduling"
    verbose_name = "Scheduling"
    default_auto_field = "django.db.models.BigAutoField"

    def ready(self) -> None:
        # Imported here, not at module level: receivers import models, which the app registry
        # loads only after every AppConfig is imported (Django's documented place for signals).
        from scheduling import health
        from scheduling.receivers import job_change_received, session_event_received
        from scheduling.supervision import beat_lock_take
        from sessions.signals import job_changed, session_event_committed

        session_event_committed.connect(session_event_received, dispatch_uid="scheduling.session_event")
        job_changed.connect(job_change_received, dispatch_uid="scheduling.job_changed")
        # Fires only in the beat process, which then records a heartbeat per published task.
        # The lease first: a second beat on the broker exits before it schedules anything.
        beat_init.connect(beat_lock_take, weak=False, dispatch_uid="scheduling.supervision.beat_lock")
        beat_init.connect(health.beat_started, weak=False, dispatch_uid="scheduling.health.beat")
