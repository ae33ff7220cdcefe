"""Every manifest in deploy/ against the API of the pinned Kubernetes versions (tests/kube_schema.py).

There is no kustomize binary here: each resource file is validated as it is and again as
``kubectl apply -k deploy/`` would send it (kustomization's ``namespace`` set on each namespaced
object), and the kustomization is checked to list every file that is meant to be applied.
"""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import yaml
from django.conf import settings
from kubernetes import client
from kubernetes.utils import parse_quantity

from tests.kube_schema import KUBERNETES_VERSIONS, problems, schema_problems

DEPLOY = Path(settings.BASE_DIR) / "deploy"
# Not applied by the kustomization: the provisioner's Pod template (K8S_WORKER_TEMPLATE) and the
# Secret every Pod reads, which the operator fills in and applies by hand (never committed filled).
NOT_APPLIED = {"worker-pod.yaml", "secret.example.yaml"}
CLUSTER_SCOPED = {"Namespace", "ClusterRole", "ClusterRoleBinding"}


def kustomization() -> dict:
    return yaml.safe_load((DEPLOY / "kustomization.yaml").read_text())


def documents(filename: str) -> list[dict]:
    return [d for d in yaml.safe_load_all((DEPLOY / filename).read_text()) if d]


def assembled() -> list[dict]:
    """The objects ``kubectl apply -k deploy/`` sends: the listed files, in order, with the
    kustomization's namespace set on every namespaced object."""
    namespace = kustomization()["namespace"]
    objects = []
    for filename in kustomization()["resources"]:
        for document in documents(filename):
            document = copy.deepcopy(document)
            if document["kind"] not in CLUSTER_SCOPED:
                document["metadata"]["namespace"] = namespace
            objects.append(document)
    return objects


RESOURCE_FILES = sorted(p.name for p in DEPLOY.glob("*.yaml") if p.name != "kustomization.yaml")


@pytest.mark.parametrize("filename", RESOURCE_FILES)
def test_every_document_of_every_file_is_valid_for_the_pinned_versions(filename):
    docs = documents(filename)
    assert docs, filename
    for document in docs:
        assert problems(document) == [], (filename, document["kind"], document["metadata"].get("name"))


def test_the_kustomization_lists_every_file_meant_to_be_applied():
    listed = kustomization()["resources"]
    assert sorted(listed) == sorted(set(RESOURCE_FILES) - NOT_APPLIED)
    assert len(listed) == len(set(listed))
    # The Namespace goes first, the Job that migrates before the Deployments that need the schema.
    assert listed[0] == "namespace.yaml"
    assert listed.index("migrate-job.yaml") < listed.index("web.yaml")


def test_the_assembled_objects_are_valid_unique_and_refer_to_each_other():
    objects = assembled()
    for obj in objects:
        assert problems(obj) == [], (obj["kind"], obj["metadata"]["name"])
    keys = [(o["kind"], o["metadata"]["name"]) for o in objects]
    assert len(keys) == len(set(keys))
    present = set(keys) | {(d["kind"], d["metadata"]["name"]) for d in documents("secret.example.yaml")}
    pod_specs = [o["spec"]["template"]["spec"] for o in objects if "template" in o.get("spec", {})]
    pod_specs += [d["spec"] for d in documents("worker-pod.yaml")]
    for spec in pod_specs:
        if "serviceAccountName" in spec:
            assert ("ServiceAccount", spec["serviceAccountName"]) in present
        for container in spec["containers"]:
            for source in container.get("envFrom", []):
                ref_kind, ref = next((k, v) for k, v in source.items() if k.endswith("Ref"))
                kind = {"configMapRef": "ConfigMap", "secretRef": "Secret"}[ref_kind]
                assert (kind, ref["name"]) in present, ref
            for var in container.get("env", []):
                secret = (var.get("valueFrom") or {}).get("secretKeyRef")
                if secret:
                    assert ("Secret", secret["name"]) in present
    # The Service routes to the web Pods; the RoleBinding grants an existing Role to existing accounts.
    for service in (o for o in objects if o["kind"] == "Service"):
        assert any(
            o["kind"] == "Deployment"
            and service["spec"]["selector"].items() <= o["spec"]["template"]["metadata"]["labels"].items()
            for o in objects
        ), service["metadata"]["name"]
    for binding in (o for o in objects if o["kind"] == "RoleBinding"):
        assert ("Role", binding["roleRef"]["name"]) in present
        assert all(("ServiceAccount", s["name"]) in present for s in binding["subjects"])


def test_the_provisioner_role_allows_what_the_provisioner_does_with_pods():
    objects = assembled()
    role = next(o for o in objects if o["kind"] == "Role")
    pod_rule = next(r for r in role["rules"] if "pods" in r["resources"])
    assert {"create", "delete", "list", "get"} <= set(pod_rule["verbs"])
    binding = next(o for o in objects if o["kind"] == "RoleBinding")
    scheduler = next(o for o in objects if o["metadata"]["name"] == "streamserve-scheduler")
    bound = {s["name"] for s in binding["subjects"]}
    assert scheduler["spec"]["template"]["spec"]["serviceAccountName"] in bound


# --- the check fails on broken manifests ---------------------------------------------------------


def worker_pod() -> dict:
    return documents("worker-pod.yaml")[0]


def container_of(pod: dict) -> dict:
    return pod["spec"]["containers"][0]


BROKEN = {
    "unknown field": (
        lambda p: container_of(p).update(imagePullPolcy="Always"),
        "'imagePullPolcy' was unexpected",
    ),
    "wrong type": (
        lambda p: p["spec"].update(terminationGracePeriodSeconds="thirty"),
        "spec.terminationGracePeriodSeconds: 'thirty' is not of type 'integer'",
    ),
    "missing required field": (
        lambda p: container_of(p).pop("name"),
        "'name' is a required property",
    ),
    "an API version without the kind": (
        lambda p: p.update(apiVersion="apps/v1"),
        "no kind 'Pod' in API version 'apps/v1'",
    ),
    "bad quantity": (
        lambda p: container_of(p)["resources"]["requests"].update(memory="32 GB"),
        "resources.requests[memory]: '32 GB'",
    ),
    "request over its limit": (
        lambda p: container_of(p)["resources"]["requests"].update(memory="128Gi"),
        "is more than its limit",
    ),
    "GPU request without an equal limit": (
        lambda p: container_of(p)["resources"]["limits"].update({"nvidia.com/gpu": "2"}),
        "extended resource nvidia.com/gpu needs a limit equal to its request",
    ),
    "restart policy": (
        lambda p: p["spec"].update(restartPolicy="Sometimes"),
        "spec.restartPolicy: 'Sometimes' not allowed",
    ),
    "undefined $(VAR)": (
        lambda p: container_of(p)["command"].extend(["--node", "$(NODE)"]),
        "$(NODE) is not defined in env",
    ),
    "probe with two handlers": (
        lambda p: container_of(p)["livenessProbe"].update(tcpSocket={"port": 8000}),
        "livenessProbe: exactly one handler needed",
    ),
    "unsupported downward field": (
        lambda p: container_of(p)["env"][0]["valueFrom"]["fieldRef"].update(fieldPath="spec.nodeIP"),
        "'spec.nodeIP' is not supported",
    ),
    "invalid name": (lambda p: p["metadata"].update(name="Worker_1"), "'Worker_1' is not a valid Pod name"),
    "invalid label value": (
        lambda p: p["metadata"]["labels"].update({"streamserve.io/preset": "wan 1.3b"}),
        "invalid value 'wan 1.3b'",
    ),
}


@pytest.mark.parametrize("case", sorted(BROKEN))
def test_the_check_rejects_a_broken_manifest_naming_the_field(case):
    pod = worker_pod()
    assert problems(pod) == []
    breaks, expected = BROKEN[case]
    breaks(pod)
    found = problems(pod)
    assert any(expected in p for p in found), found


def test_the_clients_models_know_one_version_and_none_of_the_api_servers_rules():
    # The official client (the provisioner sends through it) models its own API version: a field of
    # 1.37 passes it, though a 1.35 cluster does not have it, and so does a quantity no API server
    # accepts. The pinned check refuses both.
    pod = worker_pod()
    pod["spec"]["schedulingGroup"] = {"podGroupName": "workers"}
    container_of(pod)["resources"]["requests"]["memory"] = "32 GB"
    model = client.ApiClient()._ApiClient__deserialize(pod, "V1Pod")
    assert model.spec.scheduling_group.pod_group_name == "workers"
    assert model.spec.containers[0].resources.requests["memory"] == "32 GB"
    assert "'schedulingGroup' was unexpected" in problems(pod)[0]
    del pod["spec"]["schedulingGroup"]
    assert "resources.requests[memory]: '32 GB'" in problems(pod)[0]


def test_each_pinned_version_rejects_a_field_the_other_lacks():
    # Alpha scheduling fields changed between them: 1.35's spec.workloadRef became 1.37's
    # spec.schedulingGroup. A manifest must hold for the oldest and the newest cluster we support.
    oldest, newest = KUBERNETES_VERSIONS[0], KUBERNETES_VERSIONS[-1]
    newer = worker_pod()
    newer["spec"]["schedulingGroup"] = {}
    assert schema_problems(newer, newest) == []
    assert "'schedulingGroup' was unexpected" in schema_problems(newer, oldest)[0]
    removed = worker_pod()
    removed["spec"]["workloadRef"] = {}
    assert "'workloadRef' was unexpected" in schema_problems(removed, newest)[0]


# --- the parameter pool's host cache on every GPU node -------------------------------------------


def config() -> dict[str, str]:
    return documents("configmap.yaml")[0]["data"]


def test_the_host_cache_runs_on_every_gpu_node_without_taking_a_gpu():
    daemonset = documents("hostcache.yaml")[0]
    assert daemonset["kind"] == "DaemonSet"
    spec = daemonset["spec"]["template"]["spec"]
    worker = worker_pod()["spec"]
    # Scheduled where the workers are: the GPU nodes' taint tolerated like theirs.
    assert spec["tolerations"] == worker["tolerations"]
    assert spec["nodeSelector"] == {"nvidia.com/gpu.present": "true"}
    container = spec["containers"][0]
    resources = container["resources"]
    assert not any("gpu" in name for part in resources.values() for name in part)
    # Its memory bound fits under its limit, with room for the interpreter and torch.
    limit = parse_quantity(resources["limits"]["memory"])
    assert resources["requests"]["memory"] == resources["limits"]["memory"]
    assert limit >= (int(config()["HOSTCACHE_CAPACITY_MB"]) << 20) + (1 << 30)


def test_the_host_cache_and_the_worker_pods_share_the_node_identity_and_its_weights_files():
    cache = documents("hostcache.yaml")[0]["spec"]["template"]["spec"]
    worker = worker_pod()["spec"]
    cache_container, worker_container = cache["containers"][0], worker["containers"][0]
    for container in (cache_container, worker_container):
        command = container["command"]
        # Both register as their node, so a host copy counts as on the worker's machine.
        assert command[command.index("--node") + 1] == "$(NODE_NAME)"
        assert command[command.index("--listen-host") + 1] == "$(POD_IP)"
        env = {e["name"]: e for e in container["env"]}
        assert env["NODE_NAME"]["valueFrom"]["fieldRef"]["fieldPath"] == "spec.nodeName"
        assert env["WORKER_MULTI_HOST"]["value"] == "true"
    # The same hostPath, mounted at WEIGHTS_DIR in both.
    for spec, container in ((cache, cache_container), (worker, worker_container)):
        volumes = {v["name"]: v for v in spec["volumes"]}
        mount = next(m for m in container["volumeMounts"] if m["mountPath"] == config()["WEIGHTS_DIR"])
        assert volumes[mount["name"]]["hostPath"] == {
            "path": "/var/lib/streamserve/weights",
            "type": "DirectoryOrCreate",
        }
    # The cache keeps the model the worker Pods serve.
    preset = worker_container["command"][worker_container["command"].index("--preset") + 1]
    assert preset in config()["HOSTCACHE_MODELS"].split(",")


def test_the_host_cache_probes_ask_for_the_name_it_runs_under():
    container = documents("hostcache.yaml")[0]["spec"]["template"]["spec"]["containers"][0]
    command = container["command"]
    name = command[command.index("--name") + 1]
    assert name == "cache-$(NODE_NAME)"
    for probe in ("livenessProbe", "readinessProbe"):
        shell = container[probe]["exec"]["command"]
        # Probes get no $(VAR) expansion: the shell expands $NODE_NAME to the same name.
        assert shell[:2] == ["sh", "-c"]
        assert 'manage.py probe hostcache "cache-$NODE_NAME"' in shell[2], probe
