from django.apps import AppConfig


class StreamSessionsConfig(AppConfig):
    name = "sessions"
    # django.contrib.sessions already owns the label "sessions".
    label = "streams"
    verbose_name = "Generation sessions"
    default_auto_field = "django.db.models.BigAutoField"
