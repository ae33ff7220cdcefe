"""The worker daemon's side-effect sink: control-plane writes on a thread beside the hot loop.

This is the ``Reporter`` seam's control-plane side, and the only module of ``workers`` that imports
the control plane. Command answers, migration results and heartbeats go through the control plane's
services, so the daemon never holds session logic of its own. Chunk records do not pass here: the
publisher appends each to the durable record stream (``workers.records``) before the chunk is
sent, so none is lost with a killed worker's buffers, and the control plane ingests them.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable

from django.db import close_old_connections, connection

from gpu.services import worker_heartbeat
from scheduling.live.answers import command_answered, migration_completed, migration_failed
from workers.daemon import Reporter

logger = logging.getLogger("workers.reporting")


class DjangoReporter(Reporter, threading.Thread):
    def __init__(self, worker_id: int, worker_name: str) -> None:
        threading.Thread.__init__(self, name="reporter", daemon=True)
        self.worker_id = worker_id
        self.worker_name = worker_name
        self.tasks: queue.Queue[Callable[[], None] | None] = queue.Queue()
        self.start()

    # --- Reporter interface (called from the hot loop and the heartbeat) --------------------------

    def answer(self, command: dict, status: str, reason: str = "", result: dict | None = None) -> None:
        self.tasks.put(
            lambda: command_answered(command=command, status=status, reason=reason, result=result or {})
        )

    def migration_sent(self, command: dict, report: dict) -> None:
        self.tasks.put(lambda: migration_completed(command=command, report=report))

    def migration_failed(self, command: dict, error: str) -> None:
        self.tasks.put(lambda: migration_failed(command=command, error=error))

    def heartbeat(self, telemetry: dict, resident: list[str], parked: list[str]) -> None:
        self.tasks.put(lambda: worker_heartbeat(worker_id=self.worker_id, telemetry=telemetry))

    def close(self) -> None:
        self.tasks.put(None)
        self.join(timeout=15)

    # --- the thread ------------------------------------------------------------------------------

    def run(self) -> None:
        try:
            while (task := self.tasks.get()) is not None:
                self._safely(task)
        finally:
            connection.close()

    def _safely(self, task: Callable[[], None]) -> None:
        close_old_connections()
        try:
            task()
        except Exception:
            logger.exception("report failed worker=%s", self.worker_name)
