"""``static``: a fixed list of workers that operators start by hand on their machines.

``STATIC_WORKERS`` lists them as ``name@host:device[/gpu_type]``, comma-separated, e.g.
``gpu-a@10.0.0.5:cuda:0/h100,gpu-b@10.0.0.5:cuda:1/h100,cpu-1@localhost:cpu``. The operator runs
``python manage.py gpuworker --name gpu-a --device cuda:0 --preset P`` on that host.

``request`` can only hand out configured workers that have no live row: it creates the
provisioning row under the configured name (the hand-started process adopts it by that name and
marks itself ready); nothing is started. ``release`` marks the row released and stops nothing (the
process stays up, ready to be handed out again). Since worker names are unique across history, the
ended row of an earlier lifecycle is renamed ``<name>#<id>`` when the name is handed out again; its
id, ledger and chunk records are unchanged.

Liveness cannot be probed from here: a hand-started worker that never adopts its row fails at the
provisioning timeout, and one that dies later is caught by the scheduler's heartbeat timeout.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from django.conf import settings
from django.core.exceptions import ImproperlyConfigured
from django.db import transaction
from django.db.models import Q

from gpu.models import GpuWorker
from gpu.provisioners.base import ENDED_STATUSES, Probe, Provisioner, WorkerSpec


@dataclass(frozen=True)
class StaticWorker:
    name: str
    host: str
    device: str
    gpu_type: str

    @property
    def device_index(self) -> int | None:
        kind, _, index = self.device.partition(":")
        return int(index) if kind == "cuda" and index.isdigit() else None

    def describe(self) -> str:
        return f"{self.name}@{self.host}:{self.device}/{self.gpu_type}"


def parse_static_workers(raw: str) -> list[StaticWorker]:
    """``"a@host:cuda:0/h100,b@host:cpu"`` → workers; ValueError naming the bad entry."""
    workers: list[StaticWorker] = []
    for entry in (part.strip() for part in raw.split(",")):
        if not entry:
            continue
        name, at, rest = entry.partition("@")
        host, colon, device_and_type = rest.partition(":")
        device, _, gpu_type = device_and_type.partition("/")
        if not (at and colon and name and host and device):
            raise ValueError(f"entry {entry!r} is not name@host:device[/gpu_type]")
        if device != "cpu" and not (device.startswith("cuda:") and device[5:].isdigit()):
            raise ValueError(f"entry {entry!r}: device must be cpu or cuda:N")
        workers.append(StaticWorker(name, host, device, gpu_type or ("cpu" if device == "cpu" else "cuda")))
    names = [w.name for w in workers]
    duplicates = sorted({n for n in names if names.count(n) > 1})
    if duplicates:
        raise ValueError(f"worker name(s) listed twice: {', '.join(duplicates)}")
    return workers


class StaticProvisioner(Provisioner):
    name = "static"

    def __init__(self, *, workers: list[StaticWorker] | str | None = None, **options: Any) -> None:
        super().__init__(**options)
        if workers is None:
            workers = settings.STREAMSERVE["STATIC_WORKERS"]
        if isinstance(workers, str):
            try:
                workers = parse_static_workers(workers)
            except ValueError as exc:
                raise ImproperlyConfigured(
                    f"Environment variable STATIC_WORKERS is malformed: {exc}"
                ) from exc
        self.workers: list[StaticWorker] = list(workers)

    def plan(self, *, count: int, gpu_type: str | None, preset: str) -> tuple[list[WorkerSpec], str]:
        if not self.workers:
            return [], "STATIC_WORKERS is empty: no hand-started worker is configured"
        candidates = [w for w in self.workers if gpu_type is None or w.gpu_type == gpu_type]
        if not candidates:
            types = ", ".join(sorted({w.gpu_type for w in self.workers}))
            return [], f"no static worker of type {gpu_type} is configured (configured types: {types})"
        live = set(
            GpuWorker.objects.filter(
                name__in=[w.name for w in candidates], status__in=GpuWorker.LIVE_STATUSES
            ).values_list("name", flat=True)
        )
        idle = sorted((w for w in candidates if w.name not in live), key=self._last_failure_key())[:count]
        with transaction.atomic():
            for worker in idle:
                self._archive_name(worker.name)
        specs = [
            WorkerSpec(
                name=w.name, device=w.device, gpu_type=w.gpu_type, host=w.host, device_index=w.device_index
            )
            for w in idle
        ]
        shortfall = ""
        if len(specs) < count:
            shortfall = (
                f"{len(candidates) - len(live)} of {len(candidates)} static worker(s)"
                f"{' of type ' + gpu_type if gpu_type else ''} idle"
            )
        return specs, shortfall

    def _last_failure_key(self):
        """Sort key: never-failed workers first, then the least recently failed (a retry goes elsewhere)."""
        names = Q()
        for worker in self.workers:
            names |= Q(name=worker.name) | Q(name__startswith=f"{worker.name}#")
        failed_at: dict[str, datetime] = {}
        rows = GpuWorker.objects.filter(names, provider=self.name, status=GpuWorker.Status.FAILED)
        for name, at in rows.values_list("name", "released_at"):
            base = name.split("#", 1)[0]
            if at is not None and (base not in failed_at or at > failed_at[base]):
                failed_at[base] = at
        epoch = datetime.min.replace(tzinfo=UTC)
        return lambda worker: (worker.name in failed_at, failed_at.get(worker.name, epoch))

    @staticmethod
    def _archive_name(name: str) -> None:
        """Free a configured name held by an ended row of an earlier lifecycle."""
        for old in GpuWorker.objects.select_for_update().filter(name=name, status__in=ENDED_STATUSES):
            old.name = f"{name}#{old.pk}"
            old.save(update_fields=["name"])

    def start(self, worker: GpuWorker) -> str:
        configured = next(w for w in self.workers if w.name == worker.name)
        return configured.describe()

    def stop(self, worker: GpuWorker) -> str:
        return "static worker left running (started by hand)"

    def probe(self, workers: list[GpuWorker]) -> dict[int, Probe]:
        return {}
