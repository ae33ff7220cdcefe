"""``WS /v1/realtime/video``: vLLM-Omni's streaming video socket over an ordinary session.

One socket, one session. ``session.start`` creates a StreamServe session exactly as
``POST /api/sessions/`` does (the catalogue's validation, the owner's live-session limit, the
scheduler's admission, queueing and placement); from then on the session is batched, suspended,
migrated, fenced and audited like any other, and appears in the console. Its media are the H.264
fragments the worker encodes once per chunk (docs/media.md): this socket asks for the ``h264``
codec as a viewer and forwards each fragment as ``video.chunk_metadata`` + one binary frame, the
first carrying the init segment (``ftyp`` + ``moov``) before its fragment, so the concatenation of
the binary frames is one fragmented MP4 that PyAV or a browser reads.

The session ends with the socket, as vLLM-Omni's does: after ``num_frames`` (rounded up to whole
chunks; ``session.done`` with ``stopped: false``), on ``session.stop`` (``stopped: true``), when the
client goes away, or when nothing happened for ``REALTIME_STALL_TIMEOUT_S`` — no chunk and no
``session.ping`` (an ``error`` frame says so, then ``session.done``).

A chunk from an older owner's epoch or an index already passed is dropped (``StreamPosition``, as
on the native socket): the client never sees an index twice nor two owners interleaved.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid

from asgiref.sync import sync_to_async
from channels.db import database_sync_to_async
from channels.generic.websocket import AsyncWebsocketConsumer
from django.conf import settings
from django.core.exceptions import ValidationError

from contracts.catalog import PRESETS
from contracts.wire.codecs import H264
from contracts.wire.frames import CHUNK_MESSAGE, STATUS_MESSAGE, group_name
from contracts.wire.viewers import VIEWER_REFRESH_S, viewer_leave, viewer_register
from sessions import services, tenants, viewers
from sessions.consumers import CodecLease, StreamPosition
from sessions.models import GenerationSession
from sessions.payloads import payload_read
from sessions.realtime import protocol

logger = logging.getLogger(__name__)

CLOSE_NORMAL = 1000
CLOSE_NOT_AUTHENTICATED = 4401


def _validation_message(exc: ValidationError) -> str:
    return "; ".join(f"{field}: {' '.join(reasons)}" for field, reasons in exc.message_dict.items())


class RealtimeVideoConsumer(AsyncWebsocketConsumer):
    session_id: str | None = None

    async def connect(self) -> None:
        self.user = await self._user()
        await self.accept()
        if self.user is None:
            await self.send(
                text_data=protocol.error("authentication required: Authorization: Bearer <API token>")
            )
            await self.close(code=CLOSE_NOT_AUTHENTICATED)
            return
        self.position = StreamPosition()
        self.events = protocol.EventLedger()
        self.sent_chunks = 0
        self.init_sent: bytes | None = None
        self.chunk_limit: int | None = None
        self.finished = False
        self.last_progress = time.monotonic()
        self.watchdog: asyncio.Task | None = None
        self.codec_lease: CodecLease | None = None
        self.presence: asyncio.Task | None = None

    @database_sync_to_async
    def _user(self):
        user = self.scope.get("user")
        if user is not None and user.is_authenticated:
            return user
        if settings.STREAMSERVE["OPENAI_API_ANONYMOUS"]:
            # The local single-user setup of the OpenAI adapter (docs/openai.md) covers this socket too.
            from sessions.openai.auth import local_user

            return local_user()
        return None

    async def disconnect(self, code: int) -> None:
        if self.watchdog is not None:
            self.watchdog.cancel()
        if self.session_id is not None:
            await self.channel_layer.group_discard(group_name(self.session_id), self.channel_name)
            if self.codec_lease is not None:
                await self.codec_lease.end()
            if self.presence is not None:
                self.presence.cancel()
                await self._viewer_call(viewer_leave)
            if not self.finished:
                # vLLM-Omni ends a realtime session when its socket closes; so does this one.
                await self._terminate("client_disconnected")

    async def dispatch(self, message: dict) -> None:
        # As on the native socket: chunk and status handlers never touch the ORM on the way in.
        if message["type"] == CHUNK_MESSAGE:
            await self.session_chunk(message)
            return
        if message["type"] == STATUS_MESSAGE:
            await self.session_status(message)
            return
        await super().dispatch(message)

    # --- client → server ------------------------------------------------------------------------

    async def receive(self, text_data: str | None = None, bytes_data: bytes | None = None) -> None:
        try:
            message = protocol.parse(text_data)
        except protocol.ProtocolError as exc:
            await self._error(str(exc))
            return
        if isinstance(message, protocol.Ping):
            self.last_progress = time.monotonic()
            await self.send(text_data=protocol.pong())
        elif isinstance(message, protocol.Start):
            await self._start(message)
        elif self.session_id is None or self.finished:
            await self._error("no active session: send session.start first")
        elif isinstance(message, protocol.Interaction):
            await self._interaction(message)
        else:
            await self._finish(stopped=True, reason="client_stop")

    async def _start(self, start: protocol.Start) -> None:
        if self.session_id is not None:
            await self._error("a session is already running on this socket; one session.start per socket")
            return
        try:
            session, adjusted = await self._create(start)
        except protocol.ProtocolError as exc:
            await self._error(str(exc))
            return
        self.session_id = str(session.pk)
        self.frames_per_chunk = session.frames_per_chunk
        self.chunk_limit = protocol.chunks_for(start.num_frames, session.frames_per_chunk)
        self.codec_lease = await CodecLease.begin(self.session_id, H264, self.channel_name)
        # A realtime client is a viewer (sessions.viewers): its session is never idled as unwatched.
        await self._viewer_call(viewer_register)
        self.presence = asyncio.create_task(self._keep_viewing())
        await self.channel_layer.group_add(group_name(self.session_id), self.channel_name)
        config = {
            "model": session.model_name,
            "prompt": start.prompt.strip(),
            "width": session.width,
            "height": session.height,
            "fps": session.fps,
            "frames_per_chunk": session.frames_per_chunk,
            "num_frames": self.chunk_limit * session.frames_per_chunk if self.chunk_limit else None,
            "seed": session.seed,
            "transition_chunks": 0,
            "ignored": list(start.ignored),
            "adjusted": adjusted,  # field → [asked, used]
        }
        await self.send(text_data=protocol.video_start(self.session_id, config))
        self.last_progress = time.monotonic()
        self.watchdog = asyncio.create_task(self._watch_stall())

    @database_sync_to_async
    def _create(self, start: protocol.Start) -> tuple[GenerationSession, dict[str, list]]:
        """The session, and what of the request was adjusted to what the model generates."""
        model = start.model or settings.STREAMSERVE["SERVED_MODELS"][0]
        preset = PRESETS.get(model)
        adjusted: dict[str, list] = {}
        resolution = start.resolution
        if preset is not None and resolution is not None and resolution not in preset.resolutions:
            # vLLM-Omni sizes the video as asked; a StreamServe model generates its own sizes. The
            # session runs at the model's, and video.start's config says so (its example client
            # asks for 640×384 whatever the model).
            width, height = (int(v) for v in preset.default_resolution.split("x"))
            adjusted |= {"width": [start.width, width], "height": [start.height, height]}
            resolution = None
        try:
            spec = services.session_spec_build(
                prompt=start.prompt, model_name=model, resolution=resolution, seed=start.seed
            )
        except ValidationError as exc:
            raise protocol.ProtocolError(_validation_message(exc)) from None
        if start.fps is not None and start.fps != spec.fps:
            adjusted["fps"] = [start.fps, spec.fps]
        try:
            session = services.session_create(owner=self.user, spec=spec)
        except (services.LiveSessionLimit, tenants.QuotaExceeded) as exc:
            # A tenant's spent quota answers an error frame naming the quota, its value and reset.
            raise protocol.ProtocolError(str(exc)) from None
        return session, adjusted

    async def _interaction(self, interaction: protocol.Interaction) -> None:
        event_id = interaction.event_id or uuid.uuid4().hex
        try:
            prompt = await self._prompt_add(interaction.prompt)
        except ValidationError as exc:
            await self._error(_validation_message(exc))
            return
        except services.SessionTerminated as exc:
            await self._error(str(exc))
            return
        self.events.queue(event_id, prompt.from_chunk)
        await self.send(text_data=protocol.interaction_queued(self.session_id, event_id))

    @database_sync_to_async
    def _prompt_add(self, text: str):
        session = GenerationSession.objects.get(pk=self.session_id)
        return services.session_prompt_add(session=session, text=text)

    # --- server → client ------------------------------------------------------------------------

    async def session_chunk(self, event: dict) -> None:
        if self.finished:
            return
        header = dict(event["header"])
        if not self.position.admit(header):
            return
        media = event.get("media")
        if media is None:
            # A chunk published before this viewer's codec reached the worker: no fragment yet.
            return
        # The init segment first (and again should a migration bring another encoder's), then the
        # fragment: the binary frames concatenated are one fragmented MP4.
        if "fragment_ref" in media:  # a large fragment travels beside the message (sessions.payloads)
            payloads = await payload_read(media["fragment_ref"])
            if payloads is None:
                return  # expired or unreadable: this protocol has no skip notice, the next chunk follows
            fragment = payloads[0]
        else:
            fragment = media["fragment"]
        body = fragment if media["init"] == self.init_sent else media["init"] + fragment
        self.init_sent = media["init"]
        index = int(header["index"])
        await self.send(
            text_data=protocol.chunk_metadata(
                self.session_id,
                transport_index=self.sent_chunks,
                generation_index=index,
                num_frames=int(header.get("frames_per_chunk") or self.frames_per_chunk),
                byte_length=len(body),
                events=self.events.at(index),
            )
        )
        await self.send(bytes_data=body)
        self.sent_chunks += 1
        self.last_progress = time.monotonic()
        if self.chunk_limit is not None and self.sent_chunks >= self.chunk_limit:
            await self._finish(stopped=False, reason="completed")

    async def session_status(self, event: dict) -> None:
        if event.get("status") == GenerationSession.Status.TERMINATED and not self.finished:
            # Ended elsewhere (an operator, the API, the idle rule): the client hears it as a stop.
            self.finished = True
            await self.send(text_data=protocol.done(self.session_id, chunks=self.sent_chunks, stopped=True))
            await self.close(code=CLOSE_NORMAL)

    async def _watch_stall(self) -> None:
        timeout = settings.STREAMSERVE["REALTIME_STALL_TIMEOUT_S"]
        while not self.finished:
            idle = time.monotonic() - self.last_progress
            if idle >= timeout:
                await self._error(f"stall timeout: no progress and no session.ping for {timeout:g} s")
                await self._finish(stopped=True, reason="stall_timeout")
                return
            await asyncio.sleep(min(1.0, timeout - idle))

    async def _finish(self, *, stopped: bool, reason: str) -> None:
        self.finished = True
        await self._terminate(reason)
        await self.send(text_data=protocol.done(self.session_id, chunks=self.sent_chunks, stopped=stopped))
        await self.close(code=CLOSE_NORMAL)

    async def _terminate(self, reason: str) -> None:
        try:
            await self._terminate_row(reason)
        except Exception:  # the socket is closing either way; the reason is in the log
            logger.exception("realtime.terminate_failed session=%s reason=%s", self.session_id, reason)

    @database_sync_to_async
    def _terminate_row(self, reason: str) -> None:
        session = GenerationSession.objects.get(pk=self.session_id)
        services.session_terminate(session=session, reason=reason)

    async def _viewer_call(self, call) -> None:
        try:
            await sync_to_async(call, thread_sensitive=False)(
                viewers.viewers_client(), self.session_id, self.channel_name
            )
        except Exception:  # a registry that is down must not cost the client its stream
            logger.exception("viewer registry %s failed session=%s", call.__name__, self.session_id)

    async def _keep_viewing(self) -> None:
        while True:
            await asyncio.sleep(VIEWER_REFRESH_S)
            await self._viewer_call(viewer_register)

    async def _error(self, message: str) -> None:
        await self.send(text_data=protocol.error(message))
