from django.apps import AppConfig
from django.conf import settings
from django.core.exceptions import ImproperlyConfigured


class WorkersConfig(AppConfig):
    name = "workers"
    verbose_name = "Worker runtime"
    default_auto_field = "django.db.models.BigAutoField"

    def ready(self) -> None:
        # MODEL_PATHS presets join the catalogue before any view, command or worker reads it.
        from contracts.catalog import register_model_paths

        try:
            register_model_paths(settings.STREAMSERVE.get("MODEL_PATHS", {}))
        except ValueError as exc:
            raise ImproperlyConfigured(f"Environment variable MODEL_PATHS: {exc}") from exc
