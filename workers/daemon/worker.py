"""The GPU worker daemon: one model replica, many sessions, commands applied at chunk boundaries.

The hot loop (`WorkerDaemon.step`) only touches the engine, Redis (commands in) and in-process
queues; it composes one part per role (``workers.daemon``'s docstring lists them). Everything
slower runs on threads beside it: the chunk publisher, the reporter (``workers.ports.Reporter``),
the heartbeat, migrations' transfers, and the encoding of finished one-shot jobs, which take the
time the streams leave: a step of denoising runs only when no chunk is due and it is expected to
fit the slack the streams' next chunks leave (``contracts.coserve``, the rule the simulator
measures); it is abandoned at a block boundary once that slack is spent, or when a stream claims
the device. A job that has made no progress for a few chunk periods has its step probed in a
slightly larger slack (the starvation guard, ``WorkerDaemon.__init__``).
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import redis

from contracts.coserve import stream_slack_s
from contracts.wire.channel import CommandReader, StreamClaimWatch
from workers.daemon.answers import Answers
from workers.daemon.commands import CommandDispatcher
from workers.daemon.jobs import JobRunner
from workers.daemon.liveness import Heartbeat
from workers.daemon.migration import MigrationEndpoint
from workers.daemon.orphan import OrphanWatch
from workers.daemon.outage import REDIS_DOWN, retry_delay
from workers.daemon.publisher import ChunkPublisher
from workers.daemon.stages import StageRole
from workers.daemon.streams import OwnedSession, Streams
from workers.ports import Reporter
from workers.runtime.engine import ChunkEngine
from workers.runtime.stages.host import StageHost

logger = logging.getLogger("workers.daemon")


class WorkerDaemon:
    def __init__(
        self,
        *,
        name: str,
        engine: ChunkEngine,
        redis_client: redis.Redis,
        reporter: Reporter,
        capacity: int,
        migration_listener: Any = None,
        checkpoint_dir: str | os.PathLike | None = None,
        checkpoint_every: int = 8,
        migration_timeout_s: float = 20.0,
        heartbeat_s: float = 1.0,
        lookahead_chunks: float = 1.0,
        job_reserve_chunks: float = 0.5,
        starved_after_chunks: float | None = 4.0,
        starved_reserve_chunks: float = 0.25,
        liveness_ttl_s: float | None = None,
        clock: Callable[[], float] = time.monotonic,
        stage_host: StageHost | None = None,
        orphan_timeout_s: float = 0.0,
    ) -> None:
        self.name = name
        self.engine = engine
        self.redis = redis_client
        self.reporter = reporter
        self.listener = migration_listener
        self.clock = clock
        self.stopping = threading.Event()
        # No command and no acknowledged heartbeat for orphan_timeout_s: the control plane is gone.
        self.orphan = OrphanWatch(timeout_s=orphan_timeout_s, clock=clock)
        self.orphaned = False  # the loop stopped because the control plane was lost
        # The worker's stage role (issue 15; docs/runtime.md "Stage-level serving"): EDC unless
        # built over a stage model; `set_role` changes it at a chunk boundary.
        self.stage = stage_host or StageHost(
            engine, store_address=getattr(migration_listener, "address", None)
        )
        reader = CommandReader(redis_client, name)
        # Sets its flag when a stream claims the device while a job step runs: the step is
        # abandoned at its next block boundary and the command is applied at once.
        self.claims = StreamClaimWatch(redis_client, name)
        self.publisher = ChunkPublisher(name, redis_client)
        outgoing: dict[str, Future] = {}  # session or job id → its region's transfer in flight
        self.streams = Streams(
            name=name,
            engine=engine,
            publisher=self.publisher,
            capacity=capacity,
            clock=clock,
            leaving=outgoing,
            lookahead_chunks=lookahead_chunks,
            job_reserve_chunks=job_reserve_chunks,
            checkpoint_dir=checkpoint_dir,
            checkpoint_every=checkpoint_every,
        )
        self.jobs = JobRunner(
            engine=engine, reporter=reporter, worker_name=name, capacity=capacity, clock=clock
        )
        self.stage_role = StageRole(name=name, host=self.stage, streams=self.streams, jobs=self.jobs)
        answers = Answers(reporter)
        self.migration = MigrationEndpoint(
            name=name,
            streams=self.streams,
            jobs=self.jobs,
            stage_role=self.stage_role,
            answers=answers,
            reporter=reporter,
            outgoing=outgoing,
            listener=migration_listener,
            timeout_s=migration_timeout_s,
        )
        self.commands = CommandDispatcher(
            name=name,
            reader=reader,
            answers=answers,
            streams=self.streams,
            jobs=self.jobs,
            stage_role=self.stage_role,
            migration=self.migration,
            stopping=self.stopping,
        )
        self.heartbeat = Heartbeat(
            name=name,
            reporter=reporter,
            redis_client=redis_client,
            streams=self.streams,
            jobs=self.jobs,
            stage=self.stage,
            stopping=self.stopping,
            interval_s=heartbeat_s,
            ttl_s=liveness_ttl_s,
            orphan=self.orphan,
        )
        # Whether the next turn looks for a job step before blocking on commands: after a job step
        # (jobs are making progress) and after a chunk batch (the slack has changed).
        self._job_may_step = False
        # The starvation guard (issue 32): a job whose step is estimated longer than any slack the
        # streams leave with their reserve would never run — a tiny 128²×16 video beside two
        # streams, its step estimated from a 64² image's by pixels × frames at 0.8 s, measured at
        # 0.05 s once run. Once no job step has completed for `starved_after_chunks` chunk periods
        # while jobs wait, the most urgent job's step is probed (run whatever its estimate, in a
        # slack of at least a chunk's generation time: `plan_job_batch(probe=True)`) and may take
        # part of the reserve: the slack is computed with chunks due `starved_reserve_chunks` (not
        # `job_reserve_chunks`) before they play. Chunks still end before they are due (the step is
        # abandoned at that slack's end, its work lost), only their lead shrinks; a step that
        # completes sets its shape's estimate from the measurement. None: no guard.
        self.starved_after_s = (
            None if starved_after_chunks is None else starved_after_chunks * self.streams.chunk_s
        )
        self.starved_reserve_chunks = starved_reserve_chunks
        self._jobs_progressed_at: float | None = None  # the last completed job step (or first wait)
        self.guard_steps = 0  # steps the guard let run to completion
        self.guard_abandoned = 0

    @property
    def sessions(self) -> dict[str, OwnedSession]:
        return self.streams.sessions

    @property
    def checkpoint_dir(self) -> Path | None:
        return self.streams.checkpoint_dir

    # --- lifecycle -----------------------------------------------------------------------------

    def start(self) -> None:
        self.publisher.start()
        self.heartbeat.start()
        self.claims.start()
        self.stage.start()

    def run(self) -> None:
        self.start()
        outage = 0
        try:
            while not self.stopping.is_set():
                try:
                    self.step()
                    outage = 0
                except REDIS_DOWN as exc:
                    # Commands cannot be read nor acknowledged: wait for Redis. Sessions stay
                    # here; the heartbeat (PostgreSQL) keeps telling the control plane we live.
                    self.publisher.redis_failed()
                    if outage == 0:
                        logger.warning("redis.unreachable worker=%s: waiting for it (%s)", self.name, exc)
                    self.stopping.wait(retry_delay(outage))
                    outage += 1
        finally:
            self.shutdown()

    def _orphan_check(self) -> bool:
        """Stop (``run`` then checkpoints every session) when the control plane is lost."""
        if not self.orphan.lost():
            return False
        logger.error(
            "worker.orphaned worker=%s: no command and no heartbeat acknowledged for %.0fs "
            "(WORKER_ORPHAN_TIMEOUT_S=%g); checkpointing %d session(s) and exiting",
            self.name,
            self.orphan.silent_s(),
            self.orphan.timeout_s,
            len(self.streams.sessions),
        )
        self.orphaned = True
        self.stopping.set()
        return True

    def request_stop(self, *_args: Any) -> None:
        """SIGTERM: the loop finishes the chunk in progress, then shuts down."""
        self.stopping.set()

    def shutdown(self) -> None:
        """Checkpoint every session we hold so the control plane can restart them elsewhere."""
        for sid in list(self.streams.sessions):
            self.streams.checkpoint(sid)
        if self.jobs.jobs:
            # Jobs are not checkpointed: the control plane re-runs them from step 0 elsewhere.
            logger.warning("worker %s stops with %d job(s) unfinished", self.name, len(self.jobs.jobs))
        self.jobs.close()
        self.claims.stop()
        self.publisher.stop()
        self.publisher.join(timeout=10)
        self.reporter.close()
        self.stage.close()
        self.engine.close()
        if self.listener is not None:
            self.listener.close()

    # --- the hot loop --------------------------------------------------------------------------

    def step(self) -> bool:
        """One bounded unit: apply commands, then run at most one batched job step that fits the
        slack the streams leave or, when none does, at most one coalesced batch of due chunks.
        Returns whether anything was done. A worker that lost its control plane does nothing more:
        it stops (``run`` checkpoints every session on the way out)."""
        if self._orphan_check():
            return False
        now = self.clock()
        due_at = self.streams.earliest_due()
        wait_s = 0.0 if due_at is None else max(0.0, due_at - now)
        block_ms = int(min(wait_s, 0.2) * 1000) if due_at is not None else 200
        if self._job_may_step:
            # Poll for commands without blocking: blocking until the next chunk is due would spend
            # the slack the last chunk left (issue 32: the loop woke only for chunks, so a job step
            # was tried only when a command happened to arrive).
            block_ms = 0
        did = self.migration.collect_arrivals()
        if self.commands.apply_pending(block_ms=None if did else (block_ms or None)):
            self.orphan.heard()
            did = True
        did = self.migration.collect_outgoing() or did
        did = self.streams.collect_superseded() or did
        now = self.clock()
        # Streams first, but by their deadlines, not their look-ahead: a job step runs when it fits
        # the slack the streams' next chunks leave, even before a chunk the look-ahead made due
        # (issue 32: a step ran only in the time before the earliest chunk's look-ahead horizon,
        # which coalescing and staggered phases kept near zero, so jobs starved beside a mostly
        # idle device). Chunks the step delays are still done by their `finish_by`.
        if self.jobs.jobs:
            if self._job_step(now, self._job_slack_s(now)):
                self._job_may_step = True
                return True
            now = self.clock()
        else:
            self.jobs.abandoned = None  # what a claim cost was answered by now
            self._jobs_progressed_at = None
        due = self.streams.due(now)
        if not due:
            # Nothing fits and no chunk is due: the next turn blocks until a chunk or a command is
            # due (the slack only shrinks while no chunk runs).
            self._job_may_step = False
            return did
        results = self.streams.generate(due)
        self.stage_role.note_waiting(due, results)
        if not results:
            # Every due session waits for a prompt's embeddings from the encoder worker (a DC
            # worker, `step_ready`): give the answer a moment instead of spinning on Redis.
            self.stopping.wait(0.002)
        self.streams.deliver(results)
        self._job_may_step = bool(self.jobs.jobs)
        return True

    def _job_slack_s(self, now: float) -> float:
        """The slack a job step may take now: what the streams leave with their reserve, or, for a
        starved job (the guard above), with the smaller starvation reserve."""
        if self._jobs_progressed_at is None:
            self._jobs_progressed_at = now
        reserve = self.starved_reserve_chunks if self._starved(now) else None
        return stream_slack_s(self.streams.demands(reserve), now=now)

    def _starved(self, now: float) -> bool:
        return (
            self.starved_after_s is not None
            and self._jobs_progressed_at is not None
            and now - self._jobs_progressed_at >= self.starved_after_s
        )

    def _job_step(self, now: float, slack_s: float) -> bool:
        """One job step, abandoned at a block boundary if a stream claims the device meanwhile or
        once the streams' slack is spent (the step overran its estimate)."""
        self.claims.arm(self.commands.reader.last_id)
        abandoned_before = self.jobs.abandoned_steps
        starved = self._starved(now)
        try:
            stepped = self.jobs.run_step(
                now=now,
                free_s=slack_s,
                probe_s=self.streams.chunk_generation_s,
                abandon=ClaimOrDeadline(self.claims.claimed, deadline=now + slack_s, clock=self.clock),
                probe=starved,
            )
            if self.jobs.abandoned is not None and not self.claims.claimed.is_set():
                self.jobs.abandoned = None  # the slack ran out: no stream's claim to answer with it
            if stepped and self.jobs.abandoned_steps == abandoned_before:  # a step completed
                self.guard_steps += starved
                self._jobs_progressed_at = self.clock()
            elif stepped and starved:
                # The probe overran even that slack (or a stream claimed the device): the next one
                # after another starvation period, so probes cost the streams' lead at most once a
                # period.
                self.guard_abandoned += 1
                self._jobs_progressed_at = self.clock()
            return stepped
        finally:
            self.claims.disarm()


class ClaimOrDeadline(threading.Event):
    """What a job step checks at each block boundary (``check_abandon`` reads `is_set`): a stream's
    claim (the `StreamClaimWatch`'s event), or the moment the streams' slack is spent, so a step
    that overruns its estimate does not make a chunk end after its ``finish_by``."""

    def __init__(self, claimed: threading.Event, *, deadline: float, clock: Callable[[], float]) -> None:
        super().__init__()
        self.claimed = claimed
        self.deadline = deadline
        self.clock = clock

    def is_set(self) -> bool:
        return self.claimed.is_set() or self.clock() >= self.deadline
