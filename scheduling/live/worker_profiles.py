"""Scheduler profiles of the worker types this deployment runs (``WORKER_PROFILE``)."""

from __future__ import annotations

from functools import cache

from django.conf import settings

from scheduling.core.gpu_profiles import load_profile
from scheduling.core.types import GpuTypeSpec


@cache
def gpu_profiles() -> dict[str, GpuTypeSpec]:
    """Scheduler profiles of the worker types, keyed by ``GpuWorker.gpu_type``."""
    specs = [
        load_profile(part.strip())
        for part in settings.STREAMSERVE["WORKER_PROFILE"].split(",")
        if part.strip()
    ]
    return {spec.gpu_type: spec for spec in specs}


def default_gpu_type() -> str:
    return next(iter(gpu_profiles()))


def profile_for(gpu_type: str) -> GpuTypeSpec:
    """The profile of ``gpu_type``, or of the default type for a worker type the profile lacks."""
    profiles = gpu_profiles()
    return profiles.get(gpu_type, profiles[default_gpu_type()])
