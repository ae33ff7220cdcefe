"""StreamServe settings: every deployment-specific value comes from an environment variable.

Defaults are safe for development on this machine (PostgreSQL and Redis on 127.0.0.1). A malformed
value raises ImproperlyConfigured naming the variable, at start, never later.
"""

from __future__ import annotations

import json
import math
from decimal import Decimal, InvalidOperation
from pathlib import Path
from urllib.parse import urlparse

import environ
from django.core.exceptions import ImproperlyConfigured

from scheduling.core.spares import DEFAULT_MARGIN_Z, SPARE_POLICIES

BASE_DIR = Path(__file__).resolve().parent.parent

env = environ.Env()
environ.Env.read_env(BASE_DIR / ".env", overwrite=False)


def _typed(name: str, cast, default):
    """Read NAME with ``cast``; a malformed value fails loudly with the variable's name."""
    try:
        return cast(name, default=default)
    except (ValueError, TypeError) as exc:
        raise ImproperlyConfigured(f"Environment variable {name} is malformed: {exc}") from exc


def _url(name: str, default: str, schemes: tuple[str, ...]) -> str:
    value = env.str(name, default=default)
    parsed = urlparse(value)
    if parsed.scheme not in schemes or not (parsed.hostname or parsed.path):
        raise ImproperlyConfigured(
            f"Environment variable {name}={value!r} is malformed: expected a URL with scheme "
            f"{' or '.join(schemes)}"
        )
    return value


def _prices(name: str, default: dict[str, Decimal]) -> dict[str, Decimal]:
    """``"cpu=0,h100=2.99"`` → {"cpu": Decimal("0"), "h100": Decimal("2.99")} ($ per GPU-hour)."""
    raw = env.str(name, default="")
    if raw == "":
        return default
    prices: dict[str, Decimal] = {}
    for part in raw.split(","):
        if not part.strip():
            continue
        gpu_type, sep, price = part.partition("=")
        try:
            if not sep or not gpu_type.strip():
                raise ValueError(f"expected gpu_type=price, got {part!r}")
            value = Decimal(price.strip())
        except (ValueError, InvalidOperation) as exc:
            raise ImproperlyConfigured(f"Environment variable {name}={raw!r} is malformed: {exc}") from exc
        if value < 0:
            raise ImproperlyConfigured(
                f"Environment variable {name}={raw!r} is malformed: price of {gpu_type.strip()} is negative"
            )
        prices[gpu_type.strip()] = value
    return prices


def _strict_bool(name: str, default: bool) -> bool:
    raw = env.str(name, default="")
    if raw == "":
        return default
    lowered = raw.strip().lower()
    if lowered in {"1", "true", "yes", "on"}:
        return True
    if lowered in {"0", "false", "no", "off"}:
        return False
    raise ImproperlyConfigured(f"Environment variable {name}={raw!r} is malformed: expected true or false")


def _model_paths(name: str) -> dict[str, str]:
    """``"wan-causal=/models/self-forcing,other=/models/x"`` → {preset: directory} (docs/models.md).

    Only the form is checked here; the directory's layout is checked when the workers app registers
    the presets (``contracts.catalog.register_model_paths``), with an error naming the variable."""
    raw = env.str(name, default="")
    paths: dict[str, str] = {}
    for part in raw.split(","):
        if not part.strip():
            continue
        preset, sep, path = (piece.strip() for piece in part.partition("="))
        if not sep or not preset or not path or preset in paths:
            raise ImproperlyConfigured(
                f"Environment variable {name}={raw!r} is malformed: expected preset=/path/to/checkpoint "
                f"entries with distinct preset names, got {part!r}"
            )
        paths[preset] = path
    return paths


def _ice_servers(name: str) -> list[dict]:
    """STUN/TURN servers as a JSON list in RTCIceServer's shape, e.g.
    ``[{"urls": "stun:stun.example.org:3478"}, {"urls": ["turn:turn.example.org:3478"],
    "username": "u", "credential": "p"}]``; empty (the default) is enough on one host or a LAN."""
    raw = env.str(name, default="").strip()
    if raw == "":
        return []
    try:
        servers = json.loads(raw)
    except json.JSONDecodeError as exc:
        raise ImproperlyConfigured(f"Environment variable {name} is malformed: not JSON: {exc.msg}") from exc
    problem = None
    if not isinstance(servers, list):
        problem = "expected a JSON list of {urls, username, credential} objects"
    else:
        for server in servers:
            urls = server.get("urls") if isinstance(server, dict) else None
            urls = [urls] if isinstance(urls, str) else urls
            if not urls or not all(
                isinstance(url, str) and url.split(":", 1)[0] in ("stun", "stuns", "turn", "turns")
                for url in urls
            ):
                problem = f"each server needs 'urls' of stun:, stuns:, turn: or turns: URLs, got {server!r}"
            elif set(server) - {"urls", "username", "credential"}:
                problem = f"unknown keys {sorted(set(server) - {'urls', 'username', 'credential'})}"
            elif any(url.startswith("turn") for url in urls) and not (
                isinstance(server.get("username"), str) and isinstance(server.get("credential"), str)
            ):
                problem = f"a TURN server needs a 'username' and a 'credential' string: {urls}"
            if problem:
                break
    if problem:
        raise ImproperlyConfigured(f"Environment variable {name} is malformed: {problem}")
    return servers


# Model presets served from local checkpoint directories, each registered as a preset of its own.
MODEL_PATHS = _model_paths("MODEL_PATHS")

# Off unless asked for: a 500 with DEBUG on shows settings and source. The development runner
# (`make run`) and the test harnesses that start servers turn it on explicitly.
DEBUG = _strict_bool("DEBUG", False)
SECRET_KEY = env.str("SECRET_KEY", default="")
SECRET_KEY_MISSING = (
    "Environment variable SECRET_KEY must be set when DEBUG is off (DEBUG=true for development)"
)
if not SECRET_KEY and DEBUG:
    SECRET_KEY = "dev-only-insecure-key-change-me"
# Without DEBUG and without a key, commands that sign nothing (simulate, benchmarks, migrate) still
# run; the web server refuses to start (controlplane/asgi.py) and
# Django refuses any use of the empty key.
ALLOWED_HOSTS = _typed("ALLOWED_HOSTS", env.list, ["localhost", "127.0.0.1", "[::1]", "testserver"])
CSRF_TRUSTED_ORIGINS = _typed("CSRF_TRUSTED_ORIGINS", env.list, [])

DATABASE_URL = _url(
    "DATABASE_URL", "postgres://postgres@127.0.0.1:5432/streamserve", ("postgres", "postgresql")
)
REDIS_URL = _url("REDIS_URL", "redis://127.0.0.1:6379/0", ("redis", "rediss", "unix"))
CELERY_BROKER_URL = _url("CELERY_BROKER_URL", REDIS_URL, ("redis", "rediss", "unix"))

INSTALLED_APPS = [
    "django.contrib.admin",
    "django.contrib.auth",
    "django.contrib.contenttypes",
    "django.contrib.sessions",
    "django.contrib.messages",
    "django.contrib.staticfiles",
    "django.contrib.humanize",
    "django.contrib.postgres",
    "rest_framework",
    "rest_framework.authtoken",
    "django_filters",
    "drf_spectacular",
    "django_celery_beat",
    "channels",
    "gpu",
    "sessions.apps.StreamSessionsConfig",
    "scheduling",
    "workers",
]

MIDDLEWARE = [
    # First: /healthz and /readyz answer before host validation and sessions (controlplane/health.py).
    "controlplane.health.HealthMiddleware",
    "django.middleware.security.SecurityMiddleware",
    "whitenoise.middleware.WhiteNoiseMiddleware",
    "django.contrib.sessions.middleware.SessionMiddleware",
    "django.middleware.common.CommonMiddleware",
    "django.middleware.csrf.CsrfViewMiddleware",
    "django.contrib.auth.middleware.AuthenticationMiddleware",
    "django.contrib.messages.middleware.MessageMiddleware",
    "django.middleware.clickjacking.XFrameOptionsMiddleware",
]

ROOT_URLCONF = "controlplane.urls"
ASGI_APPLICATION = "controlplane.asgi.application"
WSGI_APPLICATION = None

TEMPLATES = [
    {
        "BACKEND": "django.template.backends.django.DjangoTemplates",
        "DIRS": [BASE_DIR / "templates"],
        "APP_DIRS": True,
        "OPTIONS": {
            "context_processors": [
                "django.template.context_processors.request",
                "django.contrib.auth.context_processors.auth",
                "django.contrib.messages.context_processors.messages",
            ],
        },
    },
]

try:
    DATABASES = {"default": env.db_url_config(DATABASE_URL)}
except Exception as exc:  # environ raises several types for bad URLs
    raise ImproperlyConfigured(f"Environment variable DATABASE_URL is malformed: {exc}") from exc
DATABASES["default"]["CONN_MAX_AGE"] = _typed("DB_CONN_MAX_AGE", env.int, 60)
DATABASES["default"]["CONN_HEALTH_CHECKS"] = True
DATABASES["default"].setdefault("TEST", {})["NAME"] = env.str(
    "TEST_DATABASE_NAME", default="test_streamserve"
)
DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"

CACHES = {
    "default": {
        "BACKEND": "django.core.cache.backends.redis.RedisCache",
        "LOCATION": REDIS_URL,
        "KEY_PREFIX": env.str("CACHE_KEY_PREFIX", default="streamserve"),
    }
}

# Redis pub/sub delivers each group message straight to the subscribed process, which hands it to
# the consumer's own bounded outbox; the list-based core layer queues everything for a process through
# one shared inbox and drops silently when it is full (see docs/benchmarks-live.md).
CHANNEL_LAYER = env.str("CHANNEL_LAYER", default="pubsub")
if CHANNEL_LAYER not in {"pubsub", "core"}:
    raise ImproperlyConfigured(
        f"Environment variable CHANNEL_LAYER={CHANNEL_LAYER!r} is malformed: pubsub or core"
    )
CHANNEL_LAYERS = {
    "default": {
        "BACKEND": "channels_redis.pubsub.RedisPubSubChannelLayer"
        if CHANNEL_LAYER == "pubsub"
        else "channels_redis.core.RedisChannelLayer",
        "CONFIG": {
            "hosts": [REDIS_URL],
            "prefix": env.str("CHANNEL_LAYER_PREFIX", default="asgi"),
        },
    }
}
if CHANNEL_LAYER == "core":
    CHANNEL_LAYERS["default"]["CONFIG"].update(
        capacity=_typed("CHANNEL_LAYER_CAPACITY", env.int, 200), expiry=30
    )

AUTH_PASSWORD_VALIDATORS = [
    {"NAME": "django.contrib.auth.password_validation.UserAttributeSimilarityValidator"},
    {"NAME": "django.contrib.auth.password_validation.MinimumLengthValidator"},
]
LOGIN_URL = "/accounts/login/"
LOGIN_REDIRECT_URL = "/"
LOGOUT_REDIRECT_URL = "/accounts/login/"

LANGUAGE_CODE = "en-us"
TIME_ZONE = "UTC"
USE_I18N = True
USE_TZ = True

STATIC_URL = "static/"
STATIC_ROOT = BASE_DIR / "staticfiles"
STATICFILES_DIRS = [BASE_DIR / "static"]
WHITENOISE_USE_FINDERS = True

# Uploaded and generated files (one-shot job results, docs/jobs.md) go through Django's storage API:
# the local MEDIA_ROOT by default; any backend (S3, GCS, ...) by naming it in STORAGES_DEFAULT_BACKEND
# with its options as JSON in STORAGES_DEFAULT_OPTIONS. Results are served only through the jobs API's
# download endpoint (it checks ownership), never from MEDIA_URL directly.
MEDIA_ROOT = Path(env.str("MEDIA_ROOT", default=str(BASE_DIR / "var/media")))
MEDIA_URL = "media/"
STORAGES = {
    "default": {
        "BACKEND": env.str("STORAGES_DEFAULT_BACKEND", default="django.core.files.storage.FileSystemStorage"),
        "OPTIONS": _typed("STORAGES_DEFAULT_OPTIONS", env.json, {}),
    },
    "staticfiles": {"BACKEND": "django.contrib.staticfiles.storage.StaticFilesStorage"},
}
if not isinstance(STORAGES["default"]["OPTIONS"], dict):
    raise ImproperlyConfigured("Environment variable STORAGES_DEFAULT_OPTIONS must be a JSON object")


def _rate(name: str, default: str) -> str | None:
    """A DRF throttle rate ``<count>/<second|minute|hour|day>``; ``off`` disables that throttle."""
    raw = env.str(name, default=default).strip()
    if raw.lower() == "off":
        return None
    count, _, period = raw.partition("/")
    if not count.isdigit() or int(count) < 1 or period[:1] not in {"s", "m", "h", "d"}:
        raise ImproperlyConfigured(
            f"Environment variable {name}={raw!r} is malformed: expected e.g. 600/minute, or off"
        )
    return raw


def _choice(name: str, default: str, choices: tuple[str, ...]) -> str:
    value = env.str(name, default=default).strip().lower()
    if value not in choices:
        raise ImproperlyConfigured(
            f"Environment variable {name}={value!r} is malformed: one of {', '.join(choices)}"
        )
    return value


# Who may read the OpenAPI schema (/api/schema/) and its docs page (/api/docs/): anyone, logged-in
# users and token holders, or nobody (the routes are not served).
API_SCHEMA_ACCESS = _choice("API_SCHEMA_ACCESS", "authenticated", ("public", "authenticated", "off"))

REST_FRAMEWORK = {
    "DEFAULT_AUTHENTICATION_CLASSES": [
        "rest_framework.authentication.TokenAuthentication",
        # The same tokens as `Authorization: Bearer <key>`, as OpenAI's SDKs send them.
        "contracts.http.auth.BearerTokenAuthentication",
        "rest_framework.authentication.SessionAuthentication",
    ],
    "DEFAULT_PERMISSION_CLASSES": ["rest_framework.permissions.IsAuthenticated"],
    # JSON bodies only: a form field cannot say null, a number or a list, so a form body is
    # reinterpreted (a list becomes its text) instead of refused.
    "DEFAULT_PARSER_CLASSES": ["rest_framework.parsers.JSONParser"],
    "TEST_REQUEST_DEFAULT_FORMAT": "json",
    "DEFAULT_FILTER_BACKENDS": [
        "contracts.http.api.StrictFilterBackend",
        "rest_framework.filters.OrderingFilter",
    ],
    "DEFAULT_PAGINATION_CLASS": "contracts.http.api.BoundedLimitOffsetPagination",
    "PAGE_SIZE": 50,
    "DEFAULT_SCHEMA_CLASS": "drf_spectacular.openapi.AutoSchema",
    "EXCEPTION_HANDLER": "contracts.http.api.exception_handler",
    # `?format=csv` on audit endpoints is ours, not content negotiation.
    "URL_FORMAT_OVERRIDE": None,
    # Per user (per client address before login); the counters live in the Redis cache.
    "DEFAULT_THROTTLE_CLASSES": [
        "rest_framework.throttling.UserRateThrottle",
        "rest_framework.throttling.AnonRateThrottle",
    ],
    "DEFAULT_THROTTLE_RATES": {
        "user": _rate("API_THROTTLE_USER", "1200/minute"),
        "anon": _rate("API_THROTTLE_ANON", "60/minute"),
    },
}
SPECTACULAR_SETTINGS = {
    "TITLE": "StreamServe API",
    "DESCRIPTION": "Sessions, GPU workers, scheduler history and audit of a streaming video generation cluster.",
    "VERSION": "0.1.0",
    "SERVE_INCLUDE_SCHEMA": False,
    "SERVE_PERMISSIONS": [
        "rest_framework.permissions.AllowAny"
        if API_SCHEMA_ACCESS == "public"
        else "rest_framework.permissions.IsAuthenticated"
    ],
    "COMPONENT_SPLIT_REQUEST": True,
    # Sessions' events and jobs both have a ``kind``: name the jobs' enum instead of a hash.
    "ENUM_NAME_OVERRIDES": {
        "JobKindEnum": "sessions.models.Job.Kind",
        # The OpenAI API's (sessions/openai/): sizes are the served resolutions (images: or auto),
        # and each object names its type in a one-value `object` field.
        "ResolutionEnum": "sessions.serializers.SERVED_RESOLUTIONS",
        "ImageSizeEnum": "sessions.openai.serializers.IMAGE_SIZES",
        "VideoObjectEnum": ["video"],
        "VideoDeletedObjectEnum": ["video.deleted"],
        "ModelObjectEnum": ["model"],
        "ListObjectEnum": ["list"],
    },
    "POSTPROCESSING_HOOKS": [
        "drf_spectacular.hooks.postprocess_schema_enums",
        "contracts.http.api.document_error_responses",
    ],
}

# Celery (controlplane/celery.py reads every CELERY_* setting).
CELERY_RESULT_BACKEND = None
CELERY_TASK_SERIALIZER = "json"
CELERY_ACCEPT_CONTENT = ["json"]
CELERY_TASK_TIME_LIMIT = 60
CELERY_TASK_SOFT_TIME_LIMIT = 50
CELERY_TASK_DEFAULT_QUEUE = "default"
# The apps' periodic maintenance runs on the scheduler's workers, as it did before it was split by app.
CELERY_TASK_ROUTES = {
    "scheduling.tasks.*": {"queue": "scheduler"},
    "gpu.tasks.*": {"queue": "scheduler"},
    "sessions.tasks.*": {"queue": "scheduler"},
}
CELERY_BEAT_SCHEDULER = "django_celery_beat.schedulers:DatabaseScheduler"
# The periodic tasks, declared once: name → task and period. They are rows of the DatabaseScheduler,
# seeded by the scheduling migrations and ensured by `scheduling.services.beat_schedule_install`
# (runplatform), so operators change periods in the admin. Not CELERY_BEAT_SCHEDULE: the
# DatabaseScheduler writes that over the admin's edits at every start. The tick detects lost workers
# within a few heartbeats and rebalances/autoscales on fresh state; each app keeps its audit data:
# gpu its cost ledger, sessions its per-minute chunk rollups and the retention of raw chunk records.
PERIODIC_TASKS = {
    "scheduler tick": {"task": "scheduling.tasks.scheduler_tick", "every_s": 2},
    "cost ledger": {"task": "gpu.tasks.ledger_accrue", "every_s": 60},
    "chunk records ingest": {"task": "sessions.tasks.chunk_records_drain", "every_s": 1},
    "chunk rollups": {"task": "sessions.tasks.chunk_rollup", "every_s": 60},
    "chunk retention": {"task": "sessions.tasks.chunk_records_prune", "every_s": 60},
    # Sessions nobody watches go idle after their grace period, and end after the idle timeout.
    "session viewers": {"task": "sessions.tasks.sessions_viewer_check", "every_s": 2},
    # One forecast slot of the global router (docs/regions.md, "Live platform"): its period is the slot.
    "region forecast": {"task": "scheduling.tasks.region_forecast", "every_s": 30},
}
CELERY_TIMEZONE = "UTC"
CELERY_BROKER_CONNECTION_RETRY_ON_STARTUP = True
CELERY_WORKER_HIJACK_ROOT_LOGGER = False

# StreamServe knobs.
STREAMSERVE = {
    # Raw chunk records older than this are deleted once rolled up (rollups are kept).
    "CHUNK_RETENTION_DAYS": _typed("CHUNK_RETENTION_DAYS", env.int, 14),
    "MAX_PROMPT_CHARS": _typed("MAX_PROMPT_CHARS", env.int, 2000),
    "SLO_MS": _typed("SLO_MS", env.float, 1000.0),
    "HEARTBEAT_INTERVAL_S": _typed("HEARTBEAT_INTERVAL_S", env.float, 1.0),
    "HEARTBEAT_TIMEOUT_S": _typed("HEARTBEAT_TIMEOUT_S", env.float, 5.0),
    # A worker that saw no command and no heartbeat acknowledged by the control plane for this
    # long checkpoints its sessions and exits (0: never): no worker generates for nobody.
    "WORKER_ORPHAN_TIMEOUT_S": _typed("WORKER_ORPHAN_TIMEOUT_S", env.float, 60.0),
    "QUEUE_MAX": _typed("QUEUE_MAX", env.int, 100),
    # Sessions one user may hold alive (not terminated) at once; creating one more is a 429.
    "MAX_LIVE_SESSIONS_PER_USER": _typed("MAX_LIVE_SESSIONS_PER_USER", env.int, 10),
    # Viewer-aware sessions (docs/runtime.md, "Sessions nobody watches"): an active session with no
    # viewer for SESSION_VIEWER_GRACE_S goes idle (reason no_viewers); an idle one with no viewer for
    # SESSION_IDLE_TIMEOUT_S ends (reason idle_timeout). 0 turns a rule off.
    "SESSION_VIEWER_GRACE_S": _typed("SESSION_VIEWER_GRACE_S", env.float, 30.0),
    "SESSION_IDLE_TIMEOUT_S": _typed("SESSION_IDLE_TIMEOUT_S", env.float, 900.0),
    # One-shot image/video jobs (docs/jobs.md): jobs one user may have in flight (queued, running or
    # paused; one more is a 429), the bounds of a request, and the SLO of a job that names none.
    "MAX_JOBS_IN_FLIGHT_PER_USER": _typed("MAX_JOBS_IN_FLIGHT_PER_USER", env.int, 20),
    "JOB_MAX_STEPS": _typed("JOB_MAX_STEPS", env.int, 100),
    "JOB_MAX_FRAMES": _typed("JOB_MAX_FRAMES", env.int, 129),
    "JOB_DEFAULT_SLO_S": _typed("JOB_DEFAULT_SLO_S", env.float, 300.0),
    # The OpenAI-compatible API (/v1/, docs/openai.md): how long POST /v1/images/generations waits
    # for its images (also their jobs' SLO), and whether a request without a valid API token acts
    # as the local `demo` user (a single-user machine only: anyone who reaches the port is that user).
    "OPENAI_IMAGES_TIMEOUT_S": _typed("OPENAI_IMAGES_TIMEOUT_S", env.float, 120.0),
    "OPENAI_API_ANONYMOUS": _strict_bool("OPENAI_API_ANONYMOUS", False),
    # vLLM-Omni's realtime video socket (/v1/realtime/video, docs/openai.md): a session with no
    # chunk and no session.ping for this long is ended with a stall error, as vLLM-Omni's is (~60 s).
    "REALTIME_STALL_TIMEOUT_S": _typed("REALTIME_STALL_TIMEOUT_S", env.float, 60.0),
    # STUN/TURN servers for WebRTC viewers (docs/media.md#webrtc), given to aiortc and to the page.
    "WEBRTC_ICE_SERVERS": _ice_servers("WEBRTC_ICE_SERVERS"),
    # Where WebRTC peer connections run (docs/media.md#the-media-process): `process`, in the media
    # process(es) beside the web process (`manage.py runmedia`, started by runplatform), off the
    # event loop that serves the sockets; `inline`, in the web process's own event loop.
    "WEBRTC_MEDIA": _choice("WEBRTC_MEDIA", "process", ("process", "inline")),
    # An offer no media process answers within this long is an error frame (the page falls back).
    "WEBRTC_MEDIA_ANSWER_TIMEOUT_S": _typed("WEBRTC_MEDIA_ANSWER_TIMEOUT_S", env.float, 10.0),
    # The job dispatcher's policy (scheduling.core.jobs.policy): `edf`, `genserve` or
    # package.module:ClassName.
    "JOB_POLICY": env.str("JOB_POLICY", default="edf"),
    # Job cost profiles `genserve` costs steps with, beside the built-in ones: names or JSON paths
    # (e.g. what `profile_model --one-shot` wrote); docs/jobs.md.
    "JOB_PROFILES": _typed("JOB_PROFILES", env.list, []),
    "PROVISIONER": env.str("PROVISIONER", default="local"),
    # Workers of this pool run on several hosts (docs/production.md, "Several hosts"): a worker then
    # refuses to advertise a loopback --listen-host, which peers on other hosts could not reach.
    "WORKER_MULTI_HOST": _strict_bool("WORKER_MULTI_HOST", False),
    # Model presets this deployment runs workers for; sessions of other presets are refused. `demo`
    # is the trained model that follows its prompt (the test suite serves `tiny`: pyproject.toml).
    # Presets of MODEL_PATHS are served unless SERVED_MODELS says otherwise.
    "SERVED_MODELS": _typed("SERVED_MODELS", env.list, ["demo", *MODEL_PATHS]),
    "MODEL_PATHS": MODEL_PATHS,
    # Workers the local provisioner starts: torch device kind and capacity K (sessions per worker).
    "WORKER_DEVICE": env.str("WORKER_DEVICE", default="auto"),
    "WORKER_CAPACITY": _typed("WORKER_CAPACITY", env.int, 4),
    # Scheduler profile of a worker type (built-in name or JSON written by `profile_model`).
    "WORKER_PROFILE": env.str(
        "WORKER_PROFILE", default=str(BASE_DIR / "scheduling/data/profiles/cpu-tiny.json")
    ),
    "CHECKPOINT_DIR": env.str("CHECKPOINT_DIR", default=str(BASE_DIR / "var/checkpoints")),
    "CHECKPOINT_EVERY": _typed("CHECKPOINT_EVERY", env.int, 8),
    "COMMAND_TIMEOUT_S": _typed("COMMAND_TIMEOUT_S", env.float, 30.0),
    "MIGRATION_TIMEOUT_S": _typed("MIGRATION_TIMEOUT_S", env.float, 20.0),
    "CONSOLE_PUSH_INTERVAL_S": _typed("CONSOLE_PUSH_INTERVAL_S", env.float, 1.0),
    # Provisioners (docs/provisioners.md). PROVISION_TIMEOUT_S unset: each backend's own default.
    "PROVISION_TIMEOUT_S": _typed("PROVISION_TIMEOUT_S", env.float, None),
    "PROVISION_MAX_RETRIES": _typed("PROVISION_MAX_RETRIES", env.int, 2),
    "PROVISION_RETRY_WINDOW_S": _typed("PROVISION_RETRY_WINDOW_S", env.float, 3600.0),
    "PROVISION_BACKOFF_S": _typed("PROVISION_BACKOFF_S", env.float, 30.0),
    "GPU_PRICES": _prices("GPU_PRICES", {"cpu": Decimal(0)}),
    "LOCAL_STOP_GRACE_S": _typed("LOCAL_STOP_GRACE_S", env.float, 15.0),
    "LOCAL_MAX_CPU_WORKERS": _typed("LOCAL_MAX_CPU_WORKERS", env.int, 4),
    # Parameter pool (docs/scaleout.md, BlitzScale §5.3): host-memory copies of one model's weights
    # allowed in the whole cluster ("O(1) host caching"); a host cache's memory bound by default.
    "POOL_HOST_COPIES": _typed("POOL_HOST_COPIES", env.int, 1),
    "HOSTCACHE_CAPACITY_MB": _typed("HOSTCACHE_CAPACITY_MB", env.int, 4096),
    # Models whose host copy `runplatform` keeps in a supervised host cache on this machine (empty:
    # none; a cluster runs `manage.py hostcache` on the hosts it chooses).
    "HOSTCACHE_MODELS": _typed("HOSTCACHE_MODELS", env.list, []),
    # Each preset's weights as safetensors (<dir>/<preset>.safetensors; written from the seeded
    # weights the first time a worker needs it): the "disk" source and the fallback of every chain.
    "WEIGHTS_DIR": env.str("WEIGHTS_DIR", default=str(BASE_DIR / "var/weights")),
    # Where new workers load weights from: auto (the scale plan's source, else disk), pool, disk.
    "WORKER_WEIGHTS_FROM": env.str("WORKER_WEIGHTS_FROM", default="auto"),
    # In a Pod the downward API sets POD_NAMESPACE: workers go beside the control plane by default.
    "K8S_NAMESPACE": env.str("K8S_NAMESPACE", default="") or env.str("POD_NAMESPACE", default="streamserve"),
    "K8S_WORKER_TEMPLATE": env.str("K8S_WORKER_TEMPLATE", default=""),
    "K8S_WORKER_IMAGE": env.str("K8S_WORKER_IMAGE", default=""),
    "K8S_SECRET_NAME": env.str("K8S_SECRET_NAME", default="") or "streamserve-env",
    "K8S_GPU_TYPE": env.str("K8S_GPU_TYPE", default="") or "h100",
    "K8S_STOP_GRACE_S": _typed("K8S_STOP_GRACE_S", env.int, 30),
    "K8S_GPU_TYPE_NODE_LABEL": env.str("K8S_GPU_TYPE_NODE_LABEL", default=""),
    # ``name@host:device[/gpu_type],...``; the static backend parses it and names it when malformed.
    "STATIC_WORKERS": env.str("STATIC_WORKERS", default=""),
    # /metrics (docs/observability.md): served at all, bearer token (empty: open), histogram window.
    "METRICS_ENABLED": _strict_bool("METRICS_ENABLED", True),
    "METRICS_TOKEN": env.str("METRICS_TOKEN", default=""),
    "METRICS_WINDOW_S": _typed("METRICS_WINDOW_S", env.float, 300.0),
    # `runplatform` binds here; `create_demo_user` sets these passwords.
    "HOST": env.str("HOST", default="127.0.0.1"),
    "PORT": _typed("PORT", env.int, 8000),
    # Regions (docs/regions.md, "Live platform"): the request header that carries a session's user
    # origin when the body has no `origin` (empty: body only); a session's RTT budget to its region;
    # the plan's smoothing weight β.
    "ORIGIN_HEADER": env.str("ORIGIN_HEADER", default="X-StreamServe-Origin"),
    # Tenants (docs/tenants.md): the request header naming the tenant a user acts for when the body
    # has no `tenant` (empty: body only), and the window of GPU-seconds the fair share weighs.
    "TENANT_HEADER": env.str("TENANT_HEADER", default="X-StreamServe-Tenant"),
    "TENANT_FAIR_SHARE_WINDOW_S": _typed("TENANT_FAIR_SHARE_WINDOW_S", env.float, 3600.0),
    "REGION_RTT_BUDGET_MS": _typed("REGION_RTT_BUDGET_MS", env.float, 60.0),
    "REGION_PLAN_BETA": _typed("REGION_PLAN_BETA", env.float, 0.5),
    # The router's demand forecast by origin (ets | seasonal-naive | last-value), one slot ahead, and
    # the seasonal-naive season in slots (2880 slots of 30 s: a day).
    "REGION_FORECAST": env.str("REGION_FORECAST", default="ets"),
    "REGION_FORECAST_SEASON_SLOTS": _typed("REGION_FORECAST_SEASON_SLOTS", env.int, 2880),
    # Raise each region's autoscaler target to TORTA's Eq. 6 floor on the plan's share of the forecast
    # (off by default, like `simulate` without --forecast; σ = 0.5 as its --forecast-sigma default).
    "REGION_FORECAST_FLOOR": _strict_bool("REGION_FORECAST_FLOOR", False),
    # Spare capacity for what arrives while a scale-out boots (issue 27, scheduling/core/spares.py):
    # off (TurboServe's headroom as before) or boot-aware (the delay the platform predicts for its
    # next scale-out; free capacity at K of the expected net activations + z·σ, never below the floor
    # in sessions of load 1).
    "SPARE_POLICY": _choice("SPARE_POLICY", "off", SPARE_POLICIES),
    "SPARE_MARGIN_Z": _typed("SPARE_MARGIN_Z", env.float, DEFAULT_MARGIN_Z),
    "SPARE_MIN_SESSIONS": _typed("SPARE_MIN_SESSIONS", env.float, 0.0),
    # Moves of sessions to another region per slot, parked and running together (0: none).
    "REGION_MOVES_PER_SLOT": _typed("REGION_MOVES_PER_SLOT", env.int, 4),
    # Live stage placement (docs/stages.md, "Live placement"): off (every worker keeps its role,
    # today's behaviour) or tridentserve (Alg. 2 plans the workers' roles each scheduler tick and
    # re-places them when the §5.3 trigger fires). The stage profile the planner costs the live mix
    # with, the GPU spec of workers whose gpu_type has none (cpu), the trigger's window, threshold and
    # minimum ops, and how many workers may change role at once.
    "STAGE_PLACEMENT": env.str("STAGE_PLACEMENT", default="off"),
    "STAGE_PIPELINE": env.str("STAGE_PIPELINE", default="wan-1.3b"),
    "STAGE_GPU": env.str("STAGE_GPU", default="h100"),
    "STAGE_WINDOW_S": _typed("STAGE_WINDOW_S", env.float, 60.0),
    "STAGE_THRESHOLD": _typed("STAGE_THRESHOLD", env.float, 1.5),
    "STAGE_MIN_OPS": _typed("STAGE_MIN_OPS", env.int, 25),
    "STAGE_MAX_CHANGING": _typed("STAGE_MAX_CHANGING", env.int, 1),
    # The E workers' mean reported encode queue at which the planner turns an idle worker into E.
    "STAGE_ENCODER_QUEUE_MAX": _typed("STAGE_ENCODER_QUEUE_MAX", env.int, 4),
    # Moves of running sessions across regions (same per-slot limit): the WAN bandwidth their state
    # crosses (Gbit/s; per pair of regions in REGION_WAN_GBPS_PAIRS, {"east:west": 0.5}, either
    # direction) and how long a moved session is expected to go on (the saving's horizon).
    "REGION_WAN_GBPS": _typed("REGION_WAN_GBPS", env.float, 1.0),
    "REGION_WAN_GBPS_PAIRS": _typed("REGION_WAN_GBPS_PAIRS", env.json, {}),
    "REGION_MOVE_HORIZON_S": _typed("REGION_MOVE_HORIZON_S", env.float, 300.0),
    # Hysteresis: a running session moved less than this ago (s) is not moved again (0: no cooldown).
    "REGION_MOVE_COOLDOWN_S": _typed("REGION_MOVE_COOLDOWN_S", env.float, 300.0),
    # The fewest GPUs a region keeps when it has no demand and a forecast of none ({"east": 1};
    # 0 for a region not named: an idle region scales to zero).
    "REGION_MIN_GPUS": _typed("REGION_MIN_GPUS", env.json, {}),
    "DEMO_PASSWORD": env.str("DEMO_PASSWORD", default="demo-streamserve"),
    "OPERATOR_PASSWORD": env.str("OPERATOR_PASSWORD", default="operator-streamserve"),
}
for _name in (
    "HEARTBEAT_INTERVAL_S",
    "HEARTBEAT_TIMEOUT_S",
    "COMMAND_TIMEOUT_S",
    "MIGRATION_TIMEOUT_S",
    "CONSOLE_PUSH_INTERVAL_S",
    "JOB_DEFAULT_SLO_S",
    "OPENAI_IMAGES_TIMEOUT_S",
    "REALTIME_STALL_TIMEOUT_S",
    "WEBRTC_MEDIA_ANSWER_TIMEOUT_S",
    "REGION_RTT_BUDGET_MS",
    "REGION_FORECAST_SEASON_SLOTS",
    "STAGE_WINDOW_S",
    "REGION_WAN_GBPS",
    "REGION_MOVE_HORIZON_S",
):
    if STREAMSERVE[_name] <= 0:
        raise ImproperlyConfigured(f"Environment variable {_name} must be positive")
if STREAMSERVE["OPENAI_IMAGES_TIMEOUT_S"] > 3600:
    # The request holds a server thread for as long: an hour is already a batch job, not a call.
    raise ImproperlyConfigured("Environment variable OPENAI_IMAGES_TIMEOUT_S must be at most 3600")
if STREAMSERVE["REGION_FORECAST"] not in ("ets", "seasonal-naive", "last-value"):
    raise ImproperlyConfigured(
        "Environment variable REGION_FORECAST must be ets, seasonal-naive or last-value"
    )
if STREAMSERVE["WORKER_ORPHAN_TIMEOUT_S"] < 0:
    raise ImproperlyConfigured("Environment variable WORKER_ORPHAN_TIMEOUT_S must be 0 (off) or more")
if 0 < STREAMSERVE["WORKER_ORPHAN_TIMEOUT_S"] <= 2 * STREAMSERVE["HEARTBEAT_TIMEOUT_S"]:
    # The control plane acknowledges heartbeats once a scheduler tick: a timeout this short would
    # end healthy workers across one slow tick.
    raise ImproperlyConfigured(
        "Environment variable WORKER_ORPHAN_TIMEOUT_S must be 0 (off) or more than twice HEARTBEAT_TIMEOUT_S"
    )
for _name in ("SESSION_VIEWER_GRACE_S", "SESSION_IDLE_TIMEOUT_S"):
    if STREAMSERVE[_name] < 0:
        raise ImproperlyConfigured(f"Environment variable {_name} must be 0 (off) or more")
if STREAMSERVE["REGION_MOVE_COOLDOWN_S"] < 0:
    raise ImproperlyConfigured("Environment variable REGION_MOVE_COOLDOWN_S must be 0 or more")
if STREAMSERVE["REGION_MOVES_PER_SLOT"] < 0:
    raise ImproperlyConfigured("Environment variable REGION_MOVES_PER_SLOT must be 0 or more")
_pairs = STREAMSERVE["REGION_WAN_GBPS_PAIRS"]
if not isinstance(_pairs, dict) or not all(
    isinstance(k, str)
    and len(k.split(":")) == 2
    and all(k.split(":"))
    and isinstance(v, int | float)
    and not isinstance(v, bool)
    and v > 0
    for k, v in _pairs.items()
):
    raise ImproperlyConfigured(
        'Environment variable REGION_WAN_GBPS_PAIRS must be a JSON object {"source:target": Gbit/s > 0}'
    )
_minimum = STREAMSERVE["REGION_MIN_GPUS"]
if not isinstance(_minimum, dict) or not all(
    isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in _minimum.values()
):
    raise ImproperlyConfigured(
        'Environment variable REGION_MIN_GPUS must be a JSON object {"region": whole number >= 0}'
    )
for _name in ("SPARE_MARGIN_Z", "SPARE_MIN_SESSIONS"):
    if not (math.isfinite(STREAMSERVE[_name]) and STREAMSERVE[_name] >= 0):
        raise ImproperlyConfigured(f"Environment variable {_name} must be a finite number >= 0")
if not 0.0 < STREAMSERVE["REGION_PLAN_BETA"] <= 1.0:
    raise ImproperlyConfigured("Environment variable REGION_PLAN_BETA must be in (0, 1]")
if STREAMSERVE["STAGE_PLACEMENT"] not in ("off", "tridentserve"):
    raise ImproperlyConfigured("Environment variable STAGE_PLACEMENT must be off or tridentserve")
if STREAMSERVE["STAGE_PIPELINE"] not in ("wan-t2v", "sd3-image", "wan-1.3b"):
    raise ImproperlyConfigured("Environment variable STAGE_PIPELINE must be wan-t2v, sd3-image or wan-1.3b")
if STREAMSERVE["STAGE_GPU"].lower() not in ("l20", "h100", "h200"):
    raise ImproperlyConfigured("Environment variable STAGE_GPU must be l20, h100 or h200")
if STREAMSERVE["STAGE_THRESHOLD"] <= 1.0:
    raise ImproperlyConfigured("Environment variable STAGE_THRESHOLD must be above 1")
if not 0.0 < STREAMSERVE["TENANT_FAIR_SHARE_WINDOW_S"] < float("inf"):
    raise ImproperlyConfigured(
        "Environment variable TENANT_FAIR_SHARE_WINDOW_S must be a positive number of seconds"
    )
if STREAMSERVE["WORKER_WEIGHTS_FROM"] not in ("auto", "pool", "disk"):
    raise ImproperlyConfigured("Environment variable WORKER_WEIGHTS_FROM must be auto, pool or disk")
for _name in (
    "WORKER_CAPACITY",
    "CHECKPOINT_EVERY",
    "MAX_LIVE_SESSIONS_PER_USER",
    "POOL_HOST_COPIES",
    "HOSTCACHE_CAPACITY_MB",
    "MAX_JOBS_IN_FLIGHT_PER_USER",
    "JOB_MAX_STEPS",
    "JOB_MAX_FRAMES",
    "STAGE_MIN_OPS",
    "STAGE_MAX_CHANGING",
    "STAGE_ENCODER_QUEUE_MAX",
):
    if STREAMSERVE[_name] < 1:
        raise ImproperlyConfigured(f"Environment variable {_name} must be at least 1")

# OpenTelemetry traces (docs/observability.md, "Traces"): off by default, and off means the SDK is
# never imported. Each process exports under its own service name to one OTLP/HTTP endpoint.
TRACING = {
    "ENABLED": _strict_bool("OTEL_ENABLED", False),
    "ENDPOINT": _url("OTEL_EXPORTER_OTLP_ENDPOINT", "http://127.0.0.1:4318", ("http", "https")),
    "CHUNK_SAMPLE_RATE": _typed("OTEL_CHUNK_SAMPLE_RATE", env.float, 0.01),
    "SERVICE_NAMES": {
        process: env.str(f"OTEL_SERVICE_NAME_{process.upper()}", default=f"streamserve-{process}")
        for process in ("web", "celery", "beat", "worker")
    },
}
if not 0.0 <= TRACING["CHUNK_SAMPLE_RATE"] <= 1.0:
    raise ImproperlyConfigured("Environment variable OTEL_CHUNK_SAMPLE_RATE must be between 0 and 1")

LOG_LEVEL = env.str("LOG_LEVEL", default="INFO").upper()
if LOG_LEVEL not in {"DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL"}:
    raise ImproperlyConfigured(f"Environment variable LOG_LEVEL={LOG_LEVEL!r} is malformed")
LOGGING = {
    "version": 1,
    "disable_existing_loggers": False,
    "formatters": {
        "kv": {"format": "%(asctime)s %(levelname)s %(name)s %(message)s"},
    },
    "handlers": {"console": {"class": "logging.StreamHandler", "formatter": "kv"}},
    "root": {"handlers": ["console"], "level": LOG_LEVEL},
    "loggers": {"django.db.backends": {"level": "WARNING"}},
}
