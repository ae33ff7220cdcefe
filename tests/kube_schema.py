"""Kubernetes objects checked against the API of pinned Kubernetes versions, offline.

No API server is reachable here, so an object is checked in two layers:

1. **The API schema**: the OpenAPI schema of each pinned version as JSON Schema, in its *strict*
   form (``kubernetes-validate`` ships one per minor version): unknown fields, wrong types and
   missing required fields fail. The official client's models, which the provisioner sends through,
   check types but silently drop an unknown field (``imagePullPolcy``, a misplaced ``nodeSelector``):
   the schema is the stricter check (tests/deploy/test_manifests.py shows both on the same typo).
2. **Rules the API server enforces in code** (``pkg/apis/core/validation`` and the workload
   validators) that no schema carries, and one kubelet rule: names and labels, enums, quantities,
   requests ≤ limits, selectors matching their template, probe handlers and named ports, volume
   mounts naming a volume, downward-API field paths, and ``$(VAR)`` in a command naming a variable
   of the container's env (the kubelet leaves an unknown one as literal text).

What neither layer can show without a cluster (admission webhooks and policies, scheduling, RBAC
semantics, image pulls, runtime) is listed in docs/provisioners.md.
"""

from __future__ import annotations

import functools
import json
import re
from collections.abc import Iterator
from importlib.resources import files
from typing import Any

import jsonschema
from kubernetes.utils import parse_quantity
from referencing import Registry, Resource

# The oldest minor we support and the newest the pinned kubernetes-validate (<1.38) ships: a field
# that the oldest lacks, or an API version that the newest removed, fails. The one place to change.
KUBERNETES_VERSIONS = ("1.35", "1.37")
SCHEMAS = files("kubernetes_validate") / "kubernetes-json-schema"

DNS1123_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")
DNS1123_SUBDOMAIN = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")
DNS1035_LABEL = re.compile(r"^[a-z]([-a-z0-9]*[a-z0-9])?$")
LABEL_VALUE = re.compile(r"^([A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?)?$")
LABEL_NAME = re.compile(r"^[A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?$")
VAR_REFERENCE = re.compile(r"(?<!\$)\$\(([A-Za-z_][A-Za-z0-9_]*)\)")
# The fields the downward API may put in an env var (pkg/apis/core/validation, validEnvDownwardAPIFieldPathExpressions).
ENV_FIELD_PATHS = {
    "metadata.name",
    "metadata.namespace",
    "metadata.uid",
    "spec.nodeName",
    "spec.serviceAccountName",
    "status.hostIP",
    "status.hostIPs",
    "status.podIP",
    "status.podIPs",
}
WORKLOAD_KINDS = {"Deployment", "DaemonSet", "StatefulSet", "ReplicaSet", "Job"}
HOST_PATH_TYPES = {
    "",
    "DirectoryOrCreate",
    "Directory",
    "FileOrCreate",
    "File",
    "Socket",
    "CharDevice",
    "BlockDevice",
}


def problems(obj: dict[str, Any]) -> list[str]:
    """What the pinned versions' API would reject in ``obj`` (empty: valid), each naming its field.

    The rules read the object's structure, so they run once the schemas accept it."""
    found = [p for version in KUBERNETES_VERSIONS for p in schema_problems(obj, version)]
    return found or rule_problems(obj)


def schema_problems(obj: dict[str, Any], version: str) -> list[str]:
    """Every place where ``obj`` breaks the strict schema of ``version`` (empty: it holds)."""
    validator = _validator(version, obj.get("apiVersion", ""), obj.get("kind", ""))
    if validator is None:
        return [f"{version} schema: no kind {obj.get('kind')!r} in API version {obj.get('apiVersion')!r}"]
    errors = sorted(validator.iter_errors(obj), key=lambda e: [str(p) for p in e.path])
    return [f"{version} schema: {'.'.join(str(p) for p in e.path) or '(top)'}: {e.message}" for e in errors]


@functools.cache
def _validator(version: str, api_version: str, kind: str) -> jsonschema.Draft202012Validator | None:
    # The files kubernetes-validate ships: one directory per minor, one schema per kind and API
    # version (``rbac.authorization.k8s.io/v1`` → ``role-rbac-v1.json``), the shared definitions
    # beside them. Read once per version and kind: the definitions are 1.3 MB of JSON.
    directory = SCHEMAS / f"v{version}.0-local-strict"
    if not directory.is_dir():
        raise ValueError(f"kubernetes-validate ships no schemas for Kubernetes {version}")
    group_version = re.sub(r"^([^./]*)(?:\.[^/]*)?/", r"\1-", api_version)
    path = directory / f"{kind.lower()}-{group_version}.json"
    if not kind or not api_version or not path.is_file():
        return None
    schema = json.loads(path.read_text())
    # Each document names itself ($id): the kind's schema refers to the definitions by that name.
    registry = Resource.from_contents(schema) @ (_definitions(version) @ Registry())
    return jsonschema.Draft202012Validator(schema, registry=registry)


@functools.cache
def _definitions(version: str) -> Resource:
    return Resource.from_contents(
        json.loads((SCHEMAS / f"v{version}.0-local-strict" / "_definitions.json").read_text())
    )


def rule_problems(obj: dict[str, Any]) -> list[str]:
    kind = obj.get("kind", "")
    found = _metadata_problems(obj.get("metadata") or {}, kind, "metadata")
    for where, pod_spec in _pod_specs(obj):
        found += _pod_spec_problems(pod_spec, kind, where)
    if kind in WORKLOAD_KINDS:
        template_metadata = obj["spec"]["template"].get("metadata") or {}
        found += _metadata_problems(template_metadata, kind, "spec.template.metadata", named=False)
    if kind in WORKLOAD_KINDS - {"Job"}:
        selector = (obj["spec"].get("selector") or {}).get("matchLabels") or {}
        labels = obj["spec"]["template"].get("metadata", {}).get("labels") or {}
        if not selector or any(labels.get(k) != v for k, v in selector.items()):
            found.append("spec.selector: selector does not match template labels")
    return found


def _pod_specs(obj: dict[str, Any]) -> Iterator[tuple[str, dict[str, Any]]]:
    if obj.get("kind") == "Pod":
        yield "spec", obj["spec"]
    elif obj.get("kind") in WORKLOAD_KINDS:
        yield "spec.template.spec", obj["spec"]["template"]["spec"]


def _metadata_problems(metadata: dict[str, Any], kind: str, where: str, *, named: bool = True) -> list[str]:
    found = []
    name = metadata.get("name", "")
    if named:
        pattern = {"Service": DNS1035_LABEL, "Namespace": DNS1123_LABEL}.get(kind, DNS1123_SUBDOMAIN)
        if not pattern.match(name) or len(name) > (63 if pattern is not DNS1123_SUBDOMAIN else 253):
            found.append(f"{where}.name: {name!r} is not a valid {kind} name")
    for key, value in (metadata.get("labels") or {}).items():
        prefix, _, label = key.rpartition("/")
        if (prefix and not DNS1123_SUBDOMAIN.match(prefix)) or not LABEL_NAME.match(label) or len(label) > 63:
            found.append(f"{where}.labels: invalid key {key!r}")
        if not isinstance(value, str) or not LABEL_VALUE.match(value) or len(value) > 63:
            found.append(f"{where}.labels[{key}]: invalid value {value!r}")
    return found


def _pod_spec_problems(spec: dict[str, Any], kind: str, where: str) -> list[str]:
    found = []
    allowed = {"Job": {"Never", "OnFailure"}, "Pod": {"Always", "OnFailure", "Never"}}.get(kind, {"Always"})
    policy = spec.get("restartPolicy", "Always")
    if policy not in allowed:
        found.append(f"{where}.restartPolicy: {policy!r} not allowed for a {kind} (one of {sorted(allowed)})")
    volumes = set()
    for i, volume in enumerate(spec.get("volumes") or []):
        volumes.add(volume["name"])
        if not DNS1123_LABEL.match(volume["name"]):
            found.append(f"{where}.volumes[{i}].name: {volume['name']!r} is not a DNS-1123 label")
        if "hostPath" in volume and volume["hostPath"].get("type", "") not in HOST_PATH_TYPES:
            found.append(f"{where}.volumes[{i}].hostPath.type: {volume['hostPath']['type']!r}")
    names = [c["name"] for c in spec.get("containers", []) + spec.get("initContainers", [])]
    if len(names) != len(set(names)):
        found.append(f"{where}.containers: duplicate container names {names}")
    for i, container in enumerate(spec.get("containers", [])):
        found += _container_problems(container, volumes, f"{where}.containers[{i}]")
    return found


def _container_problems(container: dict[str, Any], volumes: set[str], where: str) -> list[str]:
    found = []
    if not DNS1123_LABEL.match(container["name"]) or len(container["name"]) > 63:
        found.append(f"{where}.name: {container['name']!r} is not a DNS-1123 label")
    if not container.get("image"):
        found.append(f"{where}.image: required")
    if container.get("imagePullPolicy", "IfNotPresent") not in {"Always", "IfNotPresent", "Never"}:
        found.append(f"{where}.imagePullPolicy: {container['imagePullPolicy']!r}")
    found += _resource_problems(container.get("resources") or {}, f"{where}.resources")
    ports = {p.get("name") for p in container.get("ports") or [] if p.get("name")}
    for probe_name in ("startupProbe", "livenessProbe", "readinessProbe"):
        probe = container.get(probe_name)
        if probe is None:
            continue
        handlers = [h for h in ("exec", "httpGet", "tcpSocket", "grpc") if h in probe]
        if len(handlers) != 1:
            found.append(f"{where}.{probe_name}: exactly one handler needed, got {handlers}")
        for handler in ("httpGet", "tcpSocket"):
            port = (probe.get(handler) or {}).get("port")
            if isinstance(port, str) and port not in ports:
                found.append(f"{where}.{probe_name}.{handler}.port: no container port named {port!r}")
    for i, mount in enumerate(container.get("volumeMounts") or []):
        if mount["name"] not in volumes:
            found.append(f"{where}.volumeMounts[{i}].name: no volume named {mount['name']!r}")
    env = container.get("env") or []
    for i, var in enumerate(env):
        path = ((var.get("valueFrom") or {}).get("fieldRef") or {}).get("fieldPath")
        if (
            path is not None
            and path not in ENV_FIELD_PATHS
            and not re.match(r"^metadata\.(labels|annotations)\['", path)
        ):
            found.append(f"{where}.env[{i}].valueFrom.fieldRef.fieldPath: {path!r} is not supported")
    # The kubelet expands $(VAR) in command and args only for variables of the container's env
    # (envFrom keys too); an unknown one stays as literal text, e.g. a worker named "$(POD_NAME)".
    defined = {var["name"] for var in env}
    for field in ("command", "args"):
        for arg in container.get(field) or []:
            for var in VAR_REFERENCE.findall(arg):
                if var not in defined:
                    found.append(f"{where}.{field}: $({var}) is not defined in env (left unexpanded)")
    return found


def _resource_problems(resources: dict[str, Any], where: str) -> list[str]:
    found = []
    parsed: dict[str, dict[str, Any]] = {}
    for part in ("requests", "limits"):
        for name, value in (resources.get(part) or {}).items():
            try:
                parsed.setdefault(part, {})[name] = parse_quantity(value)
            except ValueError as exc:
                found.append(f"{where}.{part}[{name}]: {value!r}: {exc}")
    requests, limits = parsed.get("requests", {}), parsed.get("limits", {})
    for name, request in requests.items():
        if name in limits and request > limits[name]:
            found.append(f"{where}.requests[{name}]: {request} is more than its limit {limits[name]}")
    for name in set(requests) | set(limits):
        # Extended resources (nvidia.com/gpu): whole units, and a request must equal its limit.
        if "/" in name and not name.startswith(("kubernetes.io/", "requests.")):
            if name not in limits or requests.get(name, limits[name]) != limits[name]:
                found.append(f"{where}: extended resource {name} needs a limit equal to its request")
            elif limits[name] != int(limits[name]):
                found.append(f"{where}.limits[{name}]: extended resources are whole units")
    return found
