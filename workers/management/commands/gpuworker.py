"""``python manage.py gpuworker``: one worker daemon hosting one model replica on one device."""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import socket
import sys
import time

import redis
import torch
from django.conf import settings
from django.core.management.base import BaseCommand, CommandError

from contracts.catalog.presets import DEFAULT_PRESET, PRESETS
from contracts.process import platform_pid, stop_when_orphaned
from controlplane.tracing import tracing_configure
from gpu.models import GpuWorker
from gpu.services import TransitionError, worker_fail, worker_register, worker_release
from scheduling.live.enqueue import scheduler_trigger
from scheduling.live.liveness import sessions_recover
from scheduling.live.worker_profiles import default_gpu_type, gpu_profiles
from workers.adapters.pool import DjangoPoolLink
from workers.adapters.reporting import DjangoReporter, phase_report
from workers.daemon import WorkerDaemon
from workers.runtime.engine import ChunkEngine
from workers.runtime.models import UnknownPresetError, model_class
from workers.runtime.stages.contract import RoleError, staged_class
from workers.runtime.stages.host import StageHost
from workers.runtime.stages.staged_model import daemon_role, staged_engine_model
from workers.runtime.transport import MigrationListener
from workers.runtime.transport.pair import is_loopback
from workers.runtime.weights import WeightsUnavailable
from workers.weights_loading import (
    DISK,
    INIT,
    WEIGHTS_FROM,
    LoadedWeights,
    PooledCopy,
    StageWeightsFetcher,
    WeightsLoader,
    weights_file,
    weights_file_ensure,
)

logger = logging.getLogger("workers.gpuworker")

# Exit status of a worker that stopped because its control plane was lost (WORKER_ORPHAN_TIMEOUT_S).
ORPHANED_EXIT = 3


def resolve_device(device: str) -> str:
    if device == "auto":
        return "cuda:0" if torch.cuda.is_available() else "cpu"
    if device == "cpu":
        return device
    if device.startswith("cuda"):
        if not torch.cuda.is_available():
            raise CommandError(f"--device {device}: CUDA is not available on this machine")
        index = int(device.split(":")[1]) if ":" in device else 0
        if index >= torch.cuda.device_count():
            raise CommandError(f"--device {device}: only {torch.cuda.device_count()} CUDA device(s)")
        return f"cuda:{index}"
    raise CommandError(f"--device must be cpu, cuda:N or auto, got {device!r}")


class Command(BaseCommand):
    help = (
        "Run a GPU worker: register, load the weights (plan, pool or disk), report ready, heartbeat and run "
        "the coalesced engine."
    )
    # A daemon started for every scale-out: Django's system checks (models, URLconf, the API schema's
    # imports) would add ~0.3 s of CPU to each start and check nothing a worker uses; `migrate` and
    # `manage.py check` run them for the deployment.
    requires_system_checks: list[str] = []

    def add_arguments(self, parser):
        parser.add_argument("--name", default=None, help="worker name (default: <host>-<pid>)")
        parser.add_argument("--device", default="auto", help="cpu, cuda:N or auto")
        parser.add_argument("--preset", default=DEFAULT_PRESET, help=f"model preset ({', '.join(PRESETS)})")
        parser.add_argument("--capacity", type=int, default=None, help="K: sessions per coalesced batch")
        parser.add_argument(
            "--gpu-type", default=None, help="scheduler profile key (default: the first WORKER_PROFILE)"
        )
        parser.add_argument("--heartbeat", type=float, default=None, help="heartbeat interval in seconds")
        parser.add_argument("--threads", type=int, default=1, help="torch CPU threads")
        parser.add_argument("--listen-host", default="127.0.0.1", help="address peers use for migrations")
        parser.add_argument(
            "--node",
            default="",
            help="the machine it runs on, as the scale planner's host (default: the hostname); "
            "on Kubernetes $(NODE_NAME): a Pod's hostname is its own name, not its node's",
        )
        parser.add_argument(
            "--weights-from",
            default=None,
            choices=WEIGHTS_FROM,
            help="auto: the scale plan's source, else disk; pool: peers only; disk: local storage "
            "(default: WORKER_WEIGHTS_FROM)",
        )
        parser.add_argument(
            "--stages",
            default="EDC",
            help="stage role (issue 15): EDC monolithic (default), DC diffusion worker fed by encoder "
            "workers, E encoder worker serving prompt encodings at its migration address, C decoder "
            "worker decoding finished jobs' latents there, D and ED one-shot job workers (no sessions) "
            "decoding on a C worker (D also encoding on an E worker)",
        )
        parser.add_argument(
            "--link-mbps",
            type=float,
            default=None,
            help="pace weight transfers to this many Mbit/s (emulation)",
        )

    def handle(self, *args, **options):
        # Under runplatform (which names itself in the environment) the worker goes with the
        # platform, even one killed with SIGKILL: it stops (checkpointing its sessions) when it
        # is re-parented anywhere but to the platform's subreaper. Elsewhere the orphan timeout
        # (WORKER_ORPHAN_TIMEOUT_S) is what ends a worker that lost its control plane.
        if platform_pid() is not None:
            stop_when_orphaned()
        tracing_configure("worker")
        conf = settings.STREAMSERVE
        name = options["name"] or f"{socket.gethostname()}-{os.getpid()}"
        device = resolve_device(options["device"])
        heartbeat = options["heartbeat"] or conf["HEARTBEAT_INTERVAL_S"]
        if heartbeat <= 0:
            raise CommandError("--heartbeat must be positive")
        if options["threads"] < 1:
            raise CommandError("--threads must be at least 1")
        if conf["WORKER_MULTI_HOST"] and is_loopback(options["listen_host"]):
            raise CommandError(
                f"--listen-host {options['listen_host']!r} is a loopback address, but WORKER_MULTI_HOST is set: "
                "workers on other hosts could not reach this one's migration listener, weight server or "
                "chunk publisher. Pass --listen-host with an address they reach (on Kubernetes $(POD_IP)), "
                "or unset WORKER_MULTI_HOST for a one-host pool."
            )
        gpu_type = options["gpu_type"] or default_gpu_type()
        if gpu_type not in gpu_profiles():
            raise CommandError(
                f"--gpu-type {gpu_type!r} has no scheduler profile; known: {', '.join(gpu_profiles())}"
            )
        capacity = options["capacity"] or int(gpu_profiles()[gpu_type].capacity)
        if capacity < 1:
            raise CommandError("--capacity must be at least 1")
        torch.set_num_threads(options["threads"])
        preset = options["preset"]
        if preset not in PRESETS:
            raise CommandError(f"--preset: unknown preset {preset!r}; known: {', '.join(sorted(PRESETS))}")
        if options["link_mbps"] is not None and options["link_mbps"] <= 0:
            raise CommandError("--link-mbps must be positive")
        weights_from = options["weights_from"] or conf["WORKER_WEIGHTS_FROM"]
        role = self._role(options["stages"], preset)
        listener = MigrationListener(device=device, host=options["listen_host"])
        memory = torch.cuda.get_device_properties(device).total_memory if device.startswith("cuda") else 0
        identity = {
            "name": name,
            "host": options["node"] or socket.gethostname(),
            "device": device,
            "preset": preset,
            "gpu_type": gpu_type,
            "capacity": capacity,
            "memory_bytes": memory,
            "migration_address": listener.address,
            # Registered with its role so no session is placed on an E worker before its first heartbeat.
            "stage_role": role,
        }
        try:
            # Phase "process up": the row is adopted (or created), still provisioning.
            worker = worker_register(**identity, mark_ready=False)
        except TransitionError as exc:
            listener.close()
            raise CommandError(str(exc)) from exc
        phase_report(worker_id=worker.pk, phase="process_up")
        loader = WeightsLoader(
            preset=preset,
            device=device,
            host=options["listen_host"],
            weights_from=weights_from,
            weights_dir=conf["WEIGHTS_DIR"],
            pool=DjangoPoolLink(worker.pk, preset),
            link_mbps=options["link_mbps"],
        )
        try:
            weights = loader.load() if role == "EDC" else self._stage_weights(preset, role, device, conf)
        except Exception as exc:
            # Never serve from incomplete or corrupt weights (every source failed, or the file
            # itself is bad): the worker fails instead of registering ready.
            listener.close()
            with contextlib.suppress(TransitionError):
                worker_fail(worker=worker)
            reason = "weights unavailable" if isinstance(exc, WeightsUnavailable) else "weights failed"
            raise CommandError(f"{reason} ({weights_from}): {type(exc).__name__}: {exc}") from exc
        phase_report(
            worker_id=worker.pk, phase="weights_complete", source=weights.source, detail=weights.detail
        )
        logger.info(
            "worker.weights worker=%s source=%s seconds=%.3f detail=%s serving=%s",
            name,
            weights.source,
            weights.seconds,
            weights.detail,
            weights.address,
        )
        engine = ChunkEngine(weights.model, max_batch=capacity)
        # Stage roles (issue 15): a stage added by set_role loads from the parameter pool (a peer or
        # a host cache holding the preset) or the local file; dropping one leaves the pool.
        pool_link = loader.pool
        stage_host = StageHost(
            engine,
            store_address=listener.address,
            pool_copy=PooledCopy(weights, pool_link) if weights.packed is not None else None,
            loader=StageWeightsFetcher(
                preset=preset,
                device=device,
                host=options["listen_host"],
                weights_dir=conf["WEIGHTS_DIR"],
                pool=pool_link,
                link_mbps=options["link_mbps"],
            ).fetch,
        )
        try:
            worker = worker_register(**identity)
        except TransitionError as exc:
            weights.close()
            raise CommandError(str(exc)) from exc
        phase_report(worker_id=worker.pk, phase="ready")
        reporter = DjangoReporter(worker.pk, name)
        daemon = WorkerDaemon(
            name=name,
            engine=engine,
            redis_client=redis.Redis.from_url(settings.REDIS_URL),
            reporter=reporter,
            capacity=capacity,
            migration_listener=listener,
            checkpoint_dir=conf["CHECKPOINT_DIR"],
            checkpoint_every=conf["CHECKPOINT_EVERY"],
            migration_timeout_s=conf["MIGRATION_TIMEOUT_S"],
            heartbeat_s=heartbeat,
            liveness_ttl_s=conf["HEARTBEAT_TIMEOUT_S"],
            stage_host=stage_host,
            orphan_timeout_s=conf["WORKER_ORPHAN_TIMEOUT_S"],
        )
        signal.signal(signal.SIGTERM, daemon.request_stop)
        signal.signal(signal.SIGINT, daemon.request_stop)
        logger.info(
            "worker.ready worker=%s device=%s preset=%s role=%s K=%d migration=%s",
            name,
            device,
            options["preset"],
            role,
            capacity,
            listener.address,
        )
        # Placement runs now: sessions go to this worker the moment it is ready.
        scheduler_trigger("gpu_ready")
        daemon.run()
        if daemon.orphaned:
            # The control plane is gone (its sessions are checkpointed): hand them back if the
            # database still answers, and exit non-zero whatever happens, so a supervisor sees it.
            try:
                self._deregister(worker.pk)
            except Exception as exc:
                logger.warning("worker.deregister_failed worker=%s: %s: %s", name, type(exc).__name__, exc)
            weights.close()
            logger.error("worker.stopped worker=%s: orphaned (no control plane)", name)
            sys.exit(ORPHANED_EXIT)
        # Out of the pool first (release drops the holding), then stop serving: no plan made in
        # between names a closed source.
        self._deregister(worker.pk)
        weights.close()
        logger.info("worker.stopped worker=%s", name)

    @staticmethod
    def _role(text: str, preset: str) -> str:
        try:
            role = daemon_role(text)
        except (RoleError, ValueError) as exc:
            raise CommandError(f"--stages: {exc}") from exc
        if role != "EDC":
            try:
                staged_class(preset)
            except UnknownPresetError as exc:
                raise CommandError(f"--stages {role}: {exc}") from exc
            if not model_class(preset).transferable_weights:
                # The daemon's roles build stages from a weights file and re-cut the model in place
                # (`restage`); a checkpoint-directory model (Wan) is served by the stage worker process.
                raise CommandError(
                    f"--stages {role}: preset {preset!r} loads from its checkpoint directory, which the "
                    "daemon's stage roles do not; run its stages with python -m "
                    "workers.runtime.stages.worker --model-path DIR"
                )
        return role

    @staticmethod
    def _stage_weights(preset: str, role: str, device: str, conf: dict) -> LoadedWeights:
        """A stage worker's weights: its stages' tensors only, read from the local weights file
        (written from the seeded weights first when missing). A partial copy is no parameter-pool
        source, so it is neither pulled from peers nor served to them."""
        started = time.monotonic()
        path = weights_file(conf["WEIGHTS_DIR"], preset)
        created = weights_file_ensure(path, preset)
        model = staged_engine_model(preset, role, device=device, weights_path=str(path))
        detail = f"{path} (stages {role})"
        return LoadedWeights(model, None, INIT if created else DISK, detail, "", time.monotonic() - started)

    def _deregister(self, worker_id: int) -> None:
        """SIGTERM: sessions were checkpointed by the daemon; hand them back to the scheduler."""
        worker = GpuWorker.objects.get(pk=worker_id)
        sessions_recover(worker=worker)
        with contextlib.suppress(TransitionError):
            worker_release(worker=worker)
        scheduler_trigger("worker")
