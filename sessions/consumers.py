"""The session WebSocket: chunks and status out, prompt/pause/resume/terminate in; and the job
WebSocket (``JobConsumer``): one user's one-shot jobs, live.

Slow clients never slow a worker: the worker publishes once to the channel layer and returns; this
consumer keeps its own bounded outbox. Policy (live video favours the present over completeness):
at most ``MAX_PENDING_CHUNKS`` chunks wait for a slow socket; when a new chunk arrives to a full
outbox the *oldest* waiting chunk is dropped and the client is told with a ``skipped`` message.
Status and error messages are never dropped.

A viewer picks its codec with ``?codec=h264|jpeg`` (default ``h264``: fragmented MP4, what Media
Source Extensions, PyAV and FFmpeg read; ``jpeg`` for a client that draws frames itself, e.g. a browser
whose MSE cannot play H.264; an unknown codec is an ``error`` frame and the socket stays on the
default). Every viewer announces its codec (``contracts.wire.codecs``),
so the worker encodes the session's chunks in each codec watched: an H.264 viewer gets them as
fragmented MP4, and a JPEG viewer that joins while an H.264 one watches (or lingers: a page that fell
back from H.264 to JPEG reconnects at once) gets JPEG frames from the next chunk on, not only once the
H.264 lease has lapsed. An H.264 viewer receives each chunk's fragment in
the same binary framing, its header saying ``"codec": "h264"``; the first one it receives, and any
whose init segment differs from the last it sent (a migration to a worker with another encoder),
carries the init segment first (``"init": true``, two payloads). Chunks generated before its codec
reached the worker are not sent to it: its stream starts at the first chunk that has a fragment;
likewise a JPEG viewer is sent no chunk that was encoded without JPEG frames.

A chunk's large payload (JPEG frames or fragment over 16 KiB) arrives as a reference to a Redis key
(``contracts.wire.frames``, docs/media.md): the socket reads it only when the chunk leaves its
outbox (``sessions.payloads``), so chunks it drops are never read; one that cannot be read any more
is a ``skipped`` frame.

Each socket shows one stream, in order (``StreamPosition``): a chunk from an epoch older than the
newest it has seen comes from a previous owner that is still running (fenced out by its publish
lease, but a chunk may already have been on its way), and an index it has already passed is a
copy (a new owner regenerates the chunks after the last one marked delivered). Both are dropped,
so a client never sees an index twice, nor two owners' streams interleaved.

A viewer may take its video over WebRTC instead (``?transport=webrtc``, H.264 only): the socket
then carries the signalling (the browser's ``webrtc.offer`` and ``webrtc.ice``, our
``webrtc.answer``), status and a ``webrtc.chunk`` text frame as each chunk's first picture leaves on
the peer connection (its header, for the page's figures); the pictures themselves go over the peer
connection (``sessions.webrtc``), admitted by the same ``StreamPosition`` and with the same H.264
codec lease as a socket viewer. Until the peer connection is up no chunk is sent at all. The peer
connection runs in a media process (``WEBRTC_MEDIA=process``, the default: ``sessions.webrtc.relay``
relays the signalling there and its events back; the media process takes the session's chunks from
the channel layer itself) or in this process's event loop (``inline``).

Each socket is a viewer of its session (``contracts.wire.viewers``): registered once accepted,
refreshed every ``VIEWER_REFRESH_S``, gone on disconnect. A session nobody watches goes idle and
ends (``sessions.viewers``); a socket that connects to one made idle that way resumes it.
"""

from __future__ import annotations

import asyncio
import collections
import json
import logging
import time
import uuid
from dataclasses import dataclass
from urllib.parse import parse_qs

import redis
from asgiref.sync import sync_to_async
from channels.db import database_sync_to_async
from channels.generic.websocket import AsyncWebsocketConsumer
from django.conf import settings
from django.core.exceptions import ValidationError

from contracts import tracing
from contracts.wire.codecs import CODEC_REFRESH_S, CODECS, H264, codec_leave, codec_want
from contracts.wire.frames import (
    CHUNK_MESSAGE,
    STATUS_MESSAGE,
    chunk_has_jpeg,
    encode_chunk_frame,
    group_name,
)
from contracts.wire.records import chunk_row
from contracts.wire.viewers import VIEWER_REFRESH_S, viewer_leave, viewer_register
from sessions import jobs, services, viewers
from sessions.models import GenerationSession, Job
from sessions.payloads import payload_read
from sessions.selectors import (
    job_queue_positions,
    job_status_message,
    session_status_message,
    sessions_visible_to,
)
from sessions.webrtc.access_units import process_cache
from sessions.webrtc.peer import SignallingError, WebRtcViewer
from sessions.webrtc.relay import PROCESS, MediaRelay

logger = logging.getLogger(__name__)

MAX_PENDING_CHUNKS = 8
DELIVERY_FLUSH_S = 1.0
SESSION_COMMAND_TYPES = ("prompt", "pause", "resume", "terminate")
WEBRTC_MESSAGE_TYPES = ("webrtc.offer", "webrtc.ice")
CLIENT_MESSAGE_TYPES = SESSION_COMMAND_TYPES + WEBRTC_MESSAGE_TYPES
SOCKET, WEBRTC = "socket", "webrtc"
DEFAULT_CODEC = H264  # ``?codec=`` absent or unknown
TRANSPORTS = (SOCKET, WEBRTC)
# The largest client message: a prompt of MAX_PROMPT_CHARS written as JSON escapes (6 characters
# each) plus its envelope fits in 16 KiB at the default 2,000; longer frames are refused unparsed.
MAX_CLIENT_MESSAGE_CHARS = 16_384


def parse_client_message(text_data: str | None, types: tuple[str, ...]) -> tuple[dict, str | None]:
    """A client message: a flat JSON object whose ``type`` is one of ``types``. Returns the message,
    or the reason it is not one (the consumer answers an ``error`` frame and stays open)."""
    if text_data is None:
        return {}, "send JSON text messages, not binary"
    if len(text_data) > MAX_CLIENT_MESSAGE_CHARS:
        return {}, f"messages are at most {MAX_CLIENT_MESSAGE_CHARS} characters"
    try:
        message = json.loads(text_data)
    except json.JSONDecodeError as exc:
        return {}, f"not valid JSON: {exc.msg}"
    except RecursionError:
        # Deep nesting ("[[[[…") exhausts the parser's stack before any shape check can run.
        return {}, "JSON nested too deeply"
    if not isinstance(message, dict) or message.get("type") not in types:
        return {}, f"'type' must be one of {', '.join(types)}"
    if any(isinstance(value, dict | list) for value in message.values()):
        return {}, "a message is a flat object: no nested objects or lists"
    return message, None


@dataclass
class StreamPosition:
    """The newest owner's epoch and the last index this socket has taken."""

    epoch: int = -1
    index: int = -1

    def admit(self, header: dict) -> bool:
        epoch, index = int(header["epoch"]), int(header["index"])
        if epoch < self.epoch:
            return False
        # A newer epoch counts even for a copy: its previous owner's next chunks are stale too.
        self.epoch = epoch
        if index <= self.index:
            return False
        self.index = index
        return True


class SessionConsumer(AsyncWebsocketConsumer):
    codec = H264
    transport = SOCKET
    webrtc: WebRtcViewer | MediaRelay | None = None
    init_sent: bytes | None = None  # the init segment this H.264 viewer last received
    jpeg_sent = False  # whether this JPEG viewer's stream has begun
    codec_lease: CodecLease | None = None

    async def connect(self) -> None:
        self.session_id = str(self.scope["url_route"]["kwargs"]["session_id"])
        user = self.scope.get("user")
        if user is None or not user.is_authenticated:
            await self._refuse(
                4401, "not_authenticated", "log in or pass an API token (?token= or Authorization)"
            )
            return
        status = await self._visible_status(user)
        if status is None:
            # Unknown and other users' sessions look the same: do not reveal that it exists.
            await self._refuse(4404, "not_found", "no such session")
            return
        self.group = group_name(self.session_id)
        query = parse_qs(self.scope.get("query_string", b"").decode("latin-1"))
        asked_codec = (query.get("codec") or [None])[0]
        self.codec = asked_codec or DEFAULT_CODEC
        codec_problem = None
        if self.codec not in CODECS:
            codec_problem = (
                f"unknown codec {self.codec!r}; choose one of {', '.join(CODECS)} (sending {DEFAULT_CODEC})"
            )
            self.codec = DEFAULT_CODEC
        transport_problem = self._choose_transport(
            (query.get("transport") or [SOCKET])[0], codec_given=asked_codec is not None
        )
        self.outbox: collections.deque[tuple[str, object]] = collections.deque()
        self.pending_chunks = 0
        self.position = StreamPosition()
        self.wakeup = asyncio.Event()
        self.deliveries: list[dict] = []  # headers of sent chunks, with their delivery_ms
        await self.channel_layer.group_add(self.group, self.channel_name)
        await self.accept()
        self.sender = asyncio.create_task(self._drain())
        self.flusher = asyncio.create_task(self._flush_deliveries_periodically())
        self.codec_lease = await CodecLease.begin(self.session_id, self.codec, self.channel_name)
        if status["status"] != GenerationSession.Status.TERMINATED:
            # Registered before it asks to resume: the viewer check counts viewers under the
            # session's lock, so it either sees this one or made the session idle before the resume.
            await self._viewer_call(viewer_register)
            self.watcher = asyncio.create_task(self._viewer_refresh_periodically())
            if await database_sync_to_async(viewers.session_viewer_returned)(session_id=self.session_id):
                status = await self._visible_status(user) or status
        await self._enqueue_text({"type": "status", **status})
        if codec_problem is not None:
            await self._error("bad_codec", codec_problem)
        if transport_problem is not None:
            await self._error("bad_transport", transport_problem)

    def _choose_transport(self, transport: str, *, codec_given: bool) -> str | None:
        """``?transport=``: the socket itself (default) or WebRTC, which carries H.264 only. Returns
        why the choice was refused (the socket then stays on the socket transport)."""
        if transport not in TRANSPORTS:
            return f"unknown transport {transport!r}; choose one of {', '.join(TRANSPORTS)} (using {SOCKET})"
        if transport == WEBRTC:
            if codec_given and self.codec != H264:
                return f"WebRTC carries {H264} only, not {self.codec} (using {SOCKET})"
            self.codec = H264
        self.transport = transport
        return None

    async def _refuse(self, code: int, error: str, detail: str) -> None:
        """Accept only to say why, then close with an application close code (4401/4404)."""
        await self.accept()
        await self.send(text_data=json.dumps({"type": "error", "code": error, "detail": detail}))
        await self.close(code=code)

    async def disconnect(self, code: int) -> None:
        if hasattr(self, "group"):
            await self.channel_layer.group_discard(self.group, self.channel_name)
        for task_name in ("sender", "flusher", "watcher"):
            task = getattr(self, task_name, None)
            if task is not None:
                task.cancel()
        if self.codec_lease is not None:
            await self.codec_lease.end()
        if self.webrtc is not None:
            await self.webrtc.close()
        if hasattr(self, "watcher"):
            await self._viewer_call(viewer_leave)
        if getattr(self, "deliveries", None):
            await self._flush_deliveries()

    async def dispatch(self, message: dict) -> None:
        """Chunks and status updates skip Channels' per-message database housekeeping: their
        handlers never touch the database, and that step would make every chunk of this process
        wait behind ORM calls on the single sync thread."""
        if message["type"] in (CHUNK_MESSAGE, STATUS_MESSAGE):
            handler = self.session_chunk if message["type"] == CHUNK_MESSAGE else self.session_status
            await handler(message)
            return
        await super().dispatch(message)

    # --- inbound ------------------------------------------------------------------------------

    async def receive(self, text_data: str | None = None, bytes_data: bytes | None = None) -> None:
        """One client message: a flat JSON object. Anything else is an ``error`` frame; the socket
        stays open (a client's mistake must not cost it its stream)."""
        message, problem = parse_client_message(text_data, CLIENT_MESSAGE_TYPES)
        if problem is not None:
            await self._error("bad_message", problem)
            return
        kind = message["type"]
        if kind in WEBRTC_MESSAGE_TYPES:
            await self._signal(kind, message)
            return
        if kind == "prompt" and not isinstance(message.get("text"), str):
            await self._error("bad_message", "a prompt message needs a 'text' string")
            return
        try:
            result = await self._apply(kind, message.get("text"))
        except ValidationError as exc:
            detail = "; ".join(f"{k}: {' '.join(v)}" for k, v in exc.message_dict.items())
            await self._error("rejected", detail)
            return
        except services.SessionTerminated as exc:
            await self._error("rejected", str(exc))
            return
        if kind == "prompt":
            await self._enqueue_text({"type": "prompt", "text": result.text, "from_chunk": result.from_chunk})

    async def _signal(self, kind: str, message: dict) -> None:
        """WebRTC signalling: a bad message is an ``error`` frame naming the problem; the socket, and
        a peer connection already up, carry on."""
        if self.transport != WEBRTC:
            await self._error("bad_signal", "open the socket with ?transport=webrtc to signal WebRTC")
            return
        try:
            if kind == "webrtc.offer":
                await self._answer(message.get("sdp"))
            elif self.webrtc is None:
                await self._error("bad_signal", "send a webrtc.offer before its candidates")
            else:
                await self.webrtc.add_candidate(
                    message.get("candidate"), message.get("sdpMid"), message.get("sdpMLineIndex")
                )
        except SignallingError as exc:
            await self._error(exc.code, str(exc))

    async def _answer(self, sdp: object) -> None:
        """A new offer replaces this socket's peer connection (a page retrying)."""
        if self.webrtc is not None:
            previous, self.webrtc = self.webrtc, None
            await previous.close()
        viewer: WebRtcViewer | MediaRelay
        if settings.STREAMSERVE["WEBRTC_MEDIA"] == PROCESS:
            # The peer connection runs in a media process (sessions.webrtc.relay): its events come
            # back with delivery_ms measured there.
            viewer = MediaRelay(
                layer=self.channel_layer,
                session_id=self.session_id,
                ice=settings.STREAMSERVE["WEBRTC_ICE_SERVERS"],
                on_started=self._webrtc_started,
                on_skipped=self._webrtc_skipped,
                on_state=self._webrtc_state,
                on_error=self._webrtc_error,
            )
        else:
            viewer = WebRtcViewer(
                ice=settings.STREAMSERVE["WEBRTC_ICE_SERVERS"],
                cache=process_cache(),
                on_started=self._webrtc_started,
                on_skipped=self._webrtc_skipped,
                on_state=self._webrtc_state,
            )
        try:
            answer = await viewer.answer(sdp)
        except SignallingError:
            await viewer.close()
            raise
        self.webrtc = viewer
        await self._enqueue_text({"type": "webrtc.answer", "sdp": answer})

    def _webrtc_started(self, header: dict) -> None:
        """A chunk's first picture left on the peer connection: its delivery, and the page's figures."""
        header = dict(header)
        generated_at = header.get("generated_at")
        if generated_at is not None:
            if "delivery_ms" not in header:  # a media process measured it where the picture left
                header["delivery_ms"] = max(0.0, (time.time() - generated_at) * 1000.0)
            self.deliveries.append(header)
        self.outbox.append(("text", json.dumps({**header, "type": "webrtc.chunk"})))
        self.wakeup.set()

    def _webrtc_skipped(self, index: int) -> None:
        self.outbox.append(("text", json.dumps({"type": "skipped", "index": index})))
        self.wakeup.set()

    def _webrtc_state(self, state: str) -> None:
        self.outbox.append(("text", json.dumps({"type": "webrtc.state", "state": state})))
        self.wakeup.set()

    def _webrtc_error(self, code: str, detail: str) -> None:
        """A signalling error the media process found after answering (a candidate it refused)."""
        self.outbox.append(("text", json.dumps({"type": "error", "code": code, "detail": detail})))
        self.wakeup.set()

    @database_sync_to_async
    def _apply(self, kind: str, text: str | None):
        session = GenerationSession.objects.get(pk=self.session_id)
        if kind == "prompt":
            return services.session_prompt_add(session=session, text=text)
        if kind == "pause":
            return services.session_pause(session=session)
        if kind == "resume":
            return services.session_resume(session=session)
        return services.session_terminate(session=session)

    @database_sync_to_async
    def _visible_status(self, user) -> dict | None:
        try:
            session = sessions_visible_to(user).get(pk=uuid.UUID(self.session_id))
        except (ValueError, Exception) as exc:  # bad UUID or DoesNotExist
            logger.debug("websocket refused session=%s reason=%s", self.session_id, exc)
            return None
        return session_status_message(session)

    # --- outbound (channel layer → outbox → socket) -------------------------------------------

    async def session_chunk(self, event: dict) -> None:
        header = dict(event["header"])
        if not self.position.admit(header):
            logger.info(
                "chunk.dropped session=%s index=%s epoch=%s position=%s",
                self.session_id,
                header.get("index"),
                header.get("epoch"),
                self.position,
            )
            return
        frames, ref, init = event["frames"], event.get("frames_ref"), None
        if self.transport == WEBRTC:
            if self.webrtc is not None and self.webrtc.in_process:
                self.webrtc.take_admitted(self.session_id, header, event.get("media"))
            # else its media process receives the session's chunks itself and fences them alike
            return
        if self.codec == H264:
            media = event.get("media")
            if media is None:
                if self.init_sent is not None:  # its stream had begun: say what it misses
                    await self._enqueue_text({"type": "skipped", "index": header["index"]})
                return
            header.update(codec=H264, mime=media["mime"])
            ref = media.get("fragment_ref")
            frames = [] if ref is not None else [media["fragment"]]
            init = media["init"]
        elif not chunk_has_jpeg(event) and event.get("media") is not None:
            # Encoded before this JPEG viewer's codec reached the worker: H.264 only, nothing to show.
            if self.jpeg_sent:
                await self._enqueue_text({"type": "skipped", "index": header["index"]})
            return
        else:
            self.jpeg_sent = True
        if self.pending_chunks >= MAX_PENDING_CHUNKS:
            self._drop_oldest_chunk()
        # A sampled chunk's trace goes on here (docs/observability.md): its send is the next span.
        traced = (
            self._chunk_received(header, event["traceparent"])
            if tracing.ON and "traceparent" in event
            else None
        )
        self.outbox.append(("chunk", (header, frames, ref, init, traced)))
        self.pending_chunks += 1
        self.wakeup.set()

    def _chunk_received(self, header: dict, traceparent: str) -> str | None:
        """The ``chunk.receive`` span of a traced chunk queued for this socket; returns its context
        for the send."""
        attributes = {
            "session.id": self.session_id,
            "chunk.index": header.get("index"),
            "chunk.codec": self.codec,
            "socket.pending_chunks": self.pending_chunks,
        }
        with tracing.span(tracing.CHUNK_RECEIVE, parent=traceparent, kind="consumer", attributes=attributes):
            return tracing.traceparent()

    async def session_status(self, event: dict) -> None:
        await self._enqueue_text({k: v for k, v in event.items() if k != "type"} | {"type": "status"})

    def _drop_oldest_chunk(self) -> None:
        for i, (kind, payload) in enumerate(self.outbox):
            if kind == "chunk":
                header = payload[0]
                del self.outbox[i]
                self.pending_chunks -= 1
                self.outbox.append(("text", json.dumps({"type": "skipped", "index": header["index"]})))
                return

    async def _enqueue_text(self, message: dict) -> None:
        self.outbox.append(("text", json.dumps(message)))
        self.wakeup.set()

    async def _error(self, code: str, detail: str) -> None:
        await self._enqueue_text({"type": "error", "code": code, "detail": detail})

    async def _drain(self) -> None:
        while True:
            await self.wakeup.wait()
            self.wakeup.clear()
            while self.outbox:
                kind, payload = self.outbox.popleft()
                if kind == "text":
                    await self.send(text_data=payload)
                    continue
                self.pending_chunks -= 1
                header, frames, ref, init, traced = payload
                if ref is not None:
                    # Read only now, when it will be sent (sessions.payloads); gone means skipped.
                    payloads = await payload_read(ref)
                    if payloads is None:
                        await self.send(text_data=json.dumps({"type": "skipped", "index": header["index"]}))
                        continue
                    frames = [*frames, *payloads]
                if init is not None:
                    # Decided as it is sent, not as it is queued: a chunk dropped or skipped on the
                    # way must not take the init segment the viewer has yet to receive with it.
                    header["init"] = init != self.init_sent
                    frames = [init, *frames] if header["init"] else frames
                    self.init_sent = init
                generated_at = header.get("generated_at")
                if generated_at is not None:
                    header["delivery_ms"] = max(0.0, (time.time() - generated_at) * 1000.0)
                    self.deliveries.append(header)
                if traced is None:
                    await self.send(bytes_data=encode_chunk_frame(header, frames))
                else:
                    await self._send_traced(header, frames, traced)

    async def _send_traced(self, header: dict, frames: list[bytes], traceparent: str) -> None:
        frame = encode_chunk_frame(header, frames)
        attributes = {
            "session.id": self.session_id,
            "chunk.index": header.get("index"),
            "chunk.bytes": len(frame),
            "chunk.delivery_ms": header.get("delivery_ms"),
        }
        with tracing.span(tracing.CHUNK_SEND, parent=traceparent, attributes=attributes):
            await self.send(bytes_data=frame)

    # --- the viewer registry (sessions.viewers: a session nobody watches goes idle) ---------------

    async def _viewer_call(self, call) -> None:
        """Register (or refresh) or leave, in Redis off the ORM's sync thread. A registry that is
        down must not cost the viewer its stream: its registration lapses, the worst outcome is the
        session going idle, and coming back resumes it."""
        try:
            await sync_to_async(call, thread_sensitive=False)(
                viewers.viewers_client(), self.session_id, self.channel_name
            )
        except Exception:
            logger.exception("viewer registry %s failed session=%s", call.__name__, self.session_id)

    async def _viewer_refresh_periodically(self) -> None:
        while True:
            await asyncio.sleep(VIEWER_REFRESH_S)
            await self._viewer_call(viewer_register)
            if isinstance(self.webrtc, MediaRelay):
                await self.webrtc.check_alive()

    async def _flush_deliveries_periodically(self) -> None:
        while True:
            await asyncio.sleep(DELIVERY_FLUSH_S)
            if self.deliveries:
                await self._flush_deliveries()

    async def _flush_deliveries(self) -> None:
        batch, self.deliveries = self.deliveries, []
        try:
            rows = [chunk_row(header, delivery_ms=header["delivery_ms"]) for header in batch]
            # Redis, not the ORM: off the sync thread that the ORM calls share.
            await sync_to_async(services.chunk_deliveries_record, thread_sensitive=False)(deliveries=rows)
        except Exception:  # the audit plane must never break a live stream
            logger.exception("recording delivery latencies failed session=%s", self.session_id)


class CodecLease:
    """A viewer's claim on its codec (``contracts.wire.codecs``), renewed every ``CODEC_REFRESH_S``
    while the viewer is connected; ``end()`` lets it linger briefly for a reconnect."""

    def __init__(self, session_id: str, codec: str, viewer: str) -> None:
        self.session_id, self.codec, self.viewer = session_id, codec, viewer
        self.task: asyncio.Task | None = None

    @classmethod
    async def begin(cls, session_id: str, codec: str, viewer: str) -> CodecLease:
        """The lease, written once before this returns (so a viewer that has its first status frame
        is already counted by the worker's next read), then renewed in the background."""
        lease = cls(session_id, codec, viewer)
        await lease._want()
        lease.task = asyncio.create_task(lease._renew())
        return lease

    async def _want(self) -> None:
        try:
            await sync_to_async(codec_want, thread_sensitive=False)(
                _redis(), self.session_id, self.codec, self.viewer
            )
        except redis.RedisError:  # Redis away: the worker keeps the codecs it last read
            logger.warning("codec lease not renewed session=%s codec=%s", self.session_id, self.codec)

    async def _renew(self) -> None:
        while True:
            await asyncio.sleep(CODEC_REFRESH_S)
            await self._want()

    async def end(self) -> None:
        if self.task is not None:
            self.task.cancel()
        try:
            await sync_to_async(codec_leave, thread_sensitive=False)(
                _redis(), self.session_id, self.codec, self.viewer
            )
        except redis.RedisError:
            logger.warning("codec lease not ended session=%s codec=%s", self.session_id, self.codec)


_redis_client: redis.Redis | None = None


def _redis() -> redis.Redis:
    global _redis_client
    if _redis_client is None:
        _redis_client = redis.Redis.from_url(settings.REDIS_URL)
    return _redis_client


JOB_CLIENT_MESSAGE_TYPES = ("cancel",)


class JobConsumer(AsyncWebsocketConsumer):
    """One user's jobs, live: on connect the state of each job in flight, then every change
    (queued with its position, running step i/n, paused, done with the result's URL, failed with
    the reason, cancelled). In: ``{"type": "cancel", "job": "<id>"}``. A bad frame gets an ``error``
    frame; the socket stays open. No chunk traffic goes here, so no outbox: messages are small and
    at most a few per second per job (the worker throttles its progress reports)."""

    async def connect(self) -> None:
        user = self.scope.get("user")
        if user is None or not user.is_authenticated:
            await self.accept()
            await self._error("not_authenticated", "log in or pass an API token (?token= or Authorization)")
            await self.close(code=4401)
            return
        self.user = user
        self.group = jobs.group_name(user.pk)
        await self.channel_layer.group_add(self.group, self.channel_name)
        await self.accept()
        for message in await self._in_flight():
            await self._send_job(message)

    async def disconnect(self, code: int) -> None:
        if hasattr(self, "group"):
            await self.channel_layer.group_discard(self.group, self.channel_name)

    async def receive(self, text_data: str | None = None, bytes_data: bytes | None = None) -> None:
        message, problem = parse_client_message(text_data, JOB_CLIENT_MESSAGE_TYPES)
        if problem is None and not isinstance(message.get("job"), str):
            problem = "a cancel message needs a 'job' id string"
        if problem is not None:
            await self._error("bad_message", problem)
            return
        if not await self._cancel(message["job"]):
            await self._error("not_found", "no such job")

    async def job_update(self, event: dict) -> None:
        await self._send_job({k: v for k, v in event.items() if k != "type"})

    async def _send_job(self, message: dict) -> None:
        await self.send(text_data=json.dumps({"type": "job", **message}))

    async def _error(self, code: str, detail: str) -> None:
        await self.send(text_data=json.dumps({"type": "error", "code": code, "detail": detail}))

    @database_sync_to_async
    def _in_flight(self) -> list[dict]:
        mine = Job.objects.filter(owner=self.user, state__in=Job.IN_FLIGHT).select_related("worker")
        models = list(mine.values_list("model_name", flat=True).distinct())
        positions = job_queue_positions(models)
        return [
            job_status_message(job, position=positions.get(job.pk)) for job in mine.order_by("submitted_at")
        ]

    @database_sync_to_async
    def _cancel(self, job_id: str) -> bool:
        try:
            job = Job.objects.get(pk=uuid.UUID(job_id), owner=self.user)
        except (ValueError, Job.DoesNotExist):  # a bad UUID, another user's job or none
            return False
        jobs.job_cancel(job=job)  # the change reaches this socket through the group
        return True
