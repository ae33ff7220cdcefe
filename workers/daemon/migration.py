"""The worker's migration endpoint (TurboServe §6.1): state regions leaving and arriving.

Only at chunk boundaries: (i) the source freezes the session and sends its state region on a side
thread (``workers.runtime.transport``) while its other sessions step; (ii) the target receives and
verifies it on a side thread, and the hot loop installs it, frozen; (iii) the control plane flips
ownership with the epoch and the target's ``activate`` lets it generate its next chunk. Any failure
before the flip leaves the session on the source. A paused one-shot job travels the same way
(docs/jobs.md) and arrives paused.
"""

from __future__ import annotations

import contextlib
import logging
import queue
import threading
from concurrent.futures import Future
from typing import Any

from workers.daemon.answers import DEFERRED, Answers, CommandRefused
from workers.daemon.jobs import JobRunner
from workers.daemon.stages import StageRole
from workers.daemon.streams import OwnedSession, Streams
from workers.ports import Reporter
from workers.runtime.engine import HostStateRecord, SessionNotFound
from workers.runtime.transport import send_state

logger = logging.getLogger("workers.daemon")


class MigrationEndpoint:
    """``outgoing``: the sessions and jobs whose region is on its way out (shared with `Streams`,
    which steps none of them meanwhile); ``listener``: the worker's `MigrationListener` (None: it
    takes no migrations in)."""

    def __init__(
        self,
        *,
        name: str,
        streams: Streams,
        jobs: JobRunner,
        stage_role: StageRole,
        answers: Answers,
        reporter: Reporter,
        outgoing: dict[str, Future],
        listener: Any = None,
        timeout_s: float = 20.0,
    ) -> None:
        self.name = name
        self.streams = streams
        self.engine = streams.engine
        self.jobs = jobs
        self.stage_role = stage_role
        self.answers = answers
        self.reporter = reporter
        self.outgoing = outgoing
        self.listener = listener
        self.timeout_s = timeout_s
        self.receiving: set[str] = set()
        self.arrivals: queue.Queue = queue.Queue()  # (owned, park, received, future)
        self.job_arrivals: queue.Queue = queue.Queue()  # (job id, epoch, received, future)

    def in_flight(self) -> int:
        return len(self.outgoing) + len(self.receiving)

    # --- leaving -------------------------------------------------------------------------------

    def migrate_out(self, command: dict) -> Any:
        """Step (i): freeze at this chunk boundary and send the state region on a side thread.

        With ``"job"`` in place of ``"session"`` (docs/jobs.md) the job's region leaves the same way,
        from its parked host record or frozen at this step boundary."""
        if "job" in command:
            owned_job = self.jobs.owned(command)
            if owned_job.job_id in self.outgoing:
                raise CommandRefused(f"job {owned_job.job_id} is already migrating")
            manifest, tensors = self.jobs.region_for_migration(owned_job)
            return self._send_region(owned_job.job_id, command, manifest, tensors)
        owned = self.streams.owned(command)
        sid = owned.session_id
        if sid in self.outgoing:
            raise CommandRefused(f"session {sid} is already migrating")
        if owned.parked is not None:
            record = owned.parked
            manifest, tensors = record.manifest, record.tensors
        else:
            manifest, tensors = self.engine.export_state(sid)
        meta = manifest.setdefault("meta", {})
        meta["prompts"] = owned.prompts
        meta["parked"] = owned.parked is not None
        return self._send_region(sid, command, manifest, tensors)

    def _send_region(self, sid: str, command: dict, manifest: dict, tensors: dict) -> Any:
        """Send a (session's or job's) state region to the command's target on a side thread."""
        new_epoch = int(command["new_epoch"])
        future: Future = Future()

        def transfer() -> None:
            try:
                report = send_state(
                    command["target_address"],
                    manifest,
                    tensors,
                    device=self.engine.device,
                    timeout_s=self.timeout_s,
                    session_id=sid,
                    epoch=new_epoch,
                )
                future.set_result(report)
            except BaseException as exc:  # reported from the hot loop
                future.set_exception(exc)

        self.outgoing[sid] = future
        future.command = command  # type: ignore[attr-defined]
        threading.Thread(target=transfer, name=f"migrate-{sid[:8]}", daemon=True).start()
        return DEFERRED

    def collect_outgoing(self) -> bool:
        """Answer the transfers that ended (from the hot loop): a verified one forgets the region
        here, a failed one thaws it."""
        did = False
        for sid, future in list(self.outgoing.items()):
            # The answer flips ownership and the publish lease, and the target resumes after the
            # delivered mark: every chunk generated here before the freeze must be sent first.
            if not future.done() or self.streams.publisher.queued(sid):
                continue
            did = True
            del self.outgoing[sid]
            command = future.command  # type: ignore[attr-defined]
            owned = self.streams.sessions.get(sid) or self.jobs.jobs.get(sid)
            error = future.exception()
            # A job's migration is settled by the command's answer alone (docs/jobs.md); the
            # migration_* reports are the sessions' §6.1 ownership flip.
            is_job = "job" in command
            if error is None:
                report = future.result()
                # Step (iii) happens in the control plane (ownership flips with the epoch); the
                # source forgets the session only now that the target has verified it.
                self.streams.sessions.pop(sid, None)
                self.jobs.jobs.pop(sid, None)
                with contextlib.suppress(SessionNotFound):
                    self.engine.remove(sid)
                summary = {
                    "bytes": getattr(report, "nbytes", None),
                    "seconds": getattr(report, "seconds", None),
                }
                self.answers.give(command, "acked", result=summary)
                if not is_job:
                    self.reporter.migration_sent(command, summary)
            else:
                if owned is not None and owned.parked is None:
                    self.engine.thaw(sid)
                self.answers.give(command, "failed", f"{type(error).__name__}: {error}")
                if not is_job:
                    self.reporter.migration_failed(command, f"{type(error).__name__}: {error}")
        return did

    # --- arriving ------------------------------------------------------------------------------

    def migrate_in(self, command: dict) -> Any:
        """Step (ii): receive and verify the region on a side thread; the hot loop installs it.

        The listener's ``install`` only validates the manifest against our model (a mismatch
        rejects the migration on both sides); the tensors are adopted into the engine at the next
        chunk boundary, and the session stays frozen until the control plane's ``activate``.
        """
        if self.listener is None:
            raise CommandRefused(f"worker {self.name} has no migration listener")
        if "job" in command:
            return self._job_migrate_in(command)
        host = self.stage_role.host
        if not host.holds_sessions:
            raise CommandRefused(host.sessions_refused)
        sid = command["session"]
        if sid in self.streams.sessions or sid in self.receiving:
            raise CommandRefused(f"session {sid} is already on {self.name}")
        owned = self.streams.new_owned(command)
        owned.active = False
        park = bool(command.get("park"))
        received: dict[str, Any] = {}

        def install(manifest: dict, tensors: dict) -> None:
            self.engine.model.validate_manifest(manifest)
            received["manifest"], received["tensors"] = manifest, tensors

        # Keyed by (session, epoch): concurrent migrations into this worker each take their own
        # source's hello, and a stale source of an older epoch is never taken for this one.
        future = self.listener.receive_in_background(
            self.timeout_s, install, session_id=sid, epoch=owned.epoch
        )
        self.receiving.add(sid)
        future.add_done_callback(lambda fut: self.arrivals.put((owned, park, received, fut)))
        return {"listening": self.listener.address}

    def _job_migrate_in(self, command: dict) -> dict:
        """A paused job arriving (docs/jobs.md): verified like a session's region, then held paused
        on the host until a ``job_resume``."""
        job_id, epoch = command["job"], int(command["epoch"])
        if job_id in self.jobs.jobs or job_id in self.receiving:
            raise CommandRefused(f"job {job_id} is already on {self.name}")
        host = self.stage_role.host
        if not host.runs_jobs:
            raise CommandRefused(f"role {host.role} runs no jobs")
        if host.needs_decoder and "decoder" in command:
            self.stage_role.use_decoder(command)
        received: dict[str, Any] = {}

        def install(manifest: dict, tensors: dict) -> None:
            meta = manifest.get("meta", {})
            if not isinstance(meta, dict) or not meta.get("job"):
                raise ValueError(f"the region sent for job {job_id} is not a job's")
            self.engine.model.validate_manifest(manifest)
            received["manifest"], received["tensors"] = manifest, tensors

        future = self.listener.receive_in_background(self.timeout_s, install, session_id=job_id, epoch=epoch)
        self.receiving.add(job_id)
        future.add_done_callback(lambda fut: self.job_arrivals.put((job_id, epoch, received, fut)))
        return {"listening": self.listener.address}

    def collect_arrivals(self) -> bool:
        """Install the regions that arrived (from the hot loop): jobs paused, sessions frozen until
        their ``activate`` (applied now if it came first)."""
        did = self._collect_job_arrivals()
        while True:
            try:
                owned, park, received, future = self.arrivals.get_nowait()
            except queue.Empty:
                return did
            did = True
            sid = owned.session_id
            self.receiving.discard(sid)
            if future.exception() is not None:
                logger.warning("incoming migration failed session=%s error=%s", sid, future.exception())
                self.streams.pending_activation.pop(sid, None)
                continue
            self._install(owned, park, received["manifest"], received["tensors"])
            self.streams.sessions[sid] = owned
            early = self.streams.pending_activation.pop(sid, None)
            if early is not None:
                self.streams.activate(owned, early)

    def _install(self, owned: OwnedSession, park: bool, manifest: dict, tensors: dict) -> None:
        sid = owned.session_id
        meta = manifest.get("meta", {})
        owned.prompts = [(int(f), str(t)) for f, t in meta.get("prompts", [])] or owned.prompts
        if park or meta.get("parked"):
            host = {k: v.to("cpu") for k, v in tensors.items()}
            owned.parked = HostStateRecord(
                sid,
                manifest,
                host,
                sum(t.numel() * t.element_size() for t in host.values()),
                0.0,
                pinned=False,
            )
        else:
            self.engine.import_state(sid, manifest, tensors, copy=False)

    def _collect_job_arrivals(self) -> bool:
        did = False
        while True:
            try:
                job_id, epoch, received, future = self.job_arrivals.get_nowait()
            except queue.Empty:
                return did
            did = True
            self.receiving.discard(job_id)
            if future.exception() is not None:
                logger.warning("incoming job migration failed job=%s error=%s", job_id, future.exception())
            else:
                self.jobs.arrived(job_id, epoch, received["manifest"], received["tensors"])

    def activate(self, command: dict) -> dict:
        """After the ownership flip: the migrated session generates its next chunk here."""
        sid = command["session"]
        owned = self.streams.sessions.get(sid)
        if owned is None:
            if sid in self.receiving:  # the ack raced ahead of our arrival bookkeeping
                self.streams.pending_activation[sid] = command
                return {"pending": True}
            raise CommandRefused(f"session {sid} has not arrived on {self.name}")
        return self.streams.activate(owned, command)
