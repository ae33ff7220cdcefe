"""The kubernetes provisioner against a local HTTP server speaking the Pod API's JSON.

No Kubernetes API server can be run on this machine (no kube-apiserver, kind or k3s package in the
registries we reach), so the official client is pointed at ``FakePodApi`` below: a test fixture
that implements create/list/delete of Pods with the real API's paths, status codes and Status
bodies, and validates every Pod it is sent against the pinned Kubernetes versions' API
(tests/kube_schema.py): 400 for what the schema refuses under ``fieldValidation=Strict`` (unknown
fields, wrong types), 422 for what the API server's validation refuses. What this cannot show
(scheduling, image pulls, RBAC enforcement) is listed in docs/provisioners.md.
"""

from __future__ import annotations

import json
import threading
from datetime import timedelta
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import parse_qs, urlparse

import pytest
import yaml
from django.conf import settings
from django.utils import timezone
from kubernetes import client

from gpu import services as pool_services
from gpu.models import GpuWorker
from gpu.provisioners.base import ProvisionerError
from gpu.provisioners.kubernetes import (
    SELECTOR,
    KubernetesProvisioner,
    load_template,
    worker_pod_manifest,
)
from gpu.services import worker_mark_ready
from tests.kube_schema import KUBERNETES_VERSIONS, problems, rule_problems, schema_problems

pytestmark = pytest.mark.django_db
Status = GpuWorker.Status
DEPLOY = Path(settings.BASE_DIR) / "deploy"


def status_body(code: int, reason: str, message: str) -> dict:
    return {
        "kind": "Status",
        "apiVersion": "v1",
        "status": "Failure",
        "message": message,
        "reason": reason,
        "code": code,
    }


class FakePodApi(ThreadingHTTPServer):
    """Pods in memory under /api/v1/namespaces/<ns>/pods[/<name>]; ``faults`` injects errors."""

    def __init__(self):
        super().__init__(("127.0.0.1", 0), _Handler)
        self.pods: dict[tuple[str, str], dict] = {}
        self.faults: dict[str, tuple[int, str, str]] = {}  # method → (code, reason, message)
        self.calls: list[tuple[str, str]] = []
        self.received: list[dict] = []  # every Pod body POSTed, valid or not
        self.lock = threading.Lock()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}"

    def set_phase(self, name: str, phase: str, **status) -> None:
        with self.lock:
            pod = next(p for (ns, n), p in self.pods.items() if n == name)
            pod["status"] = {"phase": phase, **status}


class _Handler(BaseHTTPRequestHandler):
    server: FakePodApi

    def log_message(self, *args):  # keep test output quiet
        pass

    def _send(self, code: int, body: dict) -> None:
        data = json.dumps(body).encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def _route(self, method: str):
        url = urlparse(self.path)
        self.server.calls.append((method, self.path))
        parts = url.path.strip("/").split("/")
        if parts[:3] != ["api", "v1", "namespaces"] or len(parts) < 5 or parts[4] != "pods":
            return self._send(404, status_body(404, "NotFound", f"no route {url.path}"))
        if method in self.server.faults:
            code, reason, message = self.server.faults[method]
            return self._send(code, status_body(code, reason, message))
        namespace, name = parts[3], (parts[5] if len(parts) > 5 else None)
        with self.server.lock:
            if method == "POST":
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                strict = parse_qs(url.query).get("fieldValidation") == ["Strict"]
                self.server.received.append(body)
                refused = [p for v in KUBERNETES_VERSIONS for p in schema_problems(body, v)]
                if not strict:  # the default (Warn) drops unknown fields; only type errors fail
                    refused = [p for p in refused if "was unexpected" not in p]
                if refused:
                    return self._send(400, status_body(400, "BadRequest", "; ".join(refused)))
                invalid = rule_problems(body)
                if invalid:
                    message = f'Pod "{body["metadata"]["name"]}" is invalid: {"; ".join(invalid)}'
                    return self._send(422, status_body(422, "Invalid", message))
                key = (namespace, body["metadata"]["name"])
                if key in self.server.pods:
                    return self._send(
                        409, status_body(409, "AlreadyExists", f'pods "{key[1]}" already exists')
                    )
                body["metadata"].update(
                    namespace=namespace, uid=f"uid-{key[1]}", creationTimestamp="2026-11-22T00:00:00Z"
                )
                body["status"] = {"phase": "Pending"}
                self.server.pods[key] = body
                return self._send(201, body)
            if method == "GET" and name is None:
                wanted = dict(
                    kv.split("=") for kv in parse_qs(url.query).get("labelSelector", [""])[0].split(",") if kv
                )
                items = [
                    p
                    for (ns, _), p in self.server.pods.items()
                    if ns == namespace
                    and all(p["metadata"].get("labels", {}).get(k) == v for k, v in wanted.items())
                ]
                return self._send(
                    200, {"kind": "PodList", "apiVersion": "v1", "metadata": {}, "items": items}
                )
            if method == "DELETE" and name is not None:
                pod = self.server.pods.pop((namespace, name), None)
                if pod is None:
                    return self._send(404, status_body(404, "NotFound", f'pods "{name}" not found'))
                return self._send(200, pod)
        return self._send(405, status_body(405, "MethodNotAllowed", method))

    def do_POST(self):
        self._route("POST")

    def do_GET(self):
        self._route("GET")

    def do_DELETE(self):
        self._route("DELETE")


@pytest.fixture
def api_server():
    server = FakePodApi()
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield server
    server.shutdown()
    server.server_close()


@pytest.fixture
def provisioner(api_server):
    configuration = client.Configuration()
    configuration.host = api_server.url
    return KubernetesProvisioner(
        api_client=client.ApiClient(configuration),
        namespace="streamserve-test",
        image="registry.example/streamserve:1.2.3",
        secret_name="streamserve-env",
        max_retries=1,
        provision_timeout_s=600,
    )


def test_pod_manifest_from_the_shipped_template():
    pod = worker_pod_manifest(
        load_template(DEPLOY / "worker-pod.yaml"),
        name="ssw-h100-abc123",
        namespace="gpu-ns",
        preset="wan-1.3b",
        gpu_type="h100",
        secret_name="my-secret",
        image="img:7",
    )
    container = pod["spec"]["containers"][0]
    assert pod["metadata"]["name"] == "ssw-h100-abc123" and pod["metadata"]["namespace"] == "gpu-ns"
    assert pod["metadata"]["labels"]["streamserve.io/worker"] == "ssw-h100-abc123"
    assert pod["metadata"]["labels"]["streamserve.io/preset"] == "wan-1.3b"
    selector = dict(kv.split("=") for kv in SELECTOR.split(","))
    assert all(pod["metadata"]["labels"][k] == v for k, v in selector.items())
    assert container["image"] == "img:7"
    assert container["command"] == [
        "python",
        "manage.py",
        "gpuworker",
        "--name",
        "$(POD_NAME)",
        "--device",
        "cuda:0",
        "--preset",
        "wan-1.3b",
        "--gpu-type",
        "h100",
        "--listen-host",
        "$(POD_IP)",
        "--node",
        "$(NODE_NAME)",
    ]
    env = {e["name"]: e for e in container["env"]}
    assert [e["name"] for e in container["env"][:3]] == ["POD_NAME", "POD_IP", "NODE_NAME"]
    assert env["NODE_NAME"]["valueFrom"] == {"fieldRef": {"fieldPath": "spec.nodeName"}}
    assert env["POD_IP"]["valueFrom"] == {"fieldRef": {"fieldPath": "status.podIP"}}
    assert env["POD_NAME"]["valueFrom"] == {"fieldRef": {"fieldPath": "metadata.name"}}
    # Pods run on many nodes: the worker refuses a loopback --listen-host.
    assert env["WORKER_MULTI_HOST"] == {"name": "WORKER_MULTI_HOST", "value": "true"}
    for key in ("DATABASE_URL", "REDIS_URL", "SECRET_KEY"):
        assert env[key]["valueFrom"] == {"secretKeyRef": {"name": "my-secret", "key": key}}
    names = [e["name"] for e in container["env"]]
    assert names.count("DATABASE_URL") == 1 and names.count("WORKER_MULTI_HOST") == 1
    assert container["resources"]["limits"]["nvidia.com/gpu"] == "1"
    assert pod["spec"]["restartPolicy"] == "Never"
    # The body is what the pinned Kubernetes versions' API accepts (tests/kube_schema.py).
    assert problems(pod) == []
    assert "streamserve.io/gpu-type" not in (pod["spec"].get("nodeSelector") or {})


def test_pods_can_be_pinned_to_nodes_of_their_gpu_type():
    pod = worker_pod_manifest(
        load_template(DEPLOY / "worker-pod.yaml"),
        name="ssw-h20-abc123",
        namespace="ns",
        preset="wan-1.3b",
        gpu_type="h20",
        secret_name="s",
        gpu_type_node_label="streamserve.io/gpu-type",
    )
    assert pod["spec"]["nodeSelector"]["streamserve.io/gpu-type"] == "h20"


# A template an operator might point K8S_WORKER_TEMPLATE at: a bare Pod, no env, resources or probes.
MINIMAL_TEMPLATE = {
    "apiVersion": "v1",
    "kind": "Pod",
    "metadata": {"name": "minimal"},
    "spec": {"containers": [{"name": "worker", "image": "streamserve:1"}]},
}

CONFIGURATIONS = {
    "shipped template": {},
    "gpu-type node selector": {"gpu_type_node_label": "streamserve.io/gpu-type"},
    "image override": {"image": "registry.example/streamserve@sha256:" + "0" * 64},
    "encoder stage role": {"stage_role": "E"},
    "decode+commit stage role": {"stage_role": "DC", "gpu_type": "h20"},
    "minimal operator template": {"template": MINIMAL_TEMPLATE},
}


@pytest.mark.parametrize("configuration", sorted(CONFIGURATIONS))
def test_every_pod_the_provisioner_builds_is_valid_for_the_pinned_versions(configuration):
    options = dict(CONFIGURATIONS[configuration])
    template = options.pop("template", None) or load_template(DEPLOY / "worker-pod.yaml")
    options.setdefault("gpu_type", "h100")
    pod = worker_pod_manifest(
        template,
        name="ssw-h100-0a1b2c",
        namespace="streamserve",
        preset="wan-1.3b",
        secret_name="env",
        **options,
    )

    assert problems(pod) == []
    container = pod["spec"]["containers"][0]
    # One GPU per worker Pod, whatever the template asked for.
    assert container["resources"]["requests"]["nvidia.com/gpu"] == "1"
    assert container["resources"]["limits"]["nvidia.com/gpu"] == "1"
    env = {e["name"]: e for e in container["env"]}
    assert env["WORKER_MULTI_HOST"]["value"] == "true"
    assert env["POD_IP"]["valueFrom"]["fieldRef"]["fieldPath"] == "status.podIP"
    if "gpu_type_node_label" in options:
        assert pod["spec"]["nodeSelector"] == {"streamserve.io/gpu-type": options["gpu_type"]}
    if options.get("stage_role"):
        assert container["command"][-2:] == ["--stages", options["stage_role"]]


def test_the_shipped_worker_pod_has_startup_liveness_and_readiness_probes():
    pod = worker_pod_manifest(
        load_template(DEPLOY / "worker-pod.yaml"),
        name="ssw-h100-0a1b2c",
        namespace="streamserve",
        preset="wan-1.3b",
        gpu_type="h100",
        secret_name="env",
    )
    container = pod["spec"]["containers"][0]
    for probe in ("startupProbe", "livenessProbe", "readinessProbe"):
        command = container[probe]["exec"]["command"]
        assert command[:2] == ["sh", "-c"] and "manage.py probe worker" in command[2], probe
    assert "--serving" in container["readinessProbe"]["exec"]["command"][2]


def test_a_new_worker_prefers_the_nodes_whose_host_cache_holds_its_preset(provisioner, settings):
    settings.STREAMSERVE = {**settings.STREAMSERVE, "POOL_HOST_COPIES": 2}
    # given host caches on two nodes (the DaemonSet registers each as its node): one holds a
    # complete copy of wan-1.3b, the other only a copy still loading
    for node, complete in (("gpu-node-3", True), ("gpu-node-4", False)):
        cache = pool_services.host_cache_register(
            name=f"cache-{node}", host=node, address="10.1.0.9", capacity_bytes=8 << 30, pinned=False
        )
        holding = pool_services.host_copy_register(
            cache=cache, model_preset="wan-1.3b", weights_bytes=1 << 30
        )
        if complete:
            pool_services.holding_complete(holding_id=holding.pk, digest="d1", address="10.1.0.9:5000")
    worker = GpuWorker.objects.get(
        pk=provisioner.request(count=1, gpu_type="h100", preset="wan-1.3b").worker_ids[0]
    )

    pod = provisioner.pod_manifest(worker)

    # then its Pod prefers the node with the complete copy, and only that one
    preferred = pod["spec"]["affinity"]["nodeAffinity"]["preferredDuringSchedulingIgnoredDuringExecution"]
    assert preferred == [
        {
            "weight": 100,
            "preference": {
                "matchFields": [{"key": "metadata.name", "operator": "In", "values": ["gpu-node-3"]}]
            },
        }
    ]
    assert problems(pod) == []
    # and a preset no cache holds gets no preference
    worker.model_preset = "tiny"
    assert "affinity" not in provisioner.pod_manifest(worker)["spec"]


def test_the_provisioner_asks_for_strict_field_validation_and_sends_valid_pods(provisioner, api_server):
    provisioner.request(count=2, gpu_type="h100", preset="wan-1.3b")

    posts = [path for method, path in api_server.calls if method == "POST"]
    assert len(posts) == 2 and all("fieldValidation=Strict" in path for path in posts)
    assert len(api_server.received) == 2 and all(problems(body) == [] for body in api_server.received)


def template_file(tmp_path, change) -> Path:
    template = load_template(DEPLOY / "worker-pod.yaml")
    change(template)
    path = tmp_path / "worker-pod.yaml"
    path.write_text(yaml.safe_dump(template))
    return path


def test_a_template_with_a_misspelt_field_is_refused_before_it_is_sent(provisioner, api_server, tmp_path):
    # nodeSelecter: dropped with a warning by an API server under its default (Warn), the Pod would
    # start on any node. The client's own model refuses it first.
    provisioner.template_path = template_file(
        tmp_path, lambda t: t["spec"].update(nodeSelecter={"streamserve.io/gpu-type": "h100"})
    )

    result = provisioner.request(count=1, gpu_type="h100", preset="wan-1.3b")

    assert result.started == [] and len(result.errors) == 1
    assert "the kubernetes client refused the worker Pod template before sending it" in result.errors[0]
    assert "nodeSelecter" in result.errors[0] and "cannot reach" not in result.errors[0]
    assert GpuWorker.objects.get(provider="kubernetes").status == Status.FAILED
    assert api_server.calls == []


def test_a_field_the_oldest_supported_cluster_lacks_is_a_400_not_dropped(provisioner, api_server, tmp_path):
    # spec.schedulingGroup is in the client's API (1.37) but not in 1.35's: a 1.35 API server
    # would drop it under its default; under fieldValidation=Strict it refuses the Pod.
    provisioner.template_path = template_file(
        tmp_path, lambda t: t["spec"].update(schedulingGroup={"podGroupName": "workers"})
    )

    result = provisioner.request(count=1, gpu_type="h100", preset="wan-1.3b")

    assert "400 Bad Request: the worker Pod template has unknown or duplicate fields" in result.errors[0]
    assert "1.35 schema: spec: Additional properties are not allowed ('schedulingGroup'" in result.errors[0]
    assert GpuWorker.objects.get(provider="kubernetes").status == Status.FAILED
    assert api_server.pods == {}


def test_a_template_the_api_server_would_reject_is_a_422_naming_the_field(provisioner, api_server, tmp_path):
    provisioner.template_path = template_file(
        tmp_path, lambda t: t["spec"]["containers"][0]["resources"]["requests"].update(memory="32 GB")
    )

    result = provisioner.request(count=1, gpu_type="h100", preset="wan-1.3b")

    assert "422 Invalid: the worker Pod template is rejected" in result.errors[0]
    assert "resources.requests[memory]: '32 GB'" in result.errors[0]


def test_missing_credentials_are_a_clear_error(db, monkeypatch, tmp_path):
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    monkeypatch.setenv("KUBECONFIG", str(tmp_path / "no-kubeconfig"))
    result = KubernetesProvisioner(namespace="ns").request(count=1, gpu_type="h100")
    assert result.started == [] and "no Kubernetes credentials (in-cluster or kubeconfig)" in result.errors[0]


def test_request_creates_rows_and_pods(provisioner, api_server):
    result = provisioner.request(count=2, gpu_type="h100", preset="wan-1.3b", price_per_hour="2.99")

    assert result.ok and len(result.started) == 2
    workers = GpuWorker.objects.filter(pk__in=result.worker_ids)
    for worker in workers:
        assert (worker.status, worker.provider, worker.device, worker.gpu_type) == (
            Status.PROVISIONING,
            "kubernetes",
            "cuda:0",
            "h100",
        )
        assert worker.external_id == f"streamserve-test/{worker.name}"
        pod = api_server.pods[("streamserve-test", worker.name)]
        assert pod["spec"]["containers"][0]["image"] == "registry.example/streamserve:1.2.3"
        assert pod["spec"]["containers"][0]["command"][8:11] == ["wan-1.3b", "--gpu-type", "h100"]
    assert [m for m, _ in api_server.calls] == ["POST", "POST"]


@pytest.mark.parametrize(
    ("code", "reason", "message", "expected"),
    [
        (
            409,
            "AlreadyExists",
            'pods "x" already exists',
            "409 Conflict: it already exists in namespace streamserve-test",
        ),
        (
            403,
            "Forbidden",
            'pods is forbidden: User "system:serviceaccount:streamserve:default" cannot create resource "pods"',
            "403 Forbidden: the control plane's service account may not create pods in namespace "
            "streamserve-test; apply deploy/rbac.yaml",
        ),
        (500, "InternalError", "etcdserver: request timed out", "the API server failed with 500"),
    ],
)
def test_api_errors_on_create_leave_a_failed_row_and_a_clear_message(
    provisioner, api_server, code, reason, message, expected
):
    api_server.faults["POST"] = (code, reason, message)

    result = provisioner.request(count=1, gpu_type="h100", preset="wan-1.3b")

    assert result.started == [] and len(result.errors) == 1
    assert expected in result.errors[0] and message in result.errors[0]
    worker = GpuWorker.objects.get(provider="kubernetes")
    assert worker.status == Status.FAILED and worker.released_at is not None
    assert json.loads(json.dumps(result.as_dict()))["errors"] == result.errors


def test_a_real_name_collision_is_a_409_from_the_server(provisioner, api_server):
    result = provisioner.request(count=1, gpu_type="h100")
    worker = GpuWorker.objects.get(pk=result.worker_ids[0])
    with pytest.raises(ProvisionerError, match="409 Conflict"):
        provisioner.start(worker)


def test_release_deletes_the_pod_and_marks_released(provisioner, api_server):
    worker = GpuWorker.objects.get(pk=provisioner.request(count=1, gpu_type="h100").worker_ids[0])
    worker_mark_ready(worker=worker)

    result = provisioner.release(worker)

    assert result.ok and "deleted" in result.detail
    assert ("streamserve-test", worker.name) not in api_server.pods
    assert ("DELETE", f"/api/v1/namespaces/streamserve-test/pods/{worker.name}") in [
        (m, p.split("?")[0]) for m, p in api_server.calls
    ]
    assert GpuWorker.objects.get(pk=worker.pk).status == Status.RELEASED


def test_release_of_a_pod_already_gone_still_releases(provisioner, api_server):
    worker = GpuWorker.objects.get(pk=provisioner.request(count=1, gpu_type="h100").worker_ids[0])
    api_server.pods.clear()
    result = provisioner.release(worker)
    assert result.ok and "already gone" in result.detail


def test_release_refused_by_rbac_keeps_the_worker_live_and_billed(provisioner, api_server):
    worker = GpuWorker.objects.get(pk=provisioner.request(count=1, gpu_type="h100").worker_ids[0])
    worker_mark_ready(worker=worker)
    api_server.faults["DELETE"] = (403, "Forbidden", "pods is forbidden")

    result = provisioner.release(worker)

    assert not result.ok and "403 Forbidden" in result.detail and "delete pods" in result.detail
    assert GpuWorker.objects.get(pk=worker.pk).status == Status.READY


def test_reconcile_fails_terminated_pods_and_retries_only_provisioning_ones(provisioner, api_server):
    booting = GpuWorker.objects.get(pk=provisioner.request(count=1, gpu_type="h100").worker_ids[0])
    serving = GpuWorker.objects.get(pk=provisioner.request(count=1, gpu_type="h100").worker_ids[0])
    worker_mark_ready(worker=serving)
    api_server.set_phase(
        booting.name, "Failed",
        containerStatuses=[{
            "name": "worker", "ready": False, "restartCount": 0, "image": "i", "imageID": "",
            "state": {"terminated": {"exitCode": 137, "reason": "OOMKilled"}},
        }],
    )  # fmt: skip
    api_server.set_phase(serving.name, "Succeeded")

    result = provisioner.reconcile()

    reasons = {f.worker.name: f.reason for f in result.failed}
    assert "OOMKilled exit code 137" in reasons[booting.name]
    assert f"pod {serving.name} Succeeded" in reasons[serving.name]
    assert GpuWorker.objects.filter(pk__in=[booting.pk, serving.pk], status=Status.FAILED).count() == 2
    # The failed pods are deleted; only the one that never came up is replaced.
    assert ("streamserve-test", booting.name) not in api_server.pods
    assert len(result.replacements) == 1
    replacement = result.replacements[0].started[0]
    assert ("streamserve-test", replacement.name) in api_server.pods


def test_a_pod_pending_past_the_timeout_fails_with_its_reason_and_retries_are_bounded(
    provisioner, api_server
):
    worker = GpuWorker.objects.get(pk=provisioner.request(count=1, gpu_type="h100").worker_ids[0])
    pending = {
        "conditions": [{"type": "PodScheduled", "status": "False", "reason": "Unschedulable",
                        "message": "0/3 nodes are available: 3 Insufficient nvidia.com/gpu."}],
    }  # fmt: skip
    api_server.set_phase(worker.name, "Pending", **pending)
    assert provisioner.reconcile(worker.requested_at + timedelta(seconds=599)).failed == []

    first = provisioner.reconcile(worker.requested_at + timedelta(seconds=601))
    assert "still provisioning 601s" in first.failed[0].reason
    assert "Insufficient nvidia.com/gpu" in first.failed[0].reason
    assert ("streamserve-test", worker.name) not in api_server.pods  # deleted
    retry = GpuWorker.objects.get(pk=first.replacements[0].worker_ids[0])
    api_server.set_phase(retry.name, "Pending", **pending)

    second = provisioner.reconcile(retry.requested_at + timedelta(seconds=601))
    assert second.replacements == [] and "max retries 1" in second.exhausted[0]
    assert not GpuWorker.objects.filter(provider="kubernetes", status__in=GpuWorker.LIVE_STATUSES).exists()


def test_a_pod_deleted_behind_our_back_fails_its_worker(provisioner, api_server):
    worker = GpuWorker.objects.get(pk=provisioner.request(count=1, gpu_type="h100").worker_ids[0])
    worker_mark_ready(worker=worker)
    api_server.pods.clear()
    result = provisioner.reconcile()
    assert "not found in namespace streamserve-test" in result.failed[0].reason


def test_a_list_error_is_reported_and_only_the_timeout_applies(provisioner, api_server):
    worker = GpuWorker.objects.get(pk=provisioner.request(count=1, gpu_type="h100").worker_ids[0])
    api_server.faults["GET"] = (500, "InternalError", "etcd down")
    result = provisioner.reconcile(timezone.now())
    assert result.failed == [] and "the API server failed with 500" in result.errors[0]
    assert GpuWorker.objects.get(pk=worker.pk).status == Status.PROVISIONING


def test_an_unreachable_api_server_is_a_clear_error(db):
    configuration = client.Configuration()
    configuration.host = "http://127.0.0.1:9"  # discard port: connection refused
    configuration.retries = False
    unreachable = KubernetesProvisioner(api_client=client.ApiClient(configuration), namespace="ns")
    result = unreachable.request(count=1, gpu_type="h100")
    assert "cannot reach the Kubernetes API server" in result.errors[0]


def test_reconcile_lists_pods_once_per_tick_and_deletes_leftovers(provisioner, api_server):
    from gpu.services import worker_fail

    leftover = GpuWorker.objects.get(pk=provisioner.request(count=3, gpu_type="h100").worker_ids[0])
    worker_mark_ready(worker=leftover)
    worker_fail(worker=leftover)  # e.g. the heartbeat timeout; its Pod still runs
    api_server.set_phase(leftover.name, "Running")
    api_server.calls.clear()

    result = provisioner.reconcile(leftover.released_at + timedelta(seconds=31))

    assert [m for m, _ in api_server.calls] == ["GET", "DELETE"]
    assert result.stopped_leftovers == [leftover.name]
    assert ("streamserve-test", leftover.name) not in api_server.pods
    assert result.checked == 2 and result.failed == []
