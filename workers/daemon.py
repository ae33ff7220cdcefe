"""The GPU worker daemon: one model replica, many sessions, commands applied at chunk boundaries.

The hot loop (``WorkerDaemon.step``) only touches the engine, Redis (commands in) and in-process
queues. Everything slower runs on threads beside it:

- the *publisher* waits for each chunk's encoded frames and sends them once to the session's
  channel-layer group (wire format: ``contracts.wire.frames``) while this worker holds the session's
  publish lease (``contracts.wire.channel.PublishFence``): the chunk's audit record goes to a durable Redis
  stream first (``contracts.wire.records``, ingested by the control plane), the delivered index is marked
  after the send;
- the *reporter* (``workers.ports.Reporter``; ``workers.adapters.reporting`` in production) answers commands and reports migrations and heartbeats
  to PostgreSQL through the control plane's services;
- the *heartbeat* samples telemetry every ``heartbeat_s`` and reports it;
- migrations run on their own threads (``workers.runtime.transport``) while other sessions step;
- one-shot jobs (``workers.job_runner``) take the time the streams leave: a step of denoising
  runs only when no chunk is due and it is expected to end before the next one must start, and a
  finished job is encoded on a thread of its own.

Pacing: a session's next chunk is due one chunk-duration after its previous one (real time), with
one chunk of look-ahead so the browser's jitter buffer never runs dry; sessions due within a
quarter chunk of each other are coalesced into one batched step (at most K).
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import itertools
import logging
import os
import queue
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import redis

from contracts.wire.channel import (
    CommandReader,
    PublishFence,
    ReceivedCommand,
    StreamClaimWatch,
    Verdict,
    claims_the_device,
    heartbeat_beat,
    send_command,
)
from contracts.wire.checkpoints import checkpoint_path
from contracts.wire.frames import chunk_message, group_name
from contracts.wire.records import chunk_record_append
from gpu.telemetry import sample
from workers.job_runner import JobRefused, JobRunner
from workers.ports import Reporter
from workers.runtime.engine import ChunkEngine, ChunkResult, HostStateRecord, SessionNotFound, region_to_bytes
from workers.runtime.jobs import window_s
from workers.runtime.stages.clients import StageUnavailable
from workers.runtime.stages.host import RoleRefused, StageHost
from workers.runtime.transport import send_state

logger = logging.getLogger("workers.daemon")

# Redis unreachable (restarted, failed over, a network blip): the daemon waits for it rather than
# exiting or dropping a chunk. Every Redis write it retries is idempotent (see ``ChunkPublisher``).
REDIS_DOWN = (redis.exceptions.ConnectionError, redis.exceptions.TimeoutError)
REDIS_RETRY_S = (0.1, 0.2, 0.5, 1.0)  # backoff between attempts, the last one repeated
# After an outage, how long a session's first chunk waits for its viewers' subscriptions to come
# back (the pub/sub channel layer re-subscribes about a second after Redis returns; a session nobody
# watches waits this long once per outage).
RESUBSCRIBE_WAIT_S = 5.0


@dataclass
class OwnedSession:
    """What the daemon knows about a session it holds (resident, parked or arriving)."""

    session_id: str
    epoch: int
    chunk_s: float
    active: bool = True  # False while frozen for migration or waiting for activation
    next_due: float = 0.0
    deliver_from: int = 0  # indices below this were published before (silent catch-up)
    parked: HostStateRecord | None = None
    prompts: list[tuple[int, str]] = field(default_factory=list)
    last_checkpoint: int = -1


class ChunkPublisher(threading.Thread):
    """Waits for encoded frames and publishes each chunk once to its session's group, only while
    this worker holds the session's publish lease (``contracts.wire.channel.PublishFence``).

    A chunk whose epoch the lease has passed is dropped, and the session goes on ``superseded``
    (session id, the lease's epoch) for the hot loop to forget: another owner streams it now.
    """

    def __init__(self, worker_name: str, redis_client: redis.Redis) -> None:
        super().__init__(name="chunk-publisher", daemon=True)
        self.worker_name = worker_name
        self.redis = redis_client
        self.fence = PublishFence(redis_client)
        self.items: queue.Queue[tuple[ChunkResult, int] | None] = queue.Queue()
        self.superseded: queue.Queue[tuple[str, int]] = queue.Queue()
        self.leases_lost: dict[str, int] = {}  # session id → the newer epoch that fenced us out
        self.published = 0
        self.outage_at = 0.0  # monotonic time the daemon last found Redis unreachable
        self._subscribers_checked: dict[str, float] = {}  # session id → when its viewers were last seen
        self._queued: collections.Counter[str] = collections.Counter()  # session id → chunks not done
        self._queued_lock = threading.Lock()

    def submit(self, result: ChunkResult, epoch: int) -> None:
        with self._queued_lock:
            self._queued[result.session_id] += 1
        self.items.put((result, epoch))

    def queued(self, session_id: str) -> int:
        """Chunks of ``session_id`` submitted and not yet sent (or dropped)."""
        with self._queued_lock:
            return self._queued[session_id]

    def stop(self) -> None:
        self.items.put(None)

    def redis_failed(self) -> None:
        """Redis was unreachable (here or in the hot loop): the channel layer's subscriptions broke."""
        self.outage_at = time.monotonic()

    def run(self) -> None:
        from channels.layers import get_channel_layer

        loop = asyncio.new_event_loop()
        layer = get_channel_layer()
        while True:
            item = self.items.get()
            if item is None:
                break
            result, epoch = item
            try:
                self._publish_retrying(loop, layer, result, epoch)
            except Exception:
                logger.exception(
                    "publishing chunk failed session=%s index=%s", result.session_id, result.chunk_index
                )
            finally:
                with self._queued_lock:
                    self._queued[result.session_id] -= 1
                    if self._queued[result.session_id] <= 0:
                        del self._queued[result.session_id]
        loop.close()

    def _publish_retrying(
        self, loop: asyncio.AbstractEventLoop, layer: Any, result: ChunkResult, epoch: int
    ) -> None:
        """Publish, waiting out a Redis outage: a chunk is never dropped because Redis restarted.

        Every step may run again: ``admit`` and ``mark_delivered`` are idempotent, a record
        appended twice is ingested once (ON CONFLICT), and a chunk sent twice (the send went
        through, its mark did not) is dropped by the session consumer as an index it has passed.
        Chunks queue behind this one meanwhile, in order.
        """
        for attempt in itertools.count():
            try:
                self._publish(loop, layer, result, epoch)
                return
            except REDIS_DOWN as exc:
                self.redis_failed()
                if attempt == 0:
                    logger.warning(
                        "redis.unreachable publishing session=%s index=%d: retrying (%s)",
                        result.session_id,
                        result.chunk_index,
                        exc,
                    )
                time.sleep(REDIS_RETRY_S[min(attempt, len(REDIS_RETRY_S) - 1)])

    def _publish(self, loop: asyncio.AbstractEventLoop, layer: Any, result: ChunkResult, epoch: int) -> None:
        sid, index = result.session_id, result.chunk_index
        if epoch < self.leases_lost.get(sid, -1):
            return  # already fenced out at this epoch: no round trip for the rest of the queue
        frames = result.frames(timeout=30)
        header = {
            "session": sid,
            "index": index,
            "epoch": epoch,
            "generation_ms": round(result.generation_ms, 3),
            "worker": self.worker_name,
            "batch_size": result.batch_size,
            "width": result.width,
            "height": result.height,
            "fps": result.fps,
            "mime": "image/jpeg",
            "generated_at": time.time(),
        }
        admission = self.fence.admit(sid, epoch, index)
        if admission.verdict is Verdict.STALE:
            logger.warning(
                "chunk.fenced session=%s index=%d epoch=%d lease=%d: another owner holds the session",
                sid,
                index,
                epoch,
                admission.lease,
            )
            self.leases_lost[sid] = admission.lease
            self.superseded.put((sid, admission.lease))
            return
        if admission.verdict is Verdict.PASSED:
            logger.info("chunk.passed session=%s index=%d delivered=%d", sid, index, admission.delivered)
            return
        if admission.delivered >= 0 and index > admission.delivered + 1:
            logger.warning("chunk.gap session=%s index=%d delivered=%d", sid, index, admission.delivered)
        # Its audit record is durable before any client can see it (raises: not published). After
        # the fence: a stale owner records nothing the current owner will also record.
        chunk_record_append(self.redis, header)
        if self._subscribers_checked.get(sid, 0.0) < self.outage_at:
            self._await_subscribers(loop.run_until_complete(_group_channel(layer, sid)), sid)
        loop.run_until_complete(layer.group_send(group_name(sid), chunk_message(header, frames)))
        # Marked only now that the channel layer has it: a takeover resumes after the last chunk
        # actually sent, never after one announced and then lost with a frozen or dead worker.
        self.fence.mark_delivered(sid, epoch, index)
        self.published += 1

    def _await_subscribers(self, channel: str | None, sid: str) -> None:
        """After a Redis outage, hold the session's next chunk until its viewers have subscribed
        again (at most ``RESUBSCRIBE_WAIT_S``).

        The pub/sub channel layer delivers a message to whoever is subscribed at that instant and
        keeps nothing: chunks published while the web servers' subscriptions were still being
        re-established after Redis came back would reach no client, a hole in every stream. (The
        list-based core layer keeps group membership and messages in Redis: nothing to wait for.)
        """
        if channel is not None:
            deadline = time.monotonic() + RESUBSCRIBE_WAIT_S
            while not self.redis.pubsub_numsub(channel)[0][1] and time.monotonic() < deadline:
                time.sleep(0.1)
        self._subscribers_checked[sid] = time.monotonic()


async def _group_channel(layer: Any, sid: str) -> str | None:
    """The Redis pub/sub channel of a session's group on the pub/sub layer (None on another layer).
    In a coroutine: the pub/sub layer resolves attributes on its per-event-loop instance."""
    channel_of = getattr(layer, "_get_group_channel_name", None)  # channels_redis pub/sub naming
    return channel_of(group_name(sid)) if channel_of is not None else None


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
        liveness_ttl_s: float | None = None,
        clock: Callable[[], float] = time.monotonic,
        stage_host: StageHost | None = None,
    ) -> None:
        self.name = name
        self.engine = engine
        # The worker's stage role (issue 15; docs/runtime.md "Stage-level serving"): EDC unless
        # built over a stage model; `set_role` changes it at a chunk boundary.
        self.stage = stage_host or StageHost(
            engine, store_address=getattr(migration_listener, "address", None)
        )
        self.redis = redis_client
        self.reporter = reporter
        self.capacity = capacity
        self.listener = migration_listener
        self.checkpoint_dir = Path(checkpoint_dir) if checkpoint_dir else None
        self.checkpoint_every = checkpoint_every
        self.migration_timeout_s = migration_timeout_s
        self.heartbeat_s = heartbeat_s
        self.lookahead_chunks = lookahead_chunks
        self.liveness_ttl_s = liveness_ttl_s
        self.clock = clock
        self.commands = CommandReader(redis_client, name)
        # Sets its flag when a stream claims the device while a job step runs: the step is
        # abandoned at its next block boundary and the command is applied at once.
        self.claims = StreamClaimWatch(redis_client, name)
        self.publisher = ChunkPublisher(name, redis_client)
        self.sessions: dict[str, OwnedSession] = {}
        self.answered: dict[str, str] = {}  # command id → status (idempotency)
        self.migrations: dict[str, Future] = {}  # session id → transfer in flight
        self.pending_activation: dict[str, dict[str, Any]] = {}
        self.receiving: set[str] = set()
        self.arrivals: queue.Queue = queue.Queue()
        self.job_arrivals: queue.Queue = queue.Queue()  # (job id, epoch, received, future)
        self.stopping = threading.Event()
        self.draining = False
        self._heartbeat = threading.Thread(target=self._heartbeat_loop, name="heartbeat", daemon=True)
        model = engine.model
        self.chunk_s = float(model.frames_per_chunk) / float(model.fps)
        self.jobs = JobRunner(
            engine=engine, reporter=reporter, worker_name=name, capacity=capacity, clock=clock
        )
        # How long the last chunk took to generate: the prior for a job step never measured yet
        # (``workers.runtime.jobs``); one chunk period until a chunk has run.
        self.chunk_generation_s = self.chunk_s
        self._job_stepped = False  # whether the last turn ran a job step

    # --- lifecycle -----------------------------------------------------------------------------

    def start(self) -> None:
        self.publisher.start()
        self._heartbeat.start()
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
                    self.stopping.wait(REDIS_RETRY_S[min(outage, len(REDIS_RETRY_S) - 1)])
                    outage += 1
        finally:
            self.shutdown()

    def request_stop(self, *_args: Any) -> None:
        """SIGTERM: the loop finishes the chunk in progress, then shuts down."""
        self.stopping.set()

    def shutdown(self) -> None:
        """Checkpoint every session we hold so the control plane can restart them elsewhere."""
        for sid in list(self.sessions):
            self._checkpoint(sid, force=True)
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
        """One bounded unit: apply commands, then run at most one coalesced batch of chunks or, when
        no chunk is due, at most one batched job step that ends before the next chunk must start.
        Returns whether anything was done."""
        now = self.clock()
        due_at = self._earliest_due()
        wait_s = 0.0 if due_at is None else max(0.0, due_at - now)
        block_ms = int(min(wait_s, 0.2) * 1000) if due_at is not None else 200
        if self._job_stepped:
            block_ms = 0  # jobs are making progress: poll for commands without blocking
        did = self._collect_arrivals()
        did = self._apply_commands(block_ms=None if did else (block_ms or None)) or did
        did = self._collect_migrations() or did
        did = self._collect_superseded() or did
        now = self.clock()
        due = self._due_sessions(now)
        if not due:
            # Chunks first: a job step runs only in the time left before the next chunk is due.
            free_s = window_s(self._next_chunk_start(), now)
            # When no job step fits, the next turn blocks until a chunk or a command is due.
            self._job_stepped = self._job_step(now, free_s)
            return self._job_stepped or did
        results = self.engine.step(max_batch=self.capacity, due=due)
        if self.stage.needs_encoder:
            # Who waits for a prompt's embeddings, and why: the heartbeat reports it.
            produced = {r.session_id for r in results}
            self.stage.note_waiting({sid: self.engine.meta(sid) for sid in due if sid not in produced})
        if results:
            self.chunk_generation_s = results[0].generation_ms / 1000.0
        else:
            # Every due session waits for a prompt's embeddings from the encoder worker (a DC
            # worker, `step_ready`): give the answer a moment instead of spinning on Redis.
            self.stopping.wait(0.002)
        finished = self.clock()
        for result in results:
            owned = self.sessions.get(result.session_id)
            if owned is None:
                continue
            if result.chunk_index + 1 < owned.deliver_from:
                owned.next_due = finished  # silent catch-up after a restart: no pacing
            else:
                owned.next_due = max(owned.next_due + owned.chunk_s, finished - owned.chunk_s)
            if result.chunk_index >= owned.deliver_from:
                self.publisher.submit(result, owned.epoch)
            if result.chunk_index - owned.last_checkpoint >= self.checkpoint_every:
                self._checkpoint(result.session_id)
        return True

    def _job_step(self, now: float, free_s: float) -> bool:
        """One job step, abandoned at a block boundary if a stream claims the device meanwhile."""
        if not self.jobs.jobs:
            self.jobs.abandoned = None  # what a claim cost was answered by now
            return False
        self.claims.arm(self.commands.last_id)
        try:
            return self.jobs.run_step(
                now=now, free_s=free_s, probe_s=self.chunk_generation_s, abandon=self.claims.claimed
            )
        finally:
            self.claims.disarm()

    def _earliest_due(self) -> float | None:
        times = [o.next_due for o in self.sessions.values() if self._runnable(o)]
        return (min(times) - self.lookahead_chunks * self.chunk_s) if times else None

    def _runnable(self, owned: OwnedSession) -> bool:
        return owned.active and owned.parked is None and owned.session_id not in self.migrations

    def _next_chunk_start(self) -> float | None:
        """When `_due_sessions` will next return a session (None: no runnable session)."""
        times = [o.next_due for o in self.sessions.values() if self._runnable(o)]
        if not times:
            return None
        return min(times) - (self.lookahead_chunks + 0.25) * self.chunk_s

    def _due_sessions(self, now: float) -> list[str]:
        slack = 0.25 * self.chunk_s
        horizon = now + self.lookahead_chunks * self.chunk_s + slack
        due = [o for o in self.sessions.values() if self._runnable(o) and o.next_due <= horizon]
        due.sort(key=lambda o: o.next_due)
        return [o.session_id for o in due[: self.capacity]]

    # --- commands ------------------------------------------------------------------------------

    def _apply_commands(self, block_ms: int | None) -> bool:
        received = self.commands.read(block_ms=block_ms)
        for item in received:
            self._apply(item)
        return bool(received)

    def _apply(self, item: ReceivedCommand) -> None:
        command = item.command
        command_id = command.get("id", item.entry_id)
        if command_id in self.answered:
            self.commands.ack(item.entry_id)
            return
        handler = getattr(self, f"_cmd_{command.get('kind')}", None)
        try:
            if handler is None:
                raise CommandRefused(f"unknown command kind {command.get('kind')!r}")
            result = handler(command) or {}
        except (CommandRefused, JobRefused) as exc:
            self._answer(command, "refused", str(exc))
        except Exception as exc:
            logger.exception("command failed worker=%s command=%s", self.name, command)
            self._answer(command, "failed", f"{type(exc).__name__}: {exc}")
        else:
            if result is not _DEFERRED:
                if self.jobs.abandoned is not None and claims_the_device(command):
                    # This stream's claim stopped a job step part-way: say what it cost.
                    result = result | {"job_step_abandoned": self.jobs.abandoned.as_result()}
                    self.jobs.abandoned = None
                self._answer(command, "acked", result=result)
        self.commands.ack(item.entry_id)

    def _answer(self, command: dict, status: str, reason: str = "", result: dict | None = None) -> None:
        self.answered[command.get("id", "")] = status
        self.reporter.answer(command, status, reason, result)

    def _owned(self, command: dict, *, epoch_check: bool = True) -> OwnedSession:
        sid = command.get("session")
        owned = self.sessions.get(sid)
        if owned is None:
            raise CommandRefused(f"session {sid} is not on worker {self.name}")
        if epoch_check and command.get("epoch", owned.epoch) < owned.epoch:
            raise CommandRefused(f"stale epoch {command.get('epoch')} < {owned.epoch} for session {sid}")
        return owned

    def _new_owned(self, command: dict) -> OwnedSession:
        return OwnedSession(
            session_id=command["session"],
            epoch=int(command.get("epoch", 0)),
            chunk_s=self.chunk_s,
            next_due=self.clock(),
            deliver_from=int(command.get("deliver_from", 0)),
            prompts=[(int(f), str(t)) for f, t in command.get("prompts", [])],
        )

    def _cmd_start(self, command: dict) -> dict:
        """Start a session fresh, or restart it from its checkpoint (deliver_from skips what was sent)."""
        sid = command["session"]
        if self.draining:
            raise CommandRefused(f"worker {self.name} is draining")
        self._stage_for_sessions(command)
        existing = self.sessions.get(sid)
        if existing is not None:
            if existing.epoch <= int(command.get("epoch", 0)):
                existing.epoch = int(command.get("epoch", 0))
                existing.active = True
                return {"already": True}
            raise CommandRefused("stale start")
        prompts = sorted((int(f), str(t)) for f, t in command.get("prompts", []))
        if not prompts:
            raise CommandRefused("start needs the prompt history")
        restored_from = None
        checkpoint = command.get("checkpoint")
        if checkpoint:
            data = Path(checkpoint).read_bytes()
            self.engine.state_from_bytes(sid, data)
            restored_from = self.engine.next_chunk(sid)
        else:
            _first_from, first_text = prompts[0]
            self.engine.add_session(sid, first_text, int(command["seed"]), start_chunk=0)
        owned = self._new_owned(command)
        owned.prompts = prompts
        self.sessions[sid] = owned
        self._apply_prompts(owned)
        return {"restored_from_chunk": restored_from, "next_chunk": self.engine.next_chunk(sid)}

    def _apply_prompts(self, owned: OwnedSession) -> None:
        """Install every prompt whose chunk is still ahead (the engine keeps the history in state)."""
        next_chunk = self.engine.next_chunk(owned.session_id)
        current = [p for p in owned.prompts if p[0] <= next_chunk]
        ahead = [p for p in owned.prompts if p[0] > next_chunk]
        for from_chunk, text in ([current[-1]] if current else []) + ahead:
            self.engine.set_prompt(owned.session_id, text, max(from_chunk, next_chunk))

    def _cmd_prompt(self, command: dict) -> dict:
        owned = self._owned(command, epoch_check=False)
        self._stage_for_sessions(command)
        from_chunk = max(int(command["from_chunk"]), self._next_chunk(owned))
        owned.prompts.append((from_chunk, command["text"]))
        if owned.parked is None:
            self.engine.set_prompt(owned.session_id, command["text"], from_chunk)
        return {"from_chunk": from_chunk}

    def _next_chunk(self, owned: OwnedSession) -> int:
        try:
            return self.engine.next_chunk(owned.session_id)
        except SessionNotFound:
            return 0

    def _cmd_suspend(self, command: dict) -> dict:
        owned = self._owned(command)
        if owned.parked is not None:
            return {"already": True}
        record = self.engine.suspend(owned.session_id)
        owned.parked = record
        owned.epoch = max(owned.epoch, int(command.get("epoch", owned.epoch)))
        return {"bytes": record.nbytes, "copy_ms": round(record.copy_ms, 3), "pinned": record.pinned}

    def _cmd_resume(self, command: dict) -> dict:
        owned = self._owned(command)
        if owned.parked is None:
            owned.active = True
            return {"already": True}
        report = self.engine.resume(owned.session_id, owned.parked)
        owned.parked = None
        owned.active = True
        owned.epoch = int(command.get("epoch", owned.epoch))
        owned.next_due = self.clock()
        self._apply_prompts(owned)
        return {"bytes": report.nbytes, "copy_ms": round(report.copy_ms, 3)}

    def _cmd_stop(self, command: dict) -> dict:
        return {} if self._forget(command["session"]) else {"already": True}

    def _forget(self, sid: str) -> bool:
        owned = self.sessions.pop(sid, None)
        if owned is None:
            return False
        with contextlib.suppress(SessionNotFound):
            self.engine.remove(sid)
        self.pending_activation.pop(sid, None)
        return True

    def _collect_superseded(self) -> bool:
        """Sessions whose publish lease a newer owner took (we were frozen or cut off past the
        heartbeat timeout and declared lost): stop generating them here. A session we hold at an
        epoch at least as new as that lease (a later command gave it back) stays."""
        did = False
        while True:
            try:
                sid, lease = self.publisher.superseded.get_nowait()
            except queue.Empty:
                return did
            owned = self.sessions.get(sid)
            if owned is None or owned.epoch >= lease or sid in self.migrations:
                continue
            logger.warning(
                "session.superseded worker=%s session=%s epoch=%d lease=%d: stopped here",
                self.name,
                sid,
                owned.epoch,
                lease,
            )
            did = self._forget(sid) or did

    # --- one-shot jobs (docs/jobs.md; ``workers.job_runner``) --------------------------------------

    def _cmd_job_run(self, command: dict) -> dict:
        if self.draining:
            raise CommandRefused(f"worker {self.name} is draining")
        if not self.stage.runs_jobs:
            raise CommandRefused(
                f"one-shot jobs run on diffusion workers (EDC, ED, DC, D); {self.name} is {self.stage.role}"
            )
        if self.stage.needs_encoder and command.get("job") not in self.jobs.jobs:
            # A DC or D worker gets the job's prompt embeddings from the encoder worker the command names.
            self._use_encoder(command)
        if self.stage.needs_decoder and (command.get("job") not in self.jobs.jobs or "decoder" in command):
            # A D or ED worker decodes the finished job's latents on the decoder worker named here.
            self._use_decoder(command)
        try:
            return self.jobs.run(command)
        except StageUnavailable as exc:
            raise CommandRefused(str(exc)) from exc

    def _cmd_job_pause(self, command: dict) -> dict:
        if command.get("job") in self.migrations:
            raise CommandRefused(f"job {command.get('job')} is migrating")
        return self.jobs.pause(command)

    def _cmd_job_resume(self, command: dict) -> dict:
        if command.get("job") in self.migrations:
            raise CommandRefused(f"job {command.get('job')} is migrating")
        return self.jobs.resume(command)

    def _cmd_job_cancel(self, command: dict) -> dict:
        if command.get("job") in self.migrations:
            raise CommandRefused(f"job {command.get('job')} is migrating")
        return self.jobs.cancel(command)

    def _cmd_drain(self, command: dict) -> dict:
        self.draining = True
        return {"resident": len(self.sessions)}

    def _cmd_shutdown(self, command: dict) -> dict:
        if any(o for o in self.sessions.values()):
            raise CommandRefused(f"{len(self.sessions)} session(s) still on {self.name}")
        if self.jobs.jobs:
            raise CommandRefused(f"{len(self.jobs.jobs)} job(s) still on {self.name}")
        self.stopping.set()
        return {}

    # --- stage roles (issue 15; docs/runtime.md "Stage-level serving") ---------------------------

    def _stage_for_sessions(self, command: dict) -> None:
        """A start or prompt needs diffuse and decode here, and on a worker without the encode stage
        the encoder worker to take the prompt's embeddings from (``command["encoder"]``)."""
        if not self.stage.holds_sessions:
            raise CommandRefused(self.stage.sessions_refused)
        if not self.stage.needs_encoder:
            return
        self._use_encoder(command)

    def _use_encoder(self, command: dict) -> None:
        try:
            self.stage.use_encoder(command.get("encoder"))
        except (ValueError, StageUnavailable) as exc:
            raise CommandRefused(str(exc)) from exc

    def _use_decoder(self, command: dict) -> None:
        try:
            self.stage.use_decoder(command.get("decoder"))
        except (ValueError, StageUnavailable) as exc:
            raise CommandRefused(str(exc)) from exc

    def _cmd_set_encoder(self, command: dict) -> dict:
        """``{"kind": "set_encoder", "encoder": {worker, address}}``: take prompt embeddings from this
        encoder worker from now on (the one in use was lost, or the control plane moves the load).
        Sessions waiting for an encoding ask the new encoder at once."""
        if not self.stage.needs_encoder:
            why = "encodes its own prompts" if "E" in self.stage.role else "runs no prompts"
            raise CommandRefused(f"role {self.stage.role} {why}")
        self._use_encoder(command)
        for owned in self.sessions.values():
            if owned.parked is None:
                self._apply_prompts(owned)
        waiting = sorted(self.stage.waiting)
        return {"encoder": str(command["encoder"].get("worker", "")), "waiting": waiting}

    def _cmd_set_role(self, command: dict) -> dict:
        """Change the stages this worker hosts at a chunk boundary: load the missing stages'
        weights, drop the others. Refused while a migration is in flight, while jobs are here and
        the role is not EDC, or when a session needs a stage the role drops (``StageHost``)."""
        if self.migrations or self.receiving:
            raise CommandRefused(f"{len(self.migrations) + len(self.receiving)} migration(s) in flight")
        if self.jobs.jobs and command.get("role") not in ("EDC", "DC"):
            raise CommandRefused(
                f"{len(self.jobs.jobs)} job(s) on {self.name} need diffuse and decode, which role "
                f"{command.get('role')} drops"
            )
        if command.get("encoder") is not None:
            try:
                self.stage.use_encoder(command["encoder"])
            except (ValueError, StageUnavailable) as exc:
                raise CommandRefused(str(exc)) from exc
        metas = {sid: self._session_meta(owned) for sid, owned in self.sessions.items()}
        try:
            result = self.stage.set_role(str(command.get("role", "")), metas)
        except RoleRefused as exc:
            raise CommandRefused(str(exc)) from exc
        # A new encoder (or none) serves prompt switches from now on: ask for what is due.
        for owned in self.sessions.values():
            if owned.parked is None:
                self._apply_prompts(owned)
        logger.info("worker.role worker=%s %s", self.name, result)
        return {"ok": True, **result}

    def _session_meta(self, owned: OwnedSession) -> dict[str, Any]:
        if owned.parked is not None:
            return owned.parked.manifest["meta"]
        return self.engine.meta(owned.session_id)

    # --- migration (TurboServe §6.1) ---------------------------------------------------------

    def _cmd_migrate_out(self, command: dict) -> Any:
        """Step (i): freeze at this chunk boundary and send the state region on a side thread.

        With ``"job"`` in place of ``"session"`` (docs/jobs.md) the job's region leaves the same way,
        from its parked host record or frozen at this step boundary."""
        if "job" in command:
            owned_job = self.jobs.owned(command)
            if owned_job.job_id in self.migrations:
                raise CommandRefused(f"job {owned_job.job_id} is already migrating")
            manifest, tensors = self.jobs.region_for_migration(owned_job)
            return self._send_region(owned_job.job_id, command, manifest, tensors)
        owned = self._owned(command)
        sid = owned.session_id
        if sid in self.migrations:
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
                    timeout_s=self.migration_timeout_s,
                    session_id=sid,
                    epoch=new_epoch,
                )
                future.set_result(report)
            except BaseException as exc:  # reported from the hot loop
                future.set_exception(exc)

        self.migrations[sid] = future
        future.command = command  # type: ignore[attr-defined]
        threading.Thread(target=transfer, name=f"migrate-{sid[:8]}", daemon=True).start()
        return _DEFERRED

    def _collect_migrations(self) -> bool:
        did = False
        for sid, future in list(self.migrations.items()):
            # The answer flips ownership and the publish lease, and the target resumes after the
            # delivered mark: every chunk generated here before the freeze must be sent first.
            if not future.done() or self.publisher.queued(sid):
                continue
            did = True
            del self.migrations[sid]
            command = future.command  # type: ignore[attr-defined]
            owned = self.sessions.get(sid) or self.jobs.jobs.get(sid)
            error = future.exception()
            # A job's migration is settled by the command's answer alone (docs/jobs.md); the
            # migration_* reports are the sessions' §6.1 ownership flip.
            is_job = "job" in command
            if error is None:
                report = future.result()
                # Step (iii) happens in the control plane (ownership flips with the epoch); the
                # source forgets the session only now that the target has verified it.
                self.sessions.pop(sid, None)
                self.jobs.jobs.pop(sid, None)
                with contextlib.suppress(SessionNotFound):
                    self.engine.remove(sid)
                summary = {
                    "bytes": getattr(report, "nbytes", None),
                    "seconds": getattr(report, "seconds", None),
                }
                self._answer(command, "acked", result=summary)
                if not is_job:
                    self.reporter.migration_sent(command, summary)
            else:
                if owned is not None and owned.parked is None:
                    self.engine.thaw(sid)
                self._answer(command, "failed", f"{type(error).__name__}: {error}")
                if not is_job:
                    self.reporter.migration_failed(command, f"{type(error).__name__}: {error}")
        return did

    def _cmd_migrate_in(self, command: dict) -> Any:
        """Step (ii): receive and verify the region on a side thread; the hot loop installs it.

        The listener's ``install`` only validates the manifest against our model (a mismatch
        rejects the migration on both sides); the tensors are adopted into the engine at the next
        chunk boundary, and the session stays frozen until the control plane's ``activate``.
        """
        if self.listener is None:
            raise CommandRefused(f"worker {self.name} has no migration listener")
        if "job" in command:
            return self._job_migrate_in(command)
        if not self.stage.holds_sessions:
            raise CommandRefused(self.stage.sessions_refused)
        sid = command["session"]
        if sid in self.sessions or sid in self.receiving:
            raise CommandRefused(f"session {sid} is already on {self.name}")
        owned = self._new_owned(command)
        owned.active = False
        park = bool(command.get("park"))
        received: dict[str, Any] = {}

        def install(manifest: dict, tensors: dict) -> None:
            self.engine.model.validate_manifest(manifest)
            received["manifest"], received["tensors"] = manifest, tensors

        # Keyed by (session, epoch): concurrent migrations into this worker each take their own
        # source's hello, and a stale source of an older epoch is never taken for this one.
        future = self.listener.receive_in_background(
            self.migration_timeout_s, install, session_id=sid, epoch=owned.epoch
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
        if not self.stage.runs_jobs:
            raise CommandRefused(f"role {self.stage.role} runs no jobs")
        if self.stage.needs_decoder and "decoder" in command:
            self._use_decoder(command)
        received: dict[str, Any] = {}

        def install(manifest: dict, tensors: dict) -> None:
            meta = manifest.get("meta", {})
            if not isinstance(meta, dict) or not meta.get("job"):
                raise ValueError(f"the region sent for job {job_id} is not a job's")
            self.engine.model.validate_manifest(manifest)
            received["manifest"], received["tensors"] = manifest, tensors

        future = self.listener.receive_in_background(
            self.migration_timeout_s, install, session_id=job_id, epoch=epoch
        )
        self.receiving.add(job_id)
        future.add_done_callback(lambda fut: self.job_arrivals.put((job_id, epoch, received, fut)))
        return {"listening": self.listener.address}

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

    def _collect_arrivals(self) -> bool:
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
                self.pending_activation.pop(sid, None)
                continue
            manifest, tensors = received["manifest"], received["tensors"]
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
            self.sessions[sid] = owned
            early = self.pending_activation.pop(sid, None)
            if early is not None:
                self._activate(owned, early)

    def _cmd_activate(self, command: dict) -> dict:
        """After the ownership flip: the migrated session generates its next chunk here."""
        sid = command["session"]
        owned = self.sessions.get(sid)
        if owned is None:
            if sid in self.receiving:  # the ack raced ahead of our arrival bookkeeping
                self.pending_activation[sid] = command
                return {"pending": True}
            raise CommandRefused(f"session {sid} has not arrived on {self.name}")
        return self._activate(owned, command)

    def _activate(self, owned: OwnedSession, command: dict) -> dict:
        owned.epoch = int(command["epoch"])
        owned.deliver_from = max(owned.deliver_from, int(command.get("deliver_from", 0)))
        if owned.parked is None:
            owned.active = True
            owned.next_due = self.clock()
            self._apply_prompts(owned)
        return {"next_chunk": self._next_chunk(owned)}

    # --- checkpoints and heartbeat -------------------------------------------------------------

    def _checkpoint(self, sid: str, *, force: bool = False) -> None:
        if self.checkpoint_dir is None:
            return
        owned = self.sessions.get(sid)
        if owned is None or sid in self.migrations:
            return
        try:
            if not self.publisher.fence.holds(sid, owned.epoch):
                return  # a newer owner writes this checkpoint now: a stale state must not replace it
        except REDIS_DOWN:
            return  # unknown while Redis is down: the next chunk's checkpoint tries again
        try:
            if owned.parked is not None:
                data = region_to_bytes(owned.parked.manifest, owned.parked.tensors)
                index = self._next_chunk(owned) - 1
            else:
                data = self.engine.state_to_bytes(sid)
                index = self.engine.next_chunk(sid) - 1
        except Exception:
            logger.exception("checkpoint failed session=%s", sid)
            return
        self.checkpoint_dir.mkdir(parents=True, exist_ok=True)
        target = checkpoint_path(self.checkpoint_dir, sid)
        tmp = target.with_suffix(f".{self.name}.tmp")
        tmp.write_bytes(data)
        os.replace(tmp, target)  # atomic: a reader sees the old or the new checkpoint, never half
        owned.last_checkpoint = index

    def _heartbeat_loop(self) -> None:
        while not self.stopping.wait(self.heartbeat_s):
            try:
                resident = [s for s, o in self.sessions.items() if o.parked is None]
                parked = [s for s, o in self.sessions.items() if o.parked is not None]
                # job_devices: how many devices a video job's step can be split across here
                # (the dispatcher's SP degree for this worker, docs/jobs.md).
                telemetry = {**sample(), "job_devices": len(self.jobs.devices)}
                self.reporter.heartbeat(telemetry, resident, parked, self.stage.report())
            except Exception:
                logger.exception("heartbeat failed worker=%s", self.name)
            # The same beat in Redis: a PostgreSQL outage leaves the rows' heartbeats stale, and
            # the control plane must not take that for this worker's death (``workers_check``).
            if self.liveness_ttl_s is not None:
                with contextlib.suppress(*REDIS_DOWN):  # the PostgreSQL heartbeat still tells it
                    heartbeat_beat(self.redis, self.name, self.liveness_ttl_s)

    def tell(self, worker_name: str, command: dict) -> None:
        send_command(self.redis, worker_name, command)


class CommandRefused(Exception):
    """The worker does not apply this command; the reason goes back to the control plane."""


_DEFERRED = object()  # the command is answered later (migrations)
