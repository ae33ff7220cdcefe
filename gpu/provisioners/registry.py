"""Provisioner backends by name or dotted path (``settings.STREAMSERVE["PROVISIONER"]``)."""

from __future__ import annotations

from typing import Any

from django.core.exceptions import ImproperlyConfigured
from django.utils.module_loading import import_string

from gpu.provisioners.base import Provisioner, setting

BACKENDS: dict[str, str] = {
    "local": "gpu.provisioners.local.LocalProvisioner",
    "kubernetes": "gpu.provisioners.kubernetes.KubernetesProvisioner",
    "static": "gpu.provisioners.static.StaticProvisioner",
}


def provisioner_class(name_or_path: str) -> type[Provisioner]:
    """A built-in backend name (``local``, ``kubernetes``, ``static``) or a dotted class path."""
    path = BACKENDS.get(name_or_path, name_or_path)
    if "." not in path:
        raise ImproperlyConfigured(
            f"PROVISIONER={name_or_path!r} is neither a built-in backend ({', '.join(sorted(BACKENDS))}) "
            "nor a dotted path to a Provisioner class"
        )
    try:
        cls = import_string(path)
    except ImportError as exc:
        raise ImproperlyConfigured(f"PROVISIONER={name_or_path!r} cannot be imported: {exc}") from exc
    if not (isinstance(cls, type) and issubclass(cls, Provisioner)):
        raise ImproperlyConfigured(f"PROVISIONER={name_or_path!r} is not a Provisioner subclass")
    return cls


def get_provisioner(name: str | None = None, **options: Any) -> Provisioner:
    """The configured backend (or ``name``), built with ``options`` passed to its constructor."""
    chosen = name or setting("PROVISIONER", str, "local")
    return provisioner_class(chosen)(**options)
