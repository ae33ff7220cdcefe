"""The data plane's last hop on a worker: each chunk's encoded frames, published once to its
session's channel-layer group (wire format: ``contracts.wire.frames``) while this worker holds the
session's publish lease (``contracts.wire.channel.PublishFence``). The chunk's audit record goes to
a durable Redis stream first (``contracts.wire.records``, ingested by the control plane), the
delivered index is marked after the send. A thread beside the hot loop: waiting for a chunk's
frames never delays the next chunk.
"""

from __future__ import annotations

import asyncio
import collections
import itertools
import logging
import queue
import threading
import time
from collections.abc import Callable
from typing import Any

import redis

from contracts import tracing
from contracts.wire.channel import PublishFence, Verdict
from contracts.wire.codecs import DEFAULT_CODECS, codecs_wanted_many
from contracts.wire.frames import PAYLOAD_TTL_S, chunk_message_offloaded, group_name
from contracts.wire.records import chunk_record_append
from workers.daemon.outage import REDIS_DOWN, retry_delay
from workers.runtime.engine import ChunkResult

logger = logging.getLogger("workers.daemon")

# After an outage, how long a session's first chunk waits for its viewers' subscriptions to come
# back (the pub/sub channel layer re-subscribes about a second after Redis returns; a session nobody
# watches waits this long once per outage).
RESUBSCRIBE_WAIT_S = 5.0
# How often a session's subscriber count is read while Redis is up: what the first chunk after an
# outage waits for (one PUBSUB NUMSUB round trip per session per period).
SUBSCRIBERS_COUNT_EVERY_S = 1.0


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
        # Chunks to publish, in order, each with when its trace began (None: not traced); a callable
        # runs once every chunk before it is done (``after``).
        self.items: queue.Queue[tuple[ChunkResult, int, int | None] | Callable[[], None] | None] = (
            queue.Queue()
        )
        self.superseded: queue.Queue[tuple[str, int]] = queue.Queue()
        self.leases_lost: dict[str, int] = {}  # session id → the newer epoch that fenced us out
        self.published = 0
        self.outage_at = 0.0  # monotonic time the daemon last found Redis unreachable
        self._subscribers_checked: dict[str, float] = {}  # session id → when its viewers were last seen
        # session id → (subscribers to its group, when counted): the web servers listening before an
        # outage, all of which must be back before its next chunk goes out.
        self._subscribers: dict[str, tuple[int, float]] = {}
        self._codecs: dict[str, frozenset[str]] = {}  # session id → the codecs last read for it
        self._queued: collections.Counter[str] = collections.Counter()  # session id → chunks not done
        self._queued_lock = threading.Lock()

    def codecs_of(self, session_ids: list[str]) -> dict[str, frozenset[str]]:
        """The codecs each session's viewers read now (``contracts.wire.codecs``), one round trip.
        While Redis is unreachable, the last known ones: generation goes on, publishing waits."""
        try:
            wanted = codecs_wanted_many(self.redis, session_ids)
        except REDIS_DOWN:
            self.redis_failed()
            return {sid: self._codecs.get(sid, DEFAULT_CODECS) for sid in session_ids}
        self._codecs.update(wanted)
        return wanted

    def forget(self, session_id: str) -> None:
        """The session left this worker: drop what was kept about it."""
        for kept in (self._codecs, self._subscribers):
            kept.pop(session_id, None)

    def submit(self, result: ChunkResult, epoch: int) -> None:
        with self._queued_lock:
            self._queued[result.session_id] += 1
        # The chunk's trace (sampled at OTEL_CHUNK_SAMPLE_RATE) begins as the engine hands it over.
        traced = time.time_ns() if tracing.ON and tracing.chunk_sampled() else None
        self.items.put((result, epoch, traced))

    def after(self, callback: Callable[[], None]) -> None:
        """Run ``callback`` on this thread once every chunk submitted before it was published (its
        record appended) or dropped: a checkpoint is written only for chunks that are recorded."""
        self.items.put(callback)

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
            if callable(item):
                try:
                    item()
                except Exception:
                    logger.exception("after-publish callback failed worker=%s", self.worker_name)
                continue
            result, epoch, traced = item
            try:
                if traced is None:
                    self._publish_retrying(loop, layer, result, epoch)
                else:
                    self._publish_traced(loop, layer, result, epoch, traced)
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

    def _publish_traced(
        self, loop: asyncio.AbstractEventLoop, layer: Any, result: ChunkResult, epoch: int, started_ns: int
    ) -> None:
        """``_publish_retrying`` inside the chunk's root span; the message carries the trace on."""
        attributes = {
            "session.id": result.session_id,
            "chunk.index": result.chunk_index,
            "chunk.epoch": epoch,
            "chunk.batch_size": result.batch_size,
            "chunk.generation_ms": round(result.generation_ms, 3),
            "worker.name": self.worker_name,
        }
        with tracing.span(tracing.CHUNK, attributes=attributes, start_ns=started_ns):
            self._publish_retrying(loop, layer, result, epoch, traced=True)

    def _publish_retrying(
        self,
        loop: asyncio.AbstractEventLoop,
        layer: Any,
        result: ChunkResult,
        epoch: int,
        traced: bool = False,
    ) -> None:
        """Publish, waiting out a Redis outage: a chunk is never dropped because Redis restarted.

        Every step may run again: ``admit`` and ``mark_delivered`` are idempotent, a record
        appended twice is ingested once (ON CONFLICT), and a chunk sent twice (the send went
        through, its mark did not) is dropped by the session consumer as an index it has passed.
        Chunks queue behind this one meanwhile, in order.
        """
        for attempt in itertools.count():
            try:
                self._publish(loop, layer, result, epoch, traced)
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
                time.sleep(retry_delay(attempt))

    def _publish(
        self,
        loop: asyncio.AbstractEventLoop,
        layer: Any,
        result: ChunkResult,
        epoch: int,
        traced: bool = False,
    ) -> None:
        sid, index = result.session_id, result.chunk_index
        if epoch < self.leases_lost.get(sid, -1):
            return  # already fenced out at this epoch: no round trip for the rest of the queue
        encoding = result.encoding(timeout=30)
        frames = encoding.frames
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
            "frames_per_chunk": result.frame_count,
            "codecs": sorted(({"jpeg"} if frames else set()) | ({"h264"} if encoding.fragment else set())),
            "encode_ms": round(encoding.encode_ms, 3),
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
        channel = loop.run_until_complete(_group_channel(layer, sid))
        if self._subscribers_checked.get(sid, 0.0) < self.outage_at:
            self._await_subscribers(channel, sid)
        elif (
            channel is not None
            and time.monotonic() - self._subscribers.get(sid, (0, 0.0))[1] >= SUBSCRIBERS_COUNT_EVERY_S
        ):
            self._subscribers[sid] = (self.redis.pubsub_numsub(channel)[0][1], time.monotonic())
        media = None
        if encoding.fragment is not None:
            fragment = encoding.fragment
            media = {
                "init": fragment.init,
                "fragment": fragment.data,
                "mime": fragment.mime,
                "encoder": fragment.encoder,
            }
        if traced:
            with tracing.span(
                tracing.CHUNK_PUBLISH, kind="producer", attributes={"chunk.codecs": header["codecs"]}
            ):
                # Payloads of a real frame size go beside the message (contracts.wire.frames), before it.
                message = chunk_message_offloaded(header, frames, media=media, store=self._store_payloads)
                message["traceparent"] = tracing.traceparent()
                loop.run_until_complete(layer.group_send(group_name(sid), message))
        else:
            message = chunk_message_offloaded(header, frames, media=media, store=self._store_payloads)
            loop.run_until_complete(layer.group_send(group_name(sid), message))
        # Marked only now that the channel layer has it: a takeover resumes after the last chunk
        # actually sent, never after one announced and then lost with a frozen or dead worker.
        self.fence.mark_delivered(sid, epoch, index)
        self.published += 1

    def _store_payloads(self, payloads: dict[str, bytes]) -> None:
        pipe = self.redis.pipeline(transaction=False)
        for key, blob in payloads.items():
            pipe.set(key, blob, ex=PAYLOAD_TTL_S)
        pipe.execute()

    def _await_subscribers(self, channel: str | None, sid: str) -> None:
        """After a Redis outage, hold the session's next chunk until its viewers have subscribed
        again (at most ``RESUBSCRIBE_WAIT_S``).

        The pub/sub channel layer delivers a message to whoever is subscribed at that instant and
        keeps nothing: chunks published while the web servers' subscriptions were still being
        re-established after Redis came back would reach no client, a hole in every stream. (The
        list-based core layer keeps group membership and messages in Redis: nothing to wait for.)
        """
        if channel is not None:
            # As many subscribers as before the outage (at least one): with several web servers, or a
            # monitor on the group, the first one back is not everyone (the chaos suite's Redis
            # restart lost chunks 5–7 of its client that way while its probe had resubscribed).
            expected = max(1, self._subscribers.get(sid, (1, 0.0))[0])
            deadline = time.monotonic() + RESUBSCRIBE_WAIT_S
            while self.redis.pubsub_numsub(channel)[0][1] < expected and time.monotonic() < deadline:
                time.sleep(0.1)
        self._subscribers_checked[sid] = time.monotonic()


async def _group_channel(layer: Any, sid: str) -> str | None:
    """The Redis pub/sub channel of a session's group on the pub/sub layer (None on another layer).
    In a coroutine: the pub/sub layer resolves attributes on its per-event-loop instance."""
    channel_of = getattr(layer, "_get_group_channel_name", None)  # channels_redis pub/sub naming
    return channel_of(group_name(sid)) if channel_of is not None else None
