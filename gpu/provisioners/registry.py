"""Provisioner backends by name or ``package.module:ClassName`` (``settings.STREAMSERVE["PROVISIONER"]``)."""

from __future__ import annotations

import pkgutil
from typing import Any

from django.conf import settings
from django.core.exceptions import ImproperlyConfigured

from gpu.provisioners.base import Provisioner

BACKENDS: dict[str, str] = {
    "local": "gpu.provisioners.local:LocalProvisioner",
    "kubernetes": "gpu.provisioners.kubernetes:KubernetesProvisioner",
    "static": "gpu.provisioners.static:StaticProvisioner",
}


def provisioner_class(name_or_path: str) -> type[Provisioner]:
    """A built-in backend name (``local``, ``kubernetes``, ``static``) or ``package.module:ClassName``."""
    path = BACKENDS.get(name_or_path, name_or_path)
    if ":" not in path and "." not in path:
        raise ImproperlyConfigured(
            f"PROVISIONER={name_or_path!r} is neither a built-in backend ({', '.join(sorted(BACKENDS))}) "
            "nor a package.module:ClassName path to a Provisioner class"
        )
    try:
        cls = pkgutil.resolve_name(path)
    except (ImportError, AttributeError, ValueError) as exc:
        raise ImproperlyConfigured(f"PROVISIONER={name_or_path!r} cannot be imported: {exc}") from exc
    if not (isinstance(cls, type) and issubclass(cls, Provisioner)):
        raise ImproperlyConfigured(f"PROVISIONER={name_or_path!r} is not a Provisioner subclass")
    return cls


def get_provisioner(name: str | None = None, **options: Any) -> Provisioner:
    """The configured backend (or ``name``), built with ``options`` passed to its constructor."""
    return provisioner_class(name or settings.STREAMSERVE["PROVISIONER"])(**options)
