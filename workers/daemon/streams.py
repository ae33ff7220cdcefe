"""The worker's streams: the sessions it owns, their pacing, their chunks and their checkpoints.

Pacing: a session's next chunk is due one chunk-duration after its previous one (real time), with
one chunk of look-ahead so the browser's jitter buffer never runs dry; sessions due within a
quarter chunk of each other are coalesced into one batched step (at most K). Each chunk goes to the
publisher (``workers.daemon.publisher``) unless it is a silent catch-up after a restart, and every
``checkpoint_every`` chunks the session's state is written where the control plane restarts it
from (``contracts.wire.checkpoints``).

A session leaving on a migration (``workers.daemon.migration``) is neither stepped nor checkpointed
until its transfer is settled.
"""

from __future__ import annotations

import contextlib
import logging
import os
import queue
from collections.abc import Callable, Container
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from contracts.coserve import StreamDemand
from contracts.wire.checkpoints import checkpoint_path
from workers.daemon.answers import CommandRefused
from workers.daemon.outage import REDIS_DOWN
from workers.daemon.publisher import ChunkPublisher
from workers.runtime.engine import ChunkEngine, ChunkResult, HostStateRecord, SessionNotFound, region_to_bytes

logger = logging.getLogger("workers.daemon")


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


class Streams:
    """The sessions this worker owns and the chunk side of its hot loop. ``leaving``: the sessions
    (and jobs) whose state is on its way to another worker."""

    def __init__(
        self,
        *,
        name: str,
        engine: ChunkEngine,
        publisher: ChunkPublisher,
        capacity: int,
        clock: Callable[[], float],
        leaving: Container[str],
        lookahead_chunks: float = 1.0,
        job_reserve_chunks: float = 0.5,
        checkpoint_dir: str | os.PathLike | None = None,
        checkpoint_every: int = 8,
    ) -> None:
        self.name = name
        self.engine = engine
        self.publisher = publisher
        self.capacity = capacity
        self.clock = clock
        self.leaving = leaving
        self.lookahead_chunks = lookahead_chunks
        # The part of the look-ahead job steps never take: a chunk is at its viewers at least this
        # long before it plays (`demands`); the whole look-ahead would keep every chunk as early as
        # without jobs, but then a step must fit the gap between two batches of chunks.
        self.job_reserve_chunks = min(job_reserve_chunks, lookahead_chunks)
        self.checkpoint_dir = Path(checkpoint_dir) if checkpoint_dir else None
        self.checkpoint_every = checkpoint_every
        self.sessions: dict[str, OwnedSession] = {}
        # ``activate`` commands that raced ahead of their session's arrival (``workers.daemon.migration``).
        self.pending_activation: dict[str, dict[str, Any]] = {}
        model = engine.model
        self.chunk_s = float(model.frames_per_chunk) / float(model.fps)
        # How long the last chunk took to generate: the prior for a job step never measured yet
        # (``workers.runtime.jobs``); one chunk period until a chunk has run.
        self.chunk_generation_s = self.chunk_s
        # Seconds a coalesced batch took, by its size (the last one measured): what the streams'
        # next chunks are expected to need (`demands`).
        self.batch_generation_s: dict[int, float] = {}

    # --- pacing ----------------------------------------------------------------------------------

    def runnable(self, owned: OwnedSession) -> bool:
        return owned.active and owned.parked is None and owned.session_id not in self.leaving

    def earliest_due(self) -> float | None:
        """When the hot loop must be back for a chunk (None: no runnable session)."""
        times = [o.next_due for o in self.sessions.values() if self.runnable(o)]
        return (min(times) - self.lookahead_chunks * self.chunk_s) if times else None

    def demands(self, reserve_chunks: float | None = None) -> list[StreamDemand]:
        """What the streams' next chunks need of the device (``contracts.coserve``): one demand per
        batch ``due`` will coalesce (sessions within a quarter chunk of the batch's first, at most
        K), to be finished ``reserve_chunks`` (default ``job_reserve_chunks``) before its first
        session's chunk is due to play (``next_due``), expected to take what a batch of its size
        took last."""
        reserve = self.job_reserve_chunks if reserve_chunks is None else reserve_chunks
        pending = sorted(o.next_due for o in self.sessions.values() if self.runnable(o))
        demands = []
        while pending:
            first = pending[0]
            size = sum(1 for t in pending[: self.capacity] if t <= first + 0.25 * self.chunk_s)
            generation_s = self.batch_s(size)
            finish_by = first - reserve * self.chunk_s
            demands.append(StreamDemand(finish_by=finish_by, generation_s=generation_s))
            del pending[:size]
        return demands

    def batch_s(self, size: int) -> float:
        """Expected seconds of a batch of ``size`` chunks: measured, else scaled from the nearest
        measured size (never below it), else the last chunk's time (a chunk period before any)."""
        if size in self.batch_generation_s:
            return self.batch_generation_s[size]
        if not self.batch_generation_s:
            return self.chunk_generation_s
        nearest = min(self.batch_generation_s, key=lambda b: abs(b - size))
        return self.batch_generation_s[nearest] * max(1.0, size / nearest)

    def due(self, now: float) -> list[str]:
        """The sessions to step now, earliest first, at most K."""
        slack = 0.25 * self.chunk_s
        horizon = now + self.lookahead_chunks * self.chunk_s + slack
        due = [o for o in self.sessions.values() if self.runnable(o) and o.next_due <= horizon]
        due.sort(key=lambda o: o.next_due)
        return [o.session_id for o in due[: self.capacity]]

    # --- chunks ----------------------------------------------------------------------------------

    def generate(self, due: list[str]) -> list[ChunkResult]:
        """One coalesced batch of the due sessions (fewer when some wait for a prompt's embeddings)."""
        codecs = self.publisher.codecs_of(due)  # what each session's viewers read (docs/media.md)
        results = self.engine.step(max_batch=self.capacity, due=due, codecs=codecs)
        if results:
            self.chunk_generation_s = results[0].generation_ms / 1000.0
            self.batch_generation_s[len(results)] = self.chunk_generation_s
        return results

    def deliver(self, results: list[ChunkResult]) -> None:
        """Pace each session's next chunk, publish the chunks, checkpoint those due."""
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
                self.checkpoint(result.session_id)

    # --- the session commands --------------------------------------------------------------------

    def owned(self, command: dict, *, epoch_check: bool = True) -> OwnedSession:
        """The session a command names, refusing an unknown one or an epoch older than ours."""
        sid = command.get("session")
        owned = self.sessions.get(sid)  # type: ignore[arg-type]
        if owned is None:
            raise CommandRefused(f"session {sid} is not on worker {self.name}")
        if epoch_check and command.get("epoch", owned.epoch) < owned.epoch:
            raise CommandRefused(f"stale epoch {command.get('epoch')} < {owned.epoch} for session {sid}")
        return owned

    def new_owned(self, command: dict) -> OwnedSession:
        return OwnedSession(
            session_id=command["session"],
            epoch=int(command.get("epoch", 0)),
            chunk_s=self.chunk_s,
            next_due=self.clock(),
            deliver_from=int(command.get("deliver_from", 0)),
            prompts=[(int(f), str(t)) for f, t in command.get("prompts", [])],
        )

    def start(self, command: dict) -> dict:
        """Start a session fresh, or restart it from its checkpoint (deliver_from skips what was sent)."""
        sid = command["session"]
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
        checkpoint, unreadable = command.get("checkpoint"), None
        data = None
        if checkpoint:
            try:
                data = Path(checkpoint).read_bytes()
            except OSError as exc:
                # The control plane found the file in its CHECKPOINT_DIR, this host does not: a
                # directory not shared by every host (docs/production.md, "Several hosts"). Failing
                # the start would requeue the session onto the same path at every placement; the
                # stream is deterministic, so it is regenerated from chunk 0 instead, silently up to
                # deliver_from (unpaced, but as long as the session has run).
                unreadable = f"{checkpoint}: {exc.strerror or exc}"
                logger.warning(
                    "checkpoint.unreadable session=%s worker=%s %s; regenerating from chunk 0",
                    sid,
                    self.name,
                    unreadable,
                )
        if data is not None:
            self.engine.state_from_bytes(sid, data)
            restored_from = self.engine.next_chunk(sid)
        else:
            _first_from, first_text = prompts[0]
            self.engine.add_session(sid, first_text, int(command["seed"]), start_chunk=0)
        owned = self.new_owned(command)
        owned.prompts = prompts
        self.sessions[sid] = owned
        self.apply_prompts(owned)
        answer = {"restored_from_chunk": restored_from, "next_chunk": self.engine.next_chunk(sid)}
        if unreadable:
            answer["checkpoint_unreadable"] = unreadable
        return answer

    def apply_prompts(self, owned: OwnedSession) -> None:
        """Install every prompt whose chunk is still ahead (the engine keeps the history in state)."""
        next_chunk = self.engine.next_chunk(owned.session_id)
        current = [p for p in owned.prompts if p[0] <= next_chunk]
        ahead = [p for p in owned.prompts if p[0] > next_chunk]
        for from_chunk, text in ([current[-1]] if current else []) + ahead:
            self.engine.set_prompt(owned.session_id, text, max(from_chunk, next_chunk))

    def apply_prompts_resident(self) -> None:
        """Ask again for what every resident session's prompts need (a new encoder serves them)."""
        for owned in self.sessions.values():
            if owned.parked is None:
                self.apply_prompts(owned)

    def prompt(self, owned: OwnedSession, command: dict) -> dict:
        from_chunk = max(int(command["from_chunk"]), self.next_chunk(owned))
        owned.prompts.append((from_chunk, command["text"]))
        if owned.parked is None:
            self.engine.set_prompt(owned.session_id, command["text"], from_chunk)
        return {"from_chunk": from_chunk}

    def next_chunk(self, owned: OwnedSession) -> int:
        try:
            return self.engine.next_chunk(owned.session_id)
        except SessionNotFound:
            return 0

    def suspend(self, command: dict) -> dict:
        owned = self.owned(command)
        if owned.parked is not None:
            return {"already": True}
        record = self.engine.suspend(owned.session_id)
        owned.parked = record
        owned.epoch = max(owned.epoch, int(command.get("epoch", owned.epoch)))
        return {"bytes": record.nbytes, "copy_ms": round(record.copy_ms, 3), "pinned": record.pinned}

    def resume(self, command: dict) -> dict:
        owned = self.owned(command)
        if owned.parked is None:
            owned.active = True
            return {"already": True}
        report = self.engine.resume(owned.session_id, owned.parked)
        owned.parked = None
        owned.active = True
        owned.epoch = int(command.get("epoch", owned.epoch))
        owned.next_due = self.clock()
        self.apply_prompts(owned)
        return {"bytes": report.nbytes, "copy_ms": round(report.copy_ms, 3)}

    def stop(self, command: dict) -> dict:
        return {} if self.forget(command["session"]) else {"already": True}

    def forget(self, sid: str) -> bool:
        owned = self.sessions.pop(sid, None)
        if owned is None:
            return False
        with contextlib.suppress(SessionNotFound):
            self.engine.remove(sid)
        self.pending_activation.pop(sid, None)
        self.publisher.forget(sid)
        return True

    def activate(self, owned: OwnedSession, command: dict) -> dict:
        """After a migration's ownership flip: the session generates its next chunk here."""
        owned.epoch = int(command["epoch"])
        owned.deliver_from = max(owned.deliver_from, int(command.get("deliver_from", 0)))
        if owned.parked is None:
            owned.active = True
            owned.next_due = self.clock()
            self.apply_prompts(owned)
        return {"next_chunk": self.next_chunk(owned)}

    def meta(self, owned: OwnedSession) -> dict[str, Any]:
        if owned.parked is not None:
            return owned.parked.manifest["meta"]
        return self.engine.meta(owned.session_id)

    def collect_superseded(self) -> bool:
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
            if owned is None or owned.epoch >= lease or sid in self.leaving:
                continue
            logger.warning(
                "session.superseded worker=%s session=%s epoch=%d lease=%d: stopped here",
                self.name,
                sid,
                owned.epoch,
                lease,
            )
            did = self.forget(sid) or did

    def resident(self) -> list[str]:
        return [s for s, o in self.sessions.items() if o.parked is None]

    def parked(self) -> list[str]:
        return [s for s, o in self.sessions.items() if o.parked is not None]

    # --- checkpoints -----------------------------------------------------------------------------

    def checkpoint(self, sid: str) -> None:
        """Checkpoint ``sid``'s state as of its last generated chunk, written once the publisher has
        recorded every chunk up to it.

        Never ahead of the records (issue 31): the state is taken here, at generation, but chunks
        are recorded on the publisher thread, which may lag (frames encoding, viewers
        resubscribing after an outage, Redis down). A checkpoint written at once and a worker killed
        before its publisher caught up would restart the session past chunks that were generated
        and never recorded — an index jump the audit sees as a hole while ``chunks_generated``
        counts it. Written after them instead, a checkpoint's chunks are all on the record stream.
        """
        if self.checkpoint_dir is None:
            return
        owned = self.sessions.get(sid)
        if owned is None or sid in self.leaving:
            return
        try:
            if not self.publisher.fence.holds(sid, owned.epoch):
                return  # a newer owner writes this checkpoint now: a stale state must not replace it
        except REDIS_DOWN:
            return  # unknown while Redis is down: the next chunk's checkpoint tries again
        try:
            if owned.parked is not None:
                data = region_to_bytes(owned.parked.manifest, owned.parked.tensors)
                index = self.next_chunk(owned) - 1
            else:
                data = self.engine.state_to_bytes(sid)
                index = self.engine.next_chunk(sid) - 1
        except Exception:
            logger.exception("checkpoint failed session=%s", sid)
            return
        owned.last_checkpoint = index
        epoch = owned.epoch
        self.publisher.after(lambda: self.checkpoint_write(sid, epoch, index, data))

    def checkpoint_write(self, sid: str, epoch: int, index: int, data: bytes) -> None:
        """On the publisher thread, after the chunks up to ``index``: the lease checked again (it
        may have passed to a newer owner meanwhile), then an atomic replace."""
        try:
            if not self.publisher.fence.holds(sid, epoch):
                return
        except REDIS_DOWN:
            return  # unknown: the previous checkpoint stays, older and still recorded
        assert self.checkpoint_dir is not None
        self.checkpoint_dir.mkdir(parents=True, exist_ok=True)
        target = checkpoint_path(self.checkpoint_dir, sid)
        tmp = target.with_suffix(f".{self.name}.tmp")
        tmp.write_bytes(data)
        os.replace(tmp, target)  # atomic: a reader sees the old or the new checkpoint, never half
        logger.debug("checkpoint.written session=%s index=%d", sid, index)
