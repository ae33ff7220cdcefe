"""Health and readiness of every role, against the suite's real PostgreSQL and Redis."""

from __future__ import annotations

import json
import socket
from datetime import timedelta
from io import StringIO
from pathlib import Path

import pytest
import yaml
from celery.signals import before_task_publish
from django.conf import settings
from django.core.management import CommandError, call_command
from django.db import connections
from django.test import Client
from django.utils import timezone

from contracts.health import database_check
from gpu.models import GpuWorker, HostCache
from gpu.provisioners.kubernetes import load_template, worker_pod_manifest
from gpu.services import host_cache_stop
from scheduling import health
from tests.factories import GpuWorkerFactory


def closed_port() -> int:
    """A local port nothing listens on (bound, then released)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def probe(*args: str) -> tuple[int, dict]:
    """Run ``manage.py probe`` in-process: its exit status and its JSON line."""
    out = StringIO()
    try:
        call_command("probe", *args, stdout=out)
        code = 0
    except SystemExit as exc:
        code = int(exc.code or 0)
    return code, json.loads(out.getvalue())


def test_liveness_answers_any_host_without_touching_a_dependency(settings):
    # Given Redis unreachable and a Host that ALLOWED_HOSTS refuses (the kubelet's pod IP)
    settings.REDIS_URL = f"redis://127.0.0.1:{closed_port()}/0"
    # When the kubelet asks /healthz
    response = Client().get("/healthz", HTTP_HOST="10.1.2.3:8000")
    # Then the process answers: liveness never depends on PostgreSQL or Redis
    assert response.status_code == 200
    assert response.json() == {"status": "alive"}


@pytest.mark.django_db
def test_readiness_checks_postgresql_and_redis():
    response = Client().get("/readyz", HTTP_HOST="10.1.2.3:8000")
    assert response.status_code == 200
    body = response.json()
    assert body["status"] == "ready"
    assert {c["name"]: c["ok"] for c in body["checks"]} == {"postgresql": True, "redis": True}


@pytest.mark.django_db
def test_readiness_is_503_naming_redis_when_redis_is_unreachable(settings):
    # Given REDIS_URL pointing at a closed port
    settings.REDIS_URL = f"redis://127.0.0.1:{closed_port()}/0"
    # When the readiness probe runs
    response = Client().get("/readyz")
    # Then the pod is taken out of the Service: 503, and the body says which dependency failed
    assert response.status_code == 503
    checks = {c["name"]: c for c in response.json()["checks"]}
    assert checks["postgresql"]["ok"] is True
    assert checks["redis"]["ok"] is False
    assert "Connection" in checks["redis"]["detail"]


@pytest.mark.django_db
def test_the_database_check_reports_an_unreachable_postgresql(monkeypatch):
    # Given a database alias whose server is a closed port (the test database stays untouched)
    broken = {**connections.databases["default"], "PORT": str(closed_port()), "NAME": "nowhere"}
    monkeypatch.setitem(connections.databases, "unreachable", broken)
    # When the database check runs against it
    check = database_check("unreachable")
    # Then it reports the failure instead of raising
    assert check.ok is False
    assert check.name == "postgresql"
    connections["unreachable"].close()


def test_other_paths_and_methods_pass_through_the_health_middleware():
    # POST /healthz is not a probe: it goes through the normal stack (no such view: 404/405)
    assert Client().post("/healthz").status_code in (403, 404, 405)


@pytest.mark.django_db
def test_probe_web_exits_0_when_ready_and_1_when_redis_is_down(settings):
    code, body = probe("web")
    assert code == 0 and body["healthy"] is True
    settings.REDIS_URL = f"redis://127.0.0.1:{closed_port()}/0"
    code, body = probe("web")
    assert code == 1 and body["healthy"] is False


def test_probe_celery_fails_when_no_worker_answers_the_ping():
    # No Celery worker consumes the suite's broker database under this node name.
    code, body = probe("celery", "--node", "nobody@nowhere", "--timeout", "0.5")
    assert code == 1
    assert "nobody@nowhere did not answer" in body["checks"][0]["detail"]


def test_probe_beat_follows_what_beat_publishes():
    client = health._redis()
    client.delete(health.BEAT_HEARTBEAT_KEY)
    # Given no beat ever published: unhealthy
    code, body = probe("beat")
    assert code == 1 and "no task yet" in body["checks"][0]["detail"]
    # When the process becomes beat and publishes a task
    health.beat_started()
    try:
        before_task_publish.send(sender="scheduling.tasks.scheduler_tick", body=(), headers={})
    finally:
        before_task_publish.disconnect(dispatch_uid="scheduling.health.beat_publish")
    # Then the heartbeat is fresh, and stale past --max-age
    code, _ = probe("beat")
    assert code == 0
    client.set(health.BEAT_HEARTBEAT_KEY, repr(float(client.get(health.BEAT_HEARTBEAT_KEY)) - 300))
    code, body = probe("beat", "--max-age", "60")
    assert code == 1 and "limit 60s" in body["checks"][0]["detail"]
    client.delete(health.BEAT_HEARTBEAT_KEY)


def test_a_process_that_is_not_beat_records_no_heartbeat():
    client = health._redis()
    client.delete(health.BEAT_HEARTBEAT_KEY)
    before_task_publish.send(sender="scheduling.tasks.scheduler_tick", body=(), headers={})
    assert client.get(health.BEAT_HEARTBEAT_KEY) is None


@pytest.mark.django_db
def test_probe_worker_follows_the_heartbeat(settings):
    settings.STREAMSERVE = {**settings.STREAMSERVE, "HEARTBEAT_TIMEOUT_S": 5.0}
    worker = GpuWorkerFactory(status=GpuWorker.Status.READY, last_heartbeat=timezone.now())
    code, _ = probe("worker", worker.name)
    assert code == 0
    GpuWorker.objects.filter(pk=worker.pk).update(last_heartbeat=timezone.now() - timedelta(seconds=30))
    code, body = probe("worker", worker.name)
    assert code == 1 and "limit 5.0s" in body["checks"][0]["detail"]
    GpuWorker.objects.filter(pk=worker.pk).update(
        status=GpuWorker.Status.FAILED, last_heartbeat=timezone.now(), released_at=timezone.now()
    )
    code, body = probe("worker", worker.name)
    assert code == 1 and "failed" in body["checks"][0]["detail"]
    code, body = probe("worker", "no-such-worker")
    assert code == 1


@pytest.mark.django_db
def test_probe_worker_serving_is_healthy_only_while_the_worker_takes_sessions():
    worker = GpuWorkerFactory(status=GpuWorker.Status.PROVISIONING, last_heartbeat=timezone.now())
    # A booting worker is alive (its startup and liveness probes pass) but not ready.
    assert probe("worker", worker.name)[0] == 0
    code, body = probe("worker", worker.name, "--serving")
    assert code == 1 and "provisioning, not serving" in body["checks"][0]["detail"]
    GpuWorker.objects.filter(pk=worker.pk).update(status=GpuWorker.Status.READY)
    assert probe("worker", worker.name, "--serving")[0] == 0
    GpuWorker.objects.filter(pk=worker.pk).update(status=GpuWorker.Status.DRAINING)
    code, body = probe("worker", worker.name, "--serving")
    assert code == 1 and "draining, not serving" in body["checks"][0]["detail"]


@pytest.mark.django_db
def test_probe_hostcache_follows_the_heartbeat_and_the_row():
    cache = HostCache.objects.create(
        name="cache-gpu-node-3", host="gpu-node-3", capacity_bytes=1 << 30, started_at=timezone.now(),
        last_heartbeat=timezone.now(),
    )  # fmt: skip
    assert probe("hostcache", cache.name)[0] == 0
    HostCache.objects.filter(pk=cache.pk).update(last_heartbeat=timezone.now() - timedelta(seconds=90))
    code, body = probe("hostcache", cache.name, "--max-age", "60")
    assert code == 1 and "limit 60.0s" in body["checks"][0]["detail"]
    HostCache.objects.filter(pk=cache.pk).update(last_heartbeat=timezone.now())
    host_cache_stop(cache_id=cache.pk, status=HostCache.Status.LOST)
    code, body = probe("hostcache", cache.name)
    assert code == 1 and "is lost" in body["checks"][0]["detail"]
    code, body = probe("hostcache", "cache-nowhere")
    assert code == 1 and "no host cache named 'cache-nowhere'" in body["checks"][0]["detail"]
    with pytest.raises(CommandError, match="probe hostcache needs the hostcache's NAME"):
        call_command("probe", "hostcache", stdout=StringIO())


def test_probe_serving_is_for_workers_only():
    with pytest.raises(CommandError, match="--serving applies to probe worker only"):
        call_command("probe", "web", "--serving", stdout=StringIO())


def _containers(path: str) -> dict[str, dict]:
    found = {}
    for document in yaml.safe_load_all((Path(settings.BASE_DIR) / "deploy" / path).read_text()):
        if document["kind"] not in ("Deployment", "Pod"):
            continue
        spec = document["spec"]
        pod = spec["template"]["spec"] if "template" in spec else spec
        for container in pod["containers"]:
            found[container["name"]] = container
    return found


def test_the_kubernetes_manifests_probe_each_role_with_these_checks():
    web = _containers("web.yaml")["web"]
    assert web["livenessProbe"]["httpGet"]["path"] == "/healthz"
    assert web["readinessProbe"]["httpGet"]["path"] == "/readyz"
    celery = _containers("celery.yaml")
    assert celery["celery"]["livenessProbe"]["exec"]["command"][2:4] == ["probe", "celery"]
    # the node the probe pings by default is the one the worker is started as
    assert "scheduler@%h" in celery["celery"]["command"]
    assert celery["beat"]["livenessProbe"]["exec"]["command"][2:4] == ["probe", "beat"]
    worker = _containers("worker-pod.yaml")["worker"]
    for probe_kind in ("startupProbe", "livenessProbe", "readinessProbe"):
        assert 'manage.py probe worker "$POD_NAME"' in worker[probe_kind]["exec"]["command"][2]
    assert worker["readinessProbe"]["exec"]["command"][2].endswith("--serving")


def test_worker_pods_built_by_the_provisioner_keep_the_probes_and_the_name_they_read():
    template = load_template(Path(settings.BASE_DIR) / "deploy" / "worker-pod.yaml")
    pod = worker_pod_manifest(
        template, name="ssw-h100-abc123", namespace="ns", preset="wan-1.3b", gpu_type="h100", secret_name="s"
    )
    container = pod["spec"]["containers"][0]
    assert "probe worker" in container["livenessProbe"]["exec"]["command"][2]
    assert any(env["name"] == "POD_NAME" for env in container["env"])
