from django.apps import AppConfig


class GpuConfig(AppConfig):
    name = "gpu"
    verbose_name = "GPU pool"
    default_auto_field = "django.db.models.BigAutoField"
