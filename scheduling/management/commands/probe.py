"""``manage.py probe ROLE``: one health check as an exit status, for exec probes and supervisors.

``probe web`` (PostgreSQL and Redis, what ``/readyz`` checks, without HTTP), ``probe celery
[--node scheduler@host]`` (the worker answers a ping over the broker), ``probe beat`` (beat
published a task recently), ``probe worker NAME [--serving]`` (the GPU worker's heartbeat is fresh;
with ``--serving``, it also takes sessions), ``probe hostcache NAME`` (the host cache is live and
its heartbeat fresh). Prints
one JSON line; exits 0 when healthy, 1 when not (see ``scheduling/health.py`` for each rule).
"""

from __future__ import annotations

import json
import sys
from dataclasses import asdict

from django.core.management.base import BaseCommand, CommandError

from contracts.health import Check, readiness
from scheduling.health import BEAT_MAX_AGE_S, beat_check, celery_check, gpu_worker_check, host_cache_check

ROLES = ("web", "celery", "beat", "worker", "hostcache")


class Command(BaseCommand):
    help = "Check one role's health (web, celery, beat, worker NAME, hostcache NAME); exit 0 if healthy, 1 if not."

    def add_arguments(self, parser):
        parser.add_argument("role", choices=ROLES)
        parser.add_argument(
            "name", nargs="?", default=None, help="the GPU worker's or host cache's name (worker, hostcache)"
        )
        parser.add_argument("--node", default=None, help="Celery node name (default scheduler@<hostname>)")
        parser.add_argument("--timeout", type=float, default=5.0, help="Celery ping timeout, seconds")
        parser.add_argument(
            "--max-age",
            type=float,
            default=None,
            help="heartbeat age limit, seconds (beat, worker, hostcache)",
        )
        parser.add_argument(
            "--serving", action="store_true", help="worker: healthy only while it takes sessions (ready)"
        )

    def handle(
        self,
        *args,
        role: str,
        name: str | None,
        node: str | None,
        timeout: float,
        max_age,
        serving: bool,
        **options,
    ):
        if role in ("worker", "hostcache") and not name:
            raise CommandError(f"probe {role} needs the {role}'s NAME")
        if serving and role != "worker":
            raise CommandError("--serving applies to probe worker only")
        if max_age is not None and max_age <= 0:
            raise CommandError("--max-age must be positive")
        checks: list[Check]
        if role == "web":
            checks = readiness()
        elif role == "celery":
            checks = [celery_check(node, timeout_s=timeout)]
        elif role == "beat":
            checks = [beat_check(max_age_s=max_age or BEAT_MAX_AGE_S)]
        elif role == "hostcache":
            checks = [host_cache_check(name, max_age_s=max_age)]
        else:
            checks = [gpu_worker_check(name, max_age_s=max_age, serving=serving)]
        healthy = all(check.ok for check in checks)
        self.stdout.write(
            json.dumps({"role": role, "healthy": healthy, "checks": [asdict(c) for c in checks]})
        )
        if not healthy:
            sys.exit(1)
