"""Provisioner backends by name or ``package.module:ClassName`` (``settings.STREAMSERVE["PROVISIONER"]``)."""

from __future__ import annotations

import pkgutil
from typing import Any

from django.conf import settings
from django.core.exceptions import ImproperlyConfigured

from gpu.backends import PROVISIONER_BACKENDS
from gpu.models import Region
from gpu.provisioners.base import Provisioner

BACKENDS: dict[str, str] = PROVISIONER_BACKENDS


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


def region_provisioner_name(region: Region | None) -> str:
    """The backend of ``region``'s workers: its own ``provisioner``, else the ``PROVISIONER`` setting
    (always for the local region without a row, ``None``)."""
    return (region.provisioner if region is not None else None) or settings.STREAMSERVE["PROVISIONER"]


def provisioner_for(region: Region | None, **options: Any) -> Provisioner:
    """The backend that scales ``region`` out and in (``None``: the local region)."""
    return get_provisioner(
        region_provisioner_name(region), regions=[region.pk if region else None], **options
    )


def provisioners_by_backend(**options: Any) -> list[Provisioner]:
    """One provisioner per backend in use, each serving the regions that name it: the tick reconciles
    each, and each reconcile considers its regions' workers only, so two backends side by side (or
    one backend whose regions another reconcile already covers) never touch each other's workers.

    The ``PROVISIONER`` setting's backend serves the local region (``None``) and every region that
    names no backend.
    """
    served: dict[str, list[int | None]] = {settings.STREAMSERVE["PROVISIONER"]: [None]}
    for region in Region.objects.all():
        served.setdefault(region_provisioner_name(region), []).append(region.pk)
    return [get_provisioner(name, regions=regions, **options) for name, regions in served.items()]
