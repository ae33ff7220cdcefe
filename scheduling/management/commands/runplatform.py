"""Start the whole platform on this machine: ASGI server, Celery worker and beat, demo user.

GPU workers are not listed here: the scheduler asks the configured provisioner for them (the
``local`` provisioner spawns ``gpuworker`` processes on this host).
"""

from __future__ import annotations

import os
import shlex
import sys

from django.conf import settings
from django.core.management import call_command
from django.core.management.base import BaseCommand, CommandError

from gpu.provisioners.registry import get_provisioner
from scheduling.services import beat_schedule_install


class Command(BaseCommand):
    help = "Run the web app, the scheduler (Celery worker + beat) and the demo; Ctrl-C stops everything."

    def add_arguments(self, parser):
        parser.add_argument("--host", default=settings.STREAMSERVE["HOST"])
        parser.add_argument("--port", type=int, default=settings.STREAMSERVE["PORT"])
        parser.add_argument("--no-demo-user", action="store_true", help="do not create the demo user")

    def handle(self, *args, host: str, port: int, no_demo_user: bool, **options):
        from honcho.manager import Manager

        if not 0 < port < 65536:
            raise CommandError(f"--port must be between 1 and 65535, got {port}")
        beat_schedule_install()
        if not no_demo_user:
            call_command("create_demo_user", stdout=self.stdout)
        python = shlex.quote(sys.executable)
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        manager = Manager()
        manager.add_process(
            "web",
            f"{python} -m uvicorn controlplane.asgi:application --host {shlex.quote(host)} --port {port} "
            "--ws websockets --no-access-log",
            env=env,
        )
        manager.add_process(
            "scheduler",
            f"{python} -m celery -A controlplane worker -Q scheduler,default -c 2 -n scheduler@%h --loglevel INFO",
            env=env,
        )
        manager.add_process("beat", f"{python} -m celery -A controlplane beat --loglevel INFO", env=env)
        shown_host = "localhost" if host in {"0.0.0.0", "127.0.0.1"} else host
        self.stdout.write(
            self.style.SUCCESS(
                f"StreamServe is starting: open http://{shown_host}:{port}/ (admin: /admin/, API docs: /api/docs/)"
            )
        )
        self.stdout.write(f"Provisioner: {settings.STREAMSERVE['PROVISIONER']}. Press Ctrl-C to stop.")
        try:
            manager.loop()
        finally:
            # The platform owns the workers the local provisioner started: release them with it.
            if settings.STREAMSERVE["PROVISIONER"] == "local":
                get_provisioner().release_all()
        sys.exit(manager.returncode)
