"""``local``: ``gpuworker`` processes on this host (CPU workers, and one per CUDA device).

Each worker is ``sys.executable manage.py gpuworker --name N --device D --preset P --gpu-type T`` in its own
process group (its own session, so a Ctrl-C of the control plane does not reach it), with stdout
and stderr appended to ``var/log/<name>.log``. ``external_id`` is ``"<pid>@<start time>"``: the pid
finds the process after a control-plane restart, and the start time (from psutil) tells it apart
from an unrelated process that later got the same pid.

Release sends SIGTERM to the process group (the worker finishes its chunk, hands off residents and
deregisters), waits ``LOCAL_STOP_GRACE_S`` and then sends SIGKILL. Liveness is ``psutil`` plus a
non-blocking ``waitpid`` so that an exited child of this process is reaped and not mistaken for a
live zombie.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from datetime import datetime
from pathlib import Path
from typing import Any

import psutil
from django.conf import settings
from django.core.exceptions import ImproperlyConfigured

from contracts.process import PARENT_PID_ENV
from gpu.models import GpuWorker
from gpu.provisioners.base import (
    LEFTOVER_GRACE_S,
    Probe,
    Provisioner,
    ProvisionerError,
    ReleaseResult,
    WorkerSpec,
    new_worker_name,
)

logger = logging.getLogger("gpu.provisioners")

CommandFactory = Callable[[GpuWorker], Sequence[str]]
WORKER_DEVICE_MODES = ("auto", "cpu", "cuda")
# Set in each worker's environment: which row it serves and which deployment (database) started
# it, so that reconcile finds this deployment's workers among the host's processes, and only them.
WORKER_NAME_ENV = "STREAMSERVE_WORKER_NAME"
WORKER_SCOPE_ENV = "STREAMSERVE_WORKER_SCOPE"


def deployment_scope() -> str:
    """The database the rows live in: two platforms on one host (or test runs) never share it."""
    db = settings.DATABASES["default"]
    return f"{db.get('HOST') or 'local'}:{db.get('PORT') or ''}/{db['NAME']}"


def gpuworker_command(worker: GpuWorker) -> list[str]:
    """The real worker command line for a provisioning row (the default ``command_factory``).

    ``--gpu-type`` is the row's type, the scheduler's profile key, so that the worker registers
    under the type the scheduler asked for. ``--weights-from`` is the deployment's setting; with
    ``auto`` the worker follows the scale plan the scaler wrote on its row (docs/scaleout.md).
    ``--stages`` is the row's stage role when it is not the whole pipeline (docs/stages.md).
    """
    manage = Path(settings.BASE_DIR) / "manage.py"
    return [
        sys.executable, str(manage), "gpuworker",
        "--name", worker.name, "--device", worker.device, "--preset", worker.model_preset,
        "--gpu-type", worker.gpu_type, "--weights-from", settings.STREAMSERVE["WORKER_WEIGHTS_FROM"],
    ] + (["--stages", worker.stage_role] if worker.stage_role != "EDC" else [])  # fmt: skip


def detect_cuda_devices() -> list[str]:
    """Names of this host's CUDA devices, indexed like ``cuda:N`` (empty without CUDA).

    The count comes from torch (it does not create a CUDA context, which would pin GPU memory in
    the control plane); names come from NVML where it answers, else just ``"cuda"``.
    """
    import torch

    count = torch.cuda.device_count()
    if count == 0:
        return []
    names = ["cuda"] * count
    with contextlib.suppress(Exception):
        import pynvml

        pynvml.nvmlInit()
        try:
            for index in range(min(count, pynvml.nvmlDeviceGetCount())):
                name = pynvml.nvmlDeviceGetName(pynvml.nvmlDeviceGetHandleByIndex(index))
                names[index] = name.decode() if isinstance(name, bytes) else str(name)
        finally:
            pynvml.nvmlShutdown()
    return names


_GPU_MODEL = re.compile(r"\b([a-z]{1,2}\d{1,4}[a-z]?)\b")


def gpu_type_of(device_name: str) -> str:
    """``"NVIDIA H100 80GB HBM3"`` → ``"h100"``; ``"cuda"`` when no model number is recognised."""
    match = _GPU_MODEL.search(device_name.lower().replace("nvidia", " "))
    return match.group(1) if match else "cuda"


def format_external_id(pid: int, create_time: float) -> str:
    return f"{pid}@{create_time:.2f}"


def parse_external_id(external_id: str) -> tuple[int, float | None]:
    pid, _, started = external_id.partition("@")
    try:
        return int(pid), (float(started) if started else None)
    except ValueError as exc:
        raise ProvisionerError(f"external_id {external_id!r} is not <pid>@<start time>") from exc


# Children this process started, and exit codes collected from them, shared by every
# LocalProvisioner instance of the process (the registry builds a new one per call). Holding the
# Popen objects keeps the subprocess module from reaping them behind our back (it reaps discarded
# ones on the next Popen), so the exit code is ours to report.
_CHILDREN: dict[int, subprocess.Popen] = {}
_EXIT_CODES: dict[int, int] = {}
_CHILDREN_LOCK = threading.Lock()


class LocalProvisioner(Provisioner):
    name = "local"
    # A CPU worker loads the tiny model in seconds; a GPU one loads weights from local disk.
    default_timeout_s = 120.0

    def __init__(
        self,
        *,
        command_factory: CommandFactory | None = None,
        log_dir: Path | str | None = None,
        stop_grace_s: float | None = None,
        max_cpu_workers: int | None = None,
        cuda_devices: Callable[[], list[str]] | None = None,
        host: str | None = None,
        worker_device: str | None = None,
        env: dict[str, str] | None = None,
        orphan_grace_s: float = LEFTOVER_GRACE_S,
        **options: Any,
    ) -> None:
        super().__init__(**options)
        self.command_factory = command_factory or gpuworker_command
        self.log_dir = Path(log_dir) if log_dir else Path(settings.BASE_DIR) / "var" / "log"
        conf = settings.STREAMSERVE
        self.stop_grace_s = float(stop_grace_s if stop_grace_s is not None else conf["LOCAL_STOP_GRACE_S"])
        self.max_cpu_workers = int(
            max_cpu_workers if max_cpu_workers is not None else conf["LOCAL_MAX_CPU_WORKERS"]
        )
        self._cuda_devices = cuda_devices or detect_cuda_devices
        self.host = host or socket.gethostname()
        self.worker_device = worker_device or conf["WORKER_DEVICE"]
        if self.worker_device not in WORKER_DEVICE_MODES:
            raise ImproperlyConfigured(
                f"WORKER_DEVICE={self.worker_device!r} is malformed: expected auto, cpu or cuda"
            )
        self.env = env
        self.orphan_grace_s = orphan_grace_s

    # ------------------------------------------------------------------ plan

    def _live_here(self):
        """Live workers on this host in every region: the devices and CPU room are the machine's."""
        return GpuWorker.objects.filter(
            provider=self.name, host=self.host, status__in=GpuWorker.LIVE_STATUSES
        )

    def plan(self, *, count: int, gpu_type: str | None, preset: str) -> tuple[list[WorkerSpec], str]:
        """CPU or CUDA workers by ``WORKER_DEVICE`` (auto|cpu|cuda) and the requested type.

        ``gpu_type`` is the scheduler's profile key and is recorded as asked. On a host with
        CUDA devices, devices whose NVML model matches it are preferred; when none matches (a
        profile named differently from NVML's model, e.g. ``h100-sxm``), any free device serves
        and the mismatch is logged.
        """
        if self.worker_device == "cpu" or (gpu_type == "cpu" and self.worker_device == "auto"):
            return self._plan_cpu(count, gpu_type or "cpu")
        names = self._cuda_devices()
        if not names:
            if gpu_type is None and self.worker_device == "auto":
                return self._plan_cpu(count, "cpu")
            return (
                [],
                f"this host has no CUDA device (asked for {gpu_type or 'cuda'}; WORKER_DEVICE={self.worker_device})",
            )
        types = [gpu_type_of(n) for n in names]
        matching = [i for i, t in enumerate(types) if t == gpu_type]
        if gpu_type not in (None, "cuda") and not matching:
            logger.warning(
                "provision.gpu_type_mismatch provider=local asked=%s host_devices=%s: using any free device",
                gpu_type,
                ",".join(types),
            )
        candidates = matching or list(range(len(types)))
        in_use = set(
            self._live_here().filter(device_index__isnull=False).values_list("device_index", flat=True)
        )
        free = [i for i in candidates if i not in in_use]
        specs = [
            WorkerSpec(
                name=new_worker_name("local", f"cuda{i}"),
                device=f"cuda:{i}",
                device_index=i,
                gpu_type=gpu_type if gpu_type not in (None, "cuda") else types[i],
                host=self.host,
            )
            for i in free[:count]
        ]
        shortfall = ""
        if len(specs) < count:
            kind = f"{gpu_type} " if matching else ""
            shortfall = f"{len(free)} of {len(candidates)} {kind}CUDA device(s) free on {self.host}"
        return specs, shortfall

    def _plan_cpu(self, count: int, gpu_type: str) -> tuple[list[WorkerSpec], str]:
        running = self._live_here().filter(device="cpu").count()
        room = max(self.max_cpu_workers - running, 0)
        specs = [
            WorkerSpec(name=new_worker_name("local", "cpu"), device="cpu", gpu_type=gpu_type, host=self.host)
            for _ in range(min(count, room))
        ]
        shortfall = ""
        if len(specs) < count:
            shortfall = (
                f"{running} of at most {self.max_cpu_workers} CPU workers (LOCAL_MAX_CPU_WORKERS) already run"
            )
        return specs, shortfall

    # ------------------------------------------------------------------ start / stop / probe

    def log_path(self, worker: GpuWorker) -> Path:
        return self.log_dir / f"{worker.name}.log"

    def start(self, worker: GpuWorker) -> str:
        argv = list(self.command_factory(worker))
        env = dict(self.env if self.env is not None else os.environ)
        env.setdefault("PYTHONUNBUFFERED", "1")
        env[WORKER_NAME_ENV] = worker.name
        env[WORKER_SCOPE_ENV] = deployment_scope()
        # Closes the race of the worker's parent-death signal (contracts/process.py): a worker
        # whose spawner is already gone when it asks for the signal exits at once.
        env[PARENT_PID_ENV] = str(os.getpid())
        try:
            self.log_dir.mkdir(parents=True, exist_ok=True)
            with open(self.log_path(worker), "ab") as log:
                process = subprocess.Popen(
                    argv,
                    stdin=subprocess.DEVNULL,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    cwd=str(settings.BASE_DIR),
                    env=env,
                    start_new_session=True,  # own session and process group: killpg reaches its children
                    close_fds=True,
                )
        except OSError as exc:
            raise ProvisionerError(f"cannot start {argv[0]}: {exc}") from exc
        with _CHILDREN_LOCK:
            _CHILDREN[process.pid] = process
            _EXIT_CODES.pop(process.pid, None)  # an earlier process's code under a reused pid
        try:
            started = psutil.Process(process.pid).create_time()
        except psutil.NoSuchProcess:
            started = 0.0  # exited at once; the next reconcile reports it with its log
        return format_external_id(process.pid, started)

    @staticmethod
    def _reap(pid: int) -> None:
        """Collect the exit status if ``pid`` is an exited child of this process (no zombie)."""
        with _CHILDREN_LOCK:
            child = _CHILDREN.get(pid)
            if child is not None:
                if child.poll() is not None:
                    _EXIT_CODES[pid] = child.returncode
                    del _CHILDREN[pid]
                return
            try:
                reaped, status = os.waitpid(pid, os.WNOHANG)
            except ChildProcessError:
                return  # not our child (started by another process): its parent or init reaps it
            if reaped == pid:
                _EXIT_CODES[pid] = os.waitstatus_to_exitcode(status)

    def _process(self, worker: GpuWorker) -> psutil.Process | None:
        """The worker's process if it is still running, else None."""
        if not worker.external_id:
            return None
        pid, started = parse_external_id(worker.external_id)
        self._reap(pid)
        try:
            process = psutil.Process(pid)
            if started and abs(process.create_time() - started) > 0.05:
                return None  # the pid was reused by an unrelated process
            if process.status() == psutil.STATUS_ZOMBIE:
                return None
        except psutil.NoSuchProcess:
            return None
        return process

    def _death_detail(self, worker: GpuWorker) -> str:
        pid, _ = parse_external_id(worker.external_id) if worker.external_id else (0, None)
        detail = f"process {pid} is gone"
        if pid in _EXIT_CODES:
            detail = f"process {pid} exited with code {_EXIT_CODES[pid]}"
        tail = self._log_tail(worker)
        return f"{detail}; log {self.log_path(worker)}: {tail}" if tail else detail

    def _log_tail(self, worker: GpuWorker, lines: int = 3, limit: int = 400) -> str:
        try:
            with open(self.log_path(worker), "rb") as log:
                log.seek(0, os.SEEK_END)
                log.seek(max(log.tell() - 4096, 0))
                text = log.read().decode("utf-8", "replace")
        except OSError:
            return ""
        kept = [line.strip() for line in text.splitlines() if line.strip()][-lines:]
        tail = " | ".join(kept)
        return tail[-limit:]

    def probe(self, workers: list[GpuWorker]) -> dict[int, Probe]:
        probes = {}
        for worker in workers:
            alive = self._process(worker) is not None
            probes[worker.pk] = Probe(alive=alive, detail="" if alive else self._death_detail(worker))
        return probes

    def _wait_gone(self, worker: GpuWorker, timeout_s: float) -> bool:
        """Poll until the process is gone (reaped, or a zombie of another parent) or the timeout."""
        deadline = time.monotonic() + timeout_s
        while self._process(worker) is not None:
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.05)
        return True

    def stop(self, worker: GpuWorker) -> str:
        process = self._process(worker)
        if process is None:
            return "process had already exited"
        pid = process.pid
        began = time.monotonic()
        self._signal_group(pid, signal.SIGTERM)
        if not self._wait_gone(worker, self.stop_grace_s):
            self._signal_group(pid, signal.SIGKILL)
            gone = self._wait_gone(worker, 10.0)
            logger.warning(
                "provision.killed provider=local worker=%s pid=%d grace_s=%.1f gone=%s",
                worker.name,
                pid,
                self.stop_grace_s,
                gone,
                extra={"worker": worker.name},
            )
            if not gone:
                raise ProvisionerError(f"process {pid} survived SIGKILL (uninterruptible?); still running")
            return f"killed process {pid} with SIGKILL after {self.stop_grace_s:.1f}s grace"
        # Stragglers the worker left in its group (e.g. helper processes) go too.
        self._signal_group(pid, signal.SIGKILL)
        return f"process {pid} stopped on SIGTERM in {time.monotonic() - began:.1f}s"

    def release_all(self) -> list[ReleaseResult]:
        """Release every live local worker of this host (in the regions served), stopping them in
        parallel (platform exit): SIGTERM to all, one shared grace, SIGKILL to the stragglers, then
        release each row."""
        workers = list(self.served().filter(host=self.host, status__in=GpuWorker.LIVE_STATUSES))
        running = [(w, p) for w in workers if (p := self._process(w)) is not None]
        for _, process in running:
            self._signal_group(process.pid, signal.SIGTERM)
        deadline = time.monotonic() + self.stop_grace_s
        for worker, process in running:
            if not self._wait_gone(worker, max(deadline - time.monotonic(), 0.0)):
                self._signal_group(process.pid, signal.SIGKILL)
                self._wait_gone(worker, 10.0)
        return [self.release(worker) for worker in workers]

    # ------------------------------------------------------------------ orphans

    def _workers_of_this_deployment(self) -> list[tuple[psutil.Process, str]]:
        """This deployment's worker processes on this host, with the worker name each serves.

        Only process-group leaders: a worker is started as one (``start_new_session``), and its
        own children inherit the environment but go with its group.
        """
        scope = deployment_scope()
        found = []
        for process in psutil.process_iter():
            try:
                if os.getpgid(process.pid) != process.pid:
                    continue
                env = process.environ()
            except (psutil.Error, OSError):
                continue  # gone meanwhile, or another user's process
            if env.get(WORKER_SCOPE_ENV) == scope and env.get(WORKER_NAME_ENV):
                found.append((process, env[WORKER_NAME_ENV]))
        return found

    def _tracked(self, process: psutil.Process, name: str, now: datetime) -> bool:
        """Whether a row accounts for this process: live and naming it (or not yet naming any
        process: ``request`` saves ``external_id`` just after the start), or ended so recently that
        the worker may still be exiting on its own."""
        row = GpuWorker.objects.filter(provider=self.name, name=name).first()
        if row is None:
            return False
        if row.status in GpuWorker.LIVE_STATUSES:
            return row.external_id in ("", format_external_id(process.pid, process.create_time()))
        return row.released_at is not None and (now - row.released_at).total_seconds() < LEFTOVER_GRACE_S

    def stop_orphans(self, now: datetime) -> list[str]:
        """Adopt or stop the worker processes of this deployment left behind by their starter.

        A worker's parent is whichever process ran ``request``: usually a Celery pool child, which
        may die (a crash, ``kill -9`` of the Celery worker) and leave the worker re-parented to
        PID 1 or the platform's subreaper. A worker whose live row names it is adopted: ``probe``
        and ``stop`` find it by pid and start time from any process. One that no row accounts for
        (its row was failed and the retry window passed, deleted, or names another process) holds
        a device that the scheduler believes free: it is stopped, once older than
        ``orphan_grace_s``.
        """
        stopped = []
        for process, name in self._workers_of_this_deployment():
            try:
                if time.time() - process.create_time() < self.orphan_grace_s:
                    continue
                if self._tracked(process, name, now):
                    continue
            except psutil.Error:
                continue
            detail = self._stop_process(process, name)
            stopped.append(f"{name} (pid {process.pid}): {detail}")
            logger.warning(
                "provision.orphan_stopped provider=local worker=%s pid=%d detail=%r",
                name,
                process.pid,
                detail,
                extra={"worker": name},
            )
        return stopped

    def _stop_process(self, process: psutil.Process, name: str) -> str:
        self._signal_group(process.pid, signal.SIGTERM)
        if self._wait_exited(process, self.stop_grace_s):
            return "stopped on SIGTERM"
        self._signal_group(process.pid, signal.SIGKILL)
        self._wait_exited(process, 10.0)
        return f"killed with SIGKILL after {self.stop_grace_s:.1f}s grace"

    def _wait_exited(self, process: psutil.Process, timeout_s: float) -> bool:
        """Poll until the process has exited (a zombie whose parent has not reaped it counts)."""
        deadline = time.monotonic() + timeout_s
        while True:
            self._reap(process.pid)
            try:
                if not process.is_running() or process.status() == psutil.STATUS_ZOMBIE:
                    return True
            except psutil.NoSuchProcess:
                return True
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.05)

    @staticmethod
    def _signal_group(pgid: int, signum: int) -> None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(pgid, signum)
