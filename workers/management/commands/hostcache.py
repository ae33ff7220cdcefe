"""``python manage.py hostcache --model P``: hold model weights in host memory and serve them to peers."""

from __future__ import annotations

import logging
import os
import signal
import socket

import torch
from django.conf import settings
from django.core.management.base import BaseCommand, CommandError

from contracts.catalog.presets import PRESETS
from workers.adapters.pool import DjangoHostCacheLink
from workers.hostcache import HostCacheDaemon
from workers.runtime.models import model_class
from workers.runtime.transport.pair import is_loopback

logger = logging.getLogger("workers.hostcache")


class Command(BaseCommand):
    help = (
        "Run a host cache: reserve each model's host copy in the parameter pool (at most POOL_HOST_COPIES "
        "per model in the cluster), fill it from a GPU holder or local storage, serve blocks to peers."
    )

    def add_arguments(self, parser):
        parser.add_argument(
            "--model",
            action="append",
            default=None,
            help="model preset (repeatable; default: HOSTCACHE_MODELS)",
        )
        parser.add_argument("--name", default=None, help="cache name (default: cache-<host>-<pid>)")
        parser.add_argument(
            "--capacity-mb",
            type=int,
            default=None,
            help="host memory to fill (default: HOSTCACHE_CAPACITY_MB)",
        )
        parser.add_argument("--listen-host", default="127.0.0.1", help="address peers fetch blocks from")
        parser.add_argument(
            "--node",
            default="",
            help="the machine it runs on, as the scale planner's host (default: --listen-host); "
            "on Kubernetes $(NODE_NAME), as the worker Pods pass",
        )
        parser.add_argument("--heartbeat", type=float, default=None, help="heartbeat interval in seconds")
        parser.add_argument(
            "--weights-from", default="auto", choices=("auto", "pool", "disk"), help="where to fill from"
        )
        parser.add_argument("--link-mbps", type=float, default=None, help="pace serving to this many Mbit/s")
        parser.add_argument("--threads", type=int, default=1, help="torch CPU threads")

    def handle(self, *args, **options):
        conf = settings.STREAMSERVE
        models = options["model"] or list(conf["HOSTCACHE_MODELS"])
        if not models:
            raise CommandError("--model: name at least one model preset (or set HOSTCACHE_MODELS)")
        unknown = [m for m in models if m not in PRESETS]
        if unknown:
            raise CommandError(
                f"--model: unknown preset(s) {', '.join(unknown)}; known: {', '.join(sorted(PRESETS))}"
            )
        local = [m for m in models if not model_class(m).transferable_weights]
        if local:
            raise CommandError(
                f"--model: {', '.join(local)} load(s) from a checkpoint directory and cannot be pool-cached"
            )
        capacity_mb = (
            options["capacity_mb"] if options["capacity_mb"] is not None else conf["HOSTCACHE_CAPACITY_MB"]
        )
        if capacity_mb < 1:
            raise CommandError("--capacity-mb must be at least 1")
        heartbeat = options["heartbeat"] or conf["HEARTBEAT_INTERVAL_S"]
        if heartbeat <= 0:
            raise CommandError("--heartbeat must be positive")
        if options["link_mbps"] is not None and options["link_mbps"] <= 0:
            raise CommandError("--link-mbps must be positive")
        if conf["WORKER_MULTI_HOST"] and is_loopback(options["listen_host"]):
            # The cache registers this address in the parameter pool; a scale plan on another host
            # would chain from it, fail to connect and fall back to disk without a word.
            raise CommandError(
                f"--listen-host {options['listen_host']!r} is a loopback address, but WORKER_MULTI_HOST is set: "
                "workers on other hosts could not fetch blocks from this cache. Pass --listen-host with an "
                "address they reach (the node's address for a DaemonSet), or unset WORKER_MULTI_HOST for a "
                "one-host pool."
            )
        torch.set_num_threads(max(1, options["threads"]))
        daemon = HostCacheDaemon(
            name=options["name"] or f"cache-{socket.gethostname()}-{os.getpid()}",
            host=options["listen_host"],
            models=list(dict.fromkeys(models)),
            capacity_bytes=capacity_mb * (1 << 20),
            weights_dir=conf["WEIGHTS_DIR"],
            pool=DjangoHostCacheLink(),
            weights_from=options["weights_from"],
            link_mbps=options["link_mbps"],
            heartbeat_s=heartbeat,
            node=options["node"],
        )
        signal.signal(signal.SIGTERM, daemon.request_stop)
        signal.signal(signal.SIGINT, daemon.request_stop)
        daemon.run()
