"""``kubernetes``: one worker Pod per GPU worker, through the official ``kubernetes`` client.

The Pod comes from a template manifest (``deploy/worker-pod.yaml`` unless ``K8S_WORKER_TEMPLATE``
names another) with, per worker: the worker's name as Pod name, selection labels, the command
``python manage.py gpuworker --name $(POD_NAME) --device cuda:0 --preset P --gpu-type T
--listen-host $(POD_IP) --node $(NODE_NAME)``, ``POD_NAME``/``POD_IP``/``NODE_NAME`` from the
downward API, ``DATABASE_URL`` / ``REDIS_URL`` / ``SECRET_KEY`` from a Secret, one
``nvidia.com/gpu``, and a preference for the nodes whose host cache holds the preset.
``restartPolicy: Never``: a worker that dies is replaced by the scheduler (its sessions have
moved), never restarted in place under the same identity. Pods are created with
``fieldValidation=Strict``: a field the cluster does not know is refused, not dropped.

``external_id`` is ``<namespace>/<pod name>``. ``reconcile`` lists this backend's Pods once per
tick by label: a missing Pod or phase ``Failed``/``Succeeded`` fails the worker; ``Pending`` past
the provisioning timeout fails it too, with the waiting reason (``ImagePullBackOff``,
``Unschedulable``…) in the report, and its Pod is deleted.

Credentials: in-cluster service account when ``KUBERNETES_SERVICE_HOST`` is set, else the local
kubeconfig; tests pass an ``api_client``. API errors become ``ProvisionerError`` with the status and
what to do about it.
"""

from __future__ import annotations

import copy
import json
import logging
import os
from pathlib import Path
from typing import Any

import urllib3
import yaml
from django.conf import settings

from gpu import selectors as pool_selectors
from gpu.models import GpuWorker, WeightHolding
from gpu.provisioners.base import Probe, Provisioner, ProvisionerError, WorkerSpec, new_worker_name

logger = logging.getLogger("gpu.provisioners")

GPU_RESOURCE = "nvidia.com/gpu"
COMPONENT_LABEL = "app.kubernetes.io/component"
MANAGED_BY_LABEL = "app.kubernetes.io/managed-by"
WORKER_LABEL = "streamserve.io/worker"
SECRET_KEYS = ("DATABASE_URL", "REDIS_URL", "SECRET_KEY")
SELECTOR = f"{COMPONENT_LABEL}=gpu-worker,{MANAGED_BY_LABEL}=streamserve"


def default_template_path() -> Path:
    return Path(settings.BASE_DIR) / "deploy" / "worker-pod.yaml"


def load_template(path: Path | str) -> dict[str, Any]:
    try:
        template = yaml.safe_load(Path(path).read_text())
    except (OSError, yaml.YAMLError) as exc:
        raise ProvisionerError(f"cannot read the worker Pod template {path}: {exc}") from exc
    if (
        not isinstance(template, dict)
        or template.get("kind") != "Pod"
        or not template.get("spec", {}).get("containers")
    ):
        raise ProvisionerError(f"the worker Pod template {path} is not a Pod manifest with a container")
    return template


def worker_pod_manifest(
    template: dict[str, Any],
    *,
    name: str,
    namespace: str,
    preset: str,
    gpu_type: str,
    secret_name: str,
    image: str = "",
    gpu_type_node_label: str = "",
    stage_role: str = "EDC",
    host_cache_nodes: list[str] | tuple[str, ...] = (),
) -> dict[str, Any]:
    """The Pod body for one worker: the template with this worker's identity and command
    (``--stages`` when its stage role is not the whole pipeline, docs/stages.md).

    With ``gpu_type_node_label`` (e.g. ``streamserve.io/gpu-type``), the Pod is pinned to nodes
    labelled with its GPU type, for heterogeneous pools. ``host_cache_nodes``: the nodes whose host
    cache (deploy/hostcache.yaml) holds a complete copy of the preset; the Pod prefers them, so its
    weights come from host memory on its own machine (BlitzScale §5.3) when one has a free GPU.
    """
    pod = copy.deepcopy(template)
    metadata = pod.setdefault("metadata", {})
    metadata["name"] = name
    metadata["namespace"] = namespace
    metadata.setdefault("labels", {}).update(
        {
            "app.kubernetes.io/name": "streamserve",
            COMPONENT_LABEL: "gpu-worker",
            MANAGED_BY_LABEL: "streamserve",
            WORKER_LABEL: name,
            "streamserve.io/gpu-type": gpu_type,
            "streamserve.io/preset": preset,
        }
    )
    spec = pod["spec"]
    spec["restartPolicy"] = "Never"
    if gpu_type_node_label:
        spec.setdefault("nodeSelector", {})[gpu_type_node_label] = gpu_type
    if host_cache_nodes:
        # matchFields on metadata.name: the node's name itself, which the cache registers as its
        # host (hostcache --node $(NODE_NAME)); the kubernetes.io/hostname label may differ from it.
        preferred = spec.setdefault("affinity", {}).setdefault("nodeAffinity", {})
        preferred.setdefault("preferredDuringSchedulingIgnoredDuringExecution", []).append(
            {
                "weight": 100,
                "preference": {
                    "matchFields": [
                        {"key": "metadata.name", "operator": "In", "values": sorted(set(host_cache_nodes))}
                    ]
                },
            }
        )
    container = spec["containers"][0]
    if image:
        container["image"] = image
    # --listen-host: peers reach this worker's migration listener at the Pod IP (ephemeral ports).
    # --node: the scale planner's host is the node (a Pod's hostname is the Pod's own name), the
    # same the node's host cache registers, so a copy in its memory counts as on this machine.
    container["command"] = [
        "python", "manage.py", "gpuworker", "--name", "$(POD_NAME)", "--device", "cuda:0", "--preset", preset,
        "--gpu-type", gpu_type, "--listen-host", "$(POD_IP)", "--node", "$(NODE_NAME)",
    ] + (["--stages", stage_role] if stage_role != "EDC" else [])  # fmt: skip
    env = [
        e
        for e in container.get("env", [])
        if e.get("name") not in {"POD_NAME", "POD_IP", "NODE_NAME", "WORKER_MULTI_HOST", *SECRET_KEYS}
    ]
    # $(VAR) in the command expands only variables defined in env.
    env[:0] = [
        {"name": "POD_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
        {"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}},
        {"name": "NODE_NAME", "valueFrom": {"fieldRef": {"fieldPath": "spec.nodeName"}}},
        # Pods land on many nodes: a worker refuses a loopback --listen-host (gpuworker).
        {"name": "WORKER_MULTI_HOST", "value": "true"},
    ]
    for key in SECRET_KEYS:
        env.append({"name": key, "valueFrom": {"secretKeyRef": {"name": secret_name, "key": key}}})
    container["env"] = env
    resources = container.setdefault("resources", {})
    resources.setdefault("limits", {})[GPU_RESOURCE] = "1"
    resources.setdefault("requests", {})[GPU_RESOURCE] = "1"
    return pod


def _api_message(exc: Exception) -> str:
    body = getattr(exc, "body", None)
    if body:
        try:
            return str(json.loads(body).get("message") or body)[:500]
        except (ValueError, AttributeError):
            return str(body)[:500]
    return str(getattr(exc, "reason", "") or exc)


def explain_api_error(exc: Exception, *, verb: str, what: str, namespace: str) -> str:
    """An operator-readable message for a failed API call, saying what to do about it."""
    status = getattr(exc, "status", None)
    message = _api_message(exc)
    if status == 409:
        return f"{verb} {what}: 409 Conflict: it already exists in namespace {namespace} ({message})"
    if status == 403:
        return (
            f"{verb} {what}: 403 Forbidden: the control plane's service account may not {verb} pods in "
            f"namespace {namespace}; apply deploy/rbac.yaml ({message})"
        )
    if status == 401:
        return f"{verb} {what}: 401 Unauthorized: the Kubernetes credentials were rejected ({message})"
    if status == 404:
        return (
            f"{verb} {what}: 404 Not Found in namespace {namespace}; apply deploy/namespace.yaml ({message})"
        )
    if status == 400:
        return f"{verb} {what}: 400 Bad Request: the worker Pod template has unknown or duplicate fields ({message})"
    if status == 422:
        return f"{verb} {what}: 422 Invalid: the worker Pod template is rejected ({message})"
    if status is not None and status >= 500:
        return f"{verb} {what}: the API server failed with {status} {getattr(exc, 'reason', '')} ({message}); try again later"
    if status is not None:
        return f"{verb} {what}: API status {status} ({message})"
    if isinstance(exc, (ValueError, TypeError)) and not isinstance(exc, urllib3.exceptions.HTTPError):
        # The client (>= 37) checks the body against its own model of the API before sending it:
        # an unknown field or a wrong type in the worker Pod template never reaches the server.
        return (
            f"{verb} {what}: the kubernetes client refused the worker Pod template before sending it: {exc}"
        )
    return f"{verb} {what}: cannot reach the Kubernetes API server: {type(exc).__name__}: {exc}"


def _pod_detail(pod: Any) -> str:
    """Why a Pod is where it is: phase plus the first waiting/terminated reason or condition."""
    status = pod.status
    phase = (status.phase if status else None) or "Unknown"
    reasons: list[str] = []
    for cs in (status.container_statuses or []) if status else []:
        state = cs.state
        if state and state.terminated:
            t = state.terminated
            reasons.append(
                f"container {cs.name} terminated: {t.reason or ''} exit code {t.exit_code}".strip()
            )
        elif state and state.waiting and state.waiting.reason:
            reasons.append(
                f"container {cs.name} waiting: {state.waiting.reason} {state.waiting.message or ''}".strip()
            )
    for condition in (status.conditions or []) if status else []:
        if condition.status == "False" and condition.reason:
            reasons.append(f"{condition.type} {condition.reason}: {condition.message or ''}".strip())
    if status and status.reason:
        reasons.append(status.reason)
    return f"pod {pod.metadata.name} {phase}" + (f": {'; '.join(reasons)}" if reasons else "")


class KubernetesProvisioner(Provisioner):
    name = "kubernetes"
    # Image pull (gigabytes) + weights + model load on a fresh node.
    default_timeout_s = 600.0

    def __init__(
        self,
        *,
        api_client: Any = None,
        namespace: str | None = None,
        template_path: Path | str | None = None,
        image: str | None = None,
        secret_name: str | None = None,
        default_gpu_type: str | None = None,
        stop_grace_s: int | None = None,
        gpu_type_node_label: str | None = None,
        **options: Any,
    ) -> None:
        super().__init__(**options)
        conf = settings.STREAMSERVE
        self.gpu_type_node_label = (
            gpu_type_node_label if gpu_type_node_label is not None else conf["K8S_GPU_TYPE_NODE_LABEL"]
        )
        self.namespace = namespace or conf["K8S_NAMESPACE"]
        self.template_path = Path(template_path or conf["K8S_WORKER_TEMPLATE"] or default_template_path())
        self.image = image if image is not None else conf["K8S_WORKER_IMAGE"]
        self.secret_name = secret_name or conf["K8S_SECRET_NAME"]
        self.default_gpu_type = default_gpu_type or conf["K8S_GPU_TYPE"]
        self.stop_grace_s = int(stop_grace_s if stop_grace_s is not None else conf["K8S_STOP_GRACE_S"])
        self._api_client = api_client
        self._core: Any = None

    @property
    def core(self) -> Any:
        if self._core is None:
            from kubernetes import client, config

            api_client = self._api_client
            if api_client is None:
                try:
                    # A runtime fact, not configuration: Kubernetes sets it in every Pod, so its
                    # presence says the control plane runs in-cluster and has a service account.
                    if os.environ.get("KUBERNETES_SERVICE_HOST"):
                        config.load_incluster_config()
                    else:
                        config.load_kube_config()
                except Exception as exc:  # the client raises ConfigException and plain OSErrors
                    raise ProvisionerError(
                        f"no Kubernetes credentials (in-cluster or kubeconfig): {exc}"
                    ) from exc
                api_client = client.ApiClient()
            self._core = client.CoreV1Api(api_client)
        return self._core

    def pod_manifest(self, worker: GpuWorker) -> dict[str, Any]:
        return worker_pod_manifest(
            load_template(self.template_path),
            name=worker.name,
            namespace=self.namespace,
            preset=worker.model_preset,
            gpu_type=worker.gpu_type,
            secret_name=self.secret_name,
            image=self.image,
            gpu_type_node_label=self.gpu_type_node_label,
            stage_role=worker.stage_role,
            host_cache_nodes=[
                source["host"]
                for source in pool_selectors.weight_sources(model_preset=worker.model_preset)
                if source["kind"] == WeightHolding.Kind.HOST
            ],
        )

    def plan(self, *, count: int, gpu_type: str | None, preset: str) -> tuple[list[WorkerSpec], str]:
        # The cluster's capacity is the cluster's business: Pods that cannot be scheduled stay
        # Pending and fail at the provisioning timeout with the scheduler's reason.
        chosen = gpu_type or self.default_gpu_type
        specs = [
            WorkerSpec(
                name=new_worker_name("ssw", chosen),
                device="cuda:0",
                device_index=0,
                gpu_type=chosen,
                host=self.namespace,
            )
            for _ in range(count)
        ]
        return specs, ""

    def start(self, worker: GpuWorker) -> str:
        body = self.pod_manifest(worker)
        try:
            # Strict: an unknown field in the template (a misspelt nodeSelector, say) is refused
            # with 400 instead of being dropped with a warning, the API server's default.
            self.core.create_namespaced_pod(namespace=self.namespace, body=body, field_validation="Strict")
        except ProvisionerError:
            raise
        except Exception as exc:
            raise ProvisionerError(
                explain_api_error(exc, verb="create", what=f"pod {worker.name}", namespace=self.namespace)
            ) from exc
        return f"{self.namespace}/{worker.name}"

    def _pod_name(self, worker: GpuWorker) -> tuple[str, str]:
        namespace, _, name = (worker.external_id or f"{self.namespace}/{worker.name}").rpartition("/")
        return namespace or self.namespace, name

    def stop(self, worker: GpuWorker) -> str:
        namespace, name = self._pod_name(worker)
        try:
            self.core.delete_namespaced_pod(
                name=name, namespace=namespace, grace_period_seconds=self.stop_grace_s
            )
        except ProvisionerError:
            raise
        except Exception as exc:
            if getattr(exc, "status", None) == 404:
                return f"pod {name} was already gone"
            raise ProvisionerError(
                explain_api_error(exc, verb="delete", what=f"pod {name}", namespace=namespace)
            ) from exc
        return f"pod {name} deleted (grace {self.stop_grace_s}s)"

    def probe(self, workers: list[GpuWorker]) -> dict[int, Probe]:
        try:
            listing = self.core.list_namespaced_pod(namespace=self.namespace, label_selector=SELECTOR)
        except ProvisionerError:
            raise
        except Exception as exc:
            raise ProvisionerError(
                explain_api_error(exc, verb="list", what="worker pods", namespace=self.namespace)
            ) from exc
        pods = {pod.metadata.name: pod for pod in listing.items}
        probes: dict[int, Probe] = {}
        for worker in workers:
            _, name = self._pod_name(worker)
            pod = pods.get(name)
            if pod is None:
                probes[worker.pk] = Probe(False, f"pod {name} not found in namespace {self.namespace}")
                continue
            if pod.metadata.deletion_timestamp is not None:
                probes[worker.pk] = Probe(False, f"pod {name} is being deleted (evicted or deleted by hand)")
                continue
            phase = pod.status.phase if pod.status else None
            detail = _pod_detail(pod)
            probes[worker.pk] = Probe(
                phase not in ("Failed", "Succeeded"), detail if phase != "Running" else ""
            )
        return probes
