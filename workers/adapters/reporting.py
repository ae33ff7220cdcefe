"""The worker daemon's side-effect sink: control-plane writes on a thread beside the hot loop.

The Django side of the ``Reporter`` port (``workers.ports``). Command answers, migration results and
heartbeats go through the control plane's services, so the daemon never holds session logic of its
own. Chunk records do not pass here: the publisher appends each to the durable record stream
(``contracts.wire.records``) before the chunk is sent, so none is lost with a killed worker's
buffers, and the control plane ingests them.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable

from django.db import close_old_connections, connection

from gpu.services import worker_heartbeat, worker_weights_complete
from scheduling.live.answers import command_answered, migration_completed, migration_failed
from scheduling.live.scaling import scaling_phase_record
from sessions import jobs
from workers.ports import Reporter

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

    def heartbeat(
        self, telemetry: dict, resident: list[str], parked: list[str], stage: dict | None = None
    ) -> None:
        # The stage role (issue 15) rides in the telemetry sample: {"stage_role": "DC"}, and on an
        # encoder worker {"encoder": {"queue", "served", "encode_ms_p50", ...}, "session_capacity": 0},
        # on a decoder worker {"decoder": {"queue", "served", "decode_ms_p50", "clients"}}.
        report = {**telemetry, **(stage or {})}
        self.tasks.put(lambda: worker_heartbeat(worker_id=self.worker_id, telemetry=report))

    # One-shot jobs (the worker side of the jobs contract, docs/jobs.md): reports go to sessions.jobs.

    def job_progress(
        self, job_id: str, epoch: int, worker_name: str, *, state: str, step: int, steps: int
    ) -> None:
        def report() -> None:
            jobs.job_progress(job_id, epoch, worker_name, state=state, step=step, steps=steps)

        self.tasks.put(report)

    def job_completed(
        self,
        job_id: str,
        epoch: int,
        worker_name: str,
        *,
        content: bytes,
        content_type: str,
        extension: str,
        run_s: float,
    ) -> None:
        def report() -> None:
            jobs.job_completed(
                job_id,
                epoch,
                worker_name,
                content=content,
                content_type=content_type,
                extension=extension,
                run_s=run_s,
            )

        self.tasks.put(report)

    def job_failed(self, job_id: str, epoch: int, worker_name: str, *, reason: str) -> None:
        def report() -> None:
            jobs.job_failed(job_id, epoch, worker_name, reason=reason)

        self.tasks.put(report)

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


def phase_report(*, worker_id: int, phase: str, source: str = "", detail: str = "") -> None:
    """A scale-out phase of this worker: on its row and on the scale-out action that asked for it."""
    if phase == "weights_complete":
        worker_weights_complete(worker_id=worker_id, source=source, detail=detail)
    scaling_phase_record(worker_id=worker_id, phase=phase, source=source)
