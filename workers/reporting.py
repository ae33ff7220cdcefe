"""The worker daemon's side-effect sink: PostgreSQL writes on a thread beside the hot loop.

This is the ``Reporter`` seam's control-plane side, and the only module of ``workers`` that imports
the control plane. Chunk records are buffered and written in batches (COPY into a temporary table,
then one INSERT … ON CONFLICT DO NOTHING), with session progress updated in the same transaction.
Command answers, migration results and heartbeats go through the control plane's services, so the
daemon never holds session logic of its own.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable
from typing import Any

from django.db import close_old_connections, connection

from gpu.services import worker_heartbeat
from scheduling.live.answers import command_answered, migration_completed, migration_failed
from sessions.ingest import chunk_records_ingest
from workers.daemon import Reporter

logger = logging.getLogger("workers.reporting")

FLUSH_S = 0.25


class DjangoReporter(Reporter, threading.Thread):
    def __init__(self, worker_id: int, worker_name: str) -> None:
        threading.Thread.__init__(self, name="reporter", daemon=True)
        self.worker_id = worker_id
        self.worker_name = worker_name
        self.tasks: queue.Queue[Callable[[], None] | None] = queue.Queue()
        self.rows: list[dict[str, Any]] = []
        self.rows_lock = threading.Lock()
        self.closed = threading.Event()
        self.start()

    # --- Reporter interface (called from the hot loop and the publisher) ------------------------

    def chunk(self, row: dict[str, Any]) -> None:
        with self.rows_lock:
            self.rows.append(row)

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
        last_flush = time.monotonic()
        try:
            while True:
                try:
                    task = self.tasks.get(timeout=FLUSH_S)
                except queue.Empty:
                    task = ...
                if task is None:
                    break
                if task is not ...:
                    self._safely(task)
                if time.monotonic() - last_flush >= FLUSH_S:
                    self._safely(self.flush)
                    last_flush = time.monotonic()
            self._safely(self.flush)
        finally:
            connection.close()

    def _safely(self, task: Callable[[], None]) -> None:
        close_old_connections()
        try:
            task()
        except Exception:
            logger.exception("report failed worker=%s", self.worker_name)

    def flush(self) -> int:
        with self.rows_lock:
            rows, self.rows = self.rows, []
        if not rows:
            return 0
        return chunk_records_ingest(rows=rows, worker_id=self.worker_id)
