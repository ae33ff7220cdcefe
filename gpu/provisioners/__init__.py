"""Pluggable GPU provisioners: one contract (``base``), backends by name (``registry``).

The scheduler uses::

    from gpu.provisioners import get_provisioner
    provisioner = get_provisioner()          # settings.STREAMSERVE["PROVISIONER"], default "local"
    result = provisioner.request(count=2, gpu_type="cpu", preset="tiny")
    result = provisioner.release(worker)
    result = provisioner.reconcile(now)
    action.provisioner_result = result.as_dict()
"""

from __future__ import annotations

from gpu.provisioners.base import (
    FailedWorker,
    Probe,
    Provisioner,
    ProvisionerError,
    ReconcileResult,
    ReleaseResult,
    RequestResult,
    WorkerRef,
    WorkerSpec,
)
from gpu.provisioners.registry import BACKENDS, get_provisioner, provisioner_class

__all__ = [
    "BACKENDS",
    "FailedWorker",
    "Probe",
    "Provisioner",
    "ProvisionerError",
    "ReconcileResult",
    "ReleaseResult",
    "RequestResult",
    "WorkerRef",
    "WorkerSpec",
    "get_provisioner",
    "provisioner_class",
]
