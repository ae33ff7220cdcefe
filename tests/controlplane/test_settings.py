"""Configuration fails loudly: a malformed environment variable stops the process at start."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def load_settings(expression: str = "settings.DEBUG", **env: str) -> subprocess.CompletedProcess:
    # The settings module is what every process (web, Celery, workers, commands) imports first and
    # where each variable is parsed; loading the apps too (django.setup) checks nothing more here and
    # cost ~0.5 s of CPU a process, 54 times.
    return subprocess.run(
        [
            sys.executable,
            "-c",
            f"from django.conf import settings; print({expression})",
        ],
        cwd=ROOT,
        env={**os.environ, "DJANGO_SETTINGS_MODULE": "controlplane.settings", **env},
        capture_output=True,
        text=True,
        timeout=60,
    )


@pytest.mark.parametrize(
    ("variable", "value"),
    [
        ("DEBUG", "maybe"),
        ("DATABASE_URL", "mysql-ish://nowhere"),
        ("REDIS_URL", "http://127.0.0.1:6379"),
        ("CHUNK_RETENTION_DAYS", "two weeks"),
        ("HEARTBEAT_INTERVAL_S", "fast"),
        ("LOG_LEVEL", "LOUD"),
        ("PROVISION_TIMEOUT_S", "soon"),
        ("LOCAL_MAX_CPU_WORKERS", "four"),
        ("GPU_PRICES", "h100=lots"),
        ("GPU_PRICES", "h100"),
        ("GPU_PRICES", "h100=-1"),
        ("PORT", "eighty"),
        ("API_THROTTLE_USER", "lots"),
        ("API_THROTTLE_ANON", "5/fortnight"),
        ("API_SCHEMA_ACCESS", "everyone"),
        ("METRICS_ENABLED", "sometimes"),
        ("MAX_LIVE_SESSIONS_PER_USER", "0"),
        ("POOL_HOST_COPIES", "0"),
        ("POOL_HOST_COPIES", "one"),
        ("HOSTCACHE_CAPACITY_MB", "0"),
        ("WORKER_WEIGHTS_FROM", "nvme"),
        ("REGION_MOVES_PER_SLOT", "-1"),
        ("REGION_WAN_GBPS", "0"),
        ("REGION_WAN_GBPS_PAIRS", '{"east": 1}'),
        ("REGION_WAN_GBPS_PAIRS", '{"east:west": -1}'),
        ("REGION_MOVE_HORIZON_S", "forever"),
        ("REGION_MOVE_COOLDOWN_S", "-5"),
        ("SESSION_VIEWER_GRACE_S", "-1"),
        ("SESSION_VIEWER_GRACE_S", "half a minute"),
        ("SESSION_IDLE_TIMEOUT_S", "-0.5"),
        ("REGION_MIN_GPUS", '{"east": 0.5}'),
        ("REGION_MIN_GPUS", "[1]"),
        ("MAX_JOBS_IN_FLIGHT_PER_USER", "0"),
        ("TENANT_FAIR_SHARE_WINDOW_S", "0"),
        ("TENANT_FAIR_SHARE_WINDOW_S", "hourly"),
        ("JOB_DEFAULT_SLO_S", "0"),
        ("OPENAI_API_ANONYMOUS", "sure"),
        ("OPENAI_IMAGES_TIMEOUT_S", "0"),
        ("OPENAI_IMAGES_TIMEOUT_S", "7200"),
        ("STORAGES_DEFAULT_OPTIONS", "{not json"),
        ("STORAGES_DEFAULT_OPTIONS", "[1, 2]"),
        ("WEBRTC_ICE_SERVERS", "stun:stun.example.org"),
        ("WEBRTC_ICE_SERVERS", '{"urls": "stun:stun.example.org"}'),
        ("WEBRTC_ICE_SERVERS", '[{"urls": "http://stun.example.org"}]'),
        ("WEBRTC_ICE_SERVERS", '[{"urls": ["turn:turn.example.org:3478"]}]'),
        ("WEBRTC_ICE_SERVERS", '[{"urls": "stun:a", "password": "x"}]'),
        ("WEBRTC_MEDIA", "gpu"),
        ("WEBRTC_MEDIA_ANSWER_TIMEOUT_S", "0"),
        ("SPARE_POLICY", "always"),
        ("SPARE_MARGIN_Z", "wide"),
        ("SPARE_MARGIN_Z", "-1"),
        ("SPARE_MIN_SESSIONS", "-2"),
        ("OTEL_ENABLED", "maybe"),
        ("OTEL_EXPORTER_OTLP_ENDPOINT", "grpc://collector:4317"),
        ("OTEL_CHUNK_SAMPLE_RATE", "1.5"),
        ("OTEL_CHUNK_SAMPLE_RATE", "often"),
    ],
)
def test_malformed_variable_fails_at_start_naming_it(variable, value):
    result = load_settings(**{variable: value})
    assert result.returncode != 0
    assert "ImproperlyConfigured" in result.stderr
    assert variable in result.stderr


def test_secret_key_is_required_when_debug_is_off():
    result = load_settings("__import__('controlplane.asgi')", DEBUG="false", SECRET_KEY="")
    assert result.returncode != 0 and "SECRET_KEY must be set" in result.stderr
    assert load_settings(DEBUG="false", SECRET_KEY="s3cret").stdout.strip() == "False"


def test_debug_is_off_unless_asked_for():
    """A production 500 must never show settings: DEBUG defaults to off, so a SECRET_KEY is needed."""
    environment = {k: v for k, v in os.environ.items() if k not in {"DEBUG", "SECRET_KEY"}}

    def run(code: str) -> subprocess.CompletedProcess:
        return subprocess.run(
            [sys.executable, "-c", code],
            cwd=ROOT,
            env={**environment, "DJANGO_SETTINGS_MODULE": "controlplane.settings"},
            capture_output=True,
            text=True,
            timeout=60,
        )

    # The web server refuses to start without a key …
    served = run("import controlplane.asgi")
    assert served.returncode != 0 and "SECRET_KEY must be set when DEBUG is off" in served.stderr
    # … and nothing can sign with the empty one, while commands that sign nothing still run.
    signing = run("import django; django.setup(); from django.core import signing; signing.dumps(1)")
    assert signing.returncode != 0 and "SECRET_KEY" in signing.stderr
    assert (
        run(
            "import django; django.setup(); from django.conf import settings; print(settings.DEBUG)"
        ).stdout.strip()
        == "False"
    )
    assert load_settings().stdout.strip() == "False"  # the test run's SECRET_KEY (pytest-env)


def test_the_development_runner_turns_debug_on():
    """`make run` (and its migrate step) run with DEBUG on unless the environment says otherwise."""
    environment = {k: v for k, v in os.environ.items() if k != "DEBUG"}
    database = subprocess.run(
        ["make", "-n", "-p", "run"], cwd=ROOT, env=environment, capture_output=True, text=True, timeout=60
    ).stdout
    assert "run: DEBUG = true" in database and "migrate: DEBUG = true" in database


def test_defaults_work_on_this_machine():
    result = load_settings(DEBUG="true", SECRET_KEY="")
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "True"


def test_every_variable_is_read_into_settings_once():
    result = load_settings(
        "settings.STREAMSERVE['GPU_PRICES'], settings.STREAMSERVE['METRICS_TOKEN'], "
        "settings.STREAMSERVE['K8S_NAMESPACE'], settings.STREAMSERVE['PORT'], "
        "settings.STREAMSERVE['PROVISION_TIMEOUT_S']",
        GPU_PRICES="cpu=0.10,h100=2.99",
        METRICS_TOKEN="from-env",
        POD_NAMESPACE="pods-here",
        PORT="9000",
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == (
        "{'cpu': Decimal('0.10'), 'h100': Decimal('2.99')} from-env pods-here 9000 None"
    )
    explicit = load_settings(
        "settings.STREAMSERVE['K8S_NAMESPACE']", POD_NAMESPACE="pods", K8S_NAMESPACE="gpus"
    )
    assert explicit.stdout.strip() == "gpus"


def test_webrtc_ice_servers_are_read_as_rtc_ice_servers():
    servers = '[{"urls": "stun:stun.example.org:3478"}, {"urls": ["turn:t.example.org"], "username": "u", "credential": "c"}]'
    result = load_settings("settings.STREAMSERVE['WEBRTC_ICE_SERVERS']", WEBRTC_ICE_SERVERS=servers)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == (
        "[{'urls': 'stun:stun.example.org:3478'}, "
        "{'urls': ['turn:t.example.org'], 'username': 'u', 'credential': 'c'}]"
    )
    assert load_settings("settings.STREAMSERVE['WEBRTC_ICE_SERVERS']").stdout.strip() == "[]"
