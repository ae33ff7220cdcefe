from django.apps import AppConfig


class WorkersConfig(AppConfig):
    name = "workers"
    verbose_name = "Worker runtime"
    default_auto_field = "django.db.models.BigAutoField"
