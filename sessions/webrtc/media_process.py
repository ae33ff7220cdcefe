"""The media process: WebRTC peer connections, off the web process's event loop (``manage.py runmedia``).

One process (or several, a pool: each registers and the web processes spread offers over them,
``sessions.webrtc.relay``) with its own event loop, where aiortc runs each viewer's ICE, DTLS, SRTP,
RTP packetization and pacing. The web process keeps the socket, the viewer's registration and codec
lease, and relays the signalling; this process:

- answers a ``media.offer`` with a ``WebRtcViewer`` (the same class the web process runs inline,
  ``WEBRTC_ICE_SERVERS`` as the web process sent them), its errors (``bad_sdp``…) sent back as
  error events;
- subscribes each peer to its session's group on the channel layer, so it receives the chunk
  messages the worker publishes, the same ones the sockets receive, and admits them with the
  socket's own ``StreamPosition`` (one owner's stream, each index once, never an older epoch's);
- hands each admitted chunk's fragment (or its Redis reference, read once per process) to the
  peer's ``ChunkTrack``: demuxed once per chunk per process (``AccessUnitCache``), passed through,
  paced by its timestamps;
- sends the web process each chunk's start (``chunk``, with ``delivery_ms`` measured as the first
  picture leaves), each chunk dropped (``skipped``) and the connection's state (``state``);
- closes a peer on ``media.close`` (the socket went, or offered again) or when its connection fails
  or closes (the browser went: ICE consent lapses).

``MediaProcess.step()`` handles one control message (an offer, a candidate, a close) and returns
whether it did anything, so a test can drive it; ``run()`` loops until ``stop()`` (SIGTERM).
"""

from __future__ import annotations

import asyncio
import logging
import time

from channels.layers import get_channel_layer
from django.conf import settings

from contracts.wire.frames import CHUNK_MESSAGE, group_name
from sessions.consumers import StreamPosition
from sessions.webrtc.access_units import process_cache
from sessions.webrtc.peer import SignallingError, WebRtcViewer
from sessions.webrtc.relay import (
    CLOSE_MESSAGE,
    ICE_MESSAGE,
    MEDIA_HEARTBEAT_S,
    OFFER_MESSAGE,
    RELAY_MESSAGE,
    media_process_leave,
    media_process_register,
    registry_client,
)

logger = logging.getLogger(__name__)


class MediaPeer:
    """One viewer's peer connection in this process, and its subscription to the session's chunks."""

    def __init__(
        self, *, process: MediaProcess, peer: str, reply: str, session_id: str, ice: list[dict]
    ) -> None:
        self.process, self.peer, self.reply, self.session_id = process, peer, reply, session_id
        self.position = StreamPosition()
        self.outgoing: asyncio.Queue[dict] = asyncio.Queue()
        self.viewer = WebRtcViewer(
            ice=ice,
            cache=process_cache(),
            on_started=self._started,
            on_skipped=self._skipped,
            on_state=self._state,
        )
        self.chunk_channel: str | None = None
        self.tasks: list[asyncio.Task] = [asyncio.create_task(self._send_events())]
        self.closed = False

    async def open(self, sdp: object) -> str:
        """The answer to the browser's offer; from then on the session's chunks come to this peer."""
        answer = await self.viewer.answer(sdp)
        if self.closed:  # closed while answering: nothing to subscribe
            return answer
        layer = self.process.layer
        channel = await layer.new_channel()
        receiver = asyncio.create_task(self._receive_chunks(channel))
        await layer.group_add(group_name(self.session_id), channel)
        if self.closed:  # closed meanwhile: undo (cancelling the receiver unsubscribes its channel)
            await layer.group_discard(group_name(self.session_id), channel)
            receiver.cancel()
            return answer
        self.chunk_channel = channel
        self.tasks.append(receiver)
        return answer

    def emit(self, event: str, **fields) -> None:
        """An event to the web process, in order (one sender task per peer)."""
        self.outgoing.put_nowait({"type": RELAY_MESSAGE, "peer": self.peer, "event": event, **fields})

    async def _send_events(self) -> None:
        while True:
            message = await self.outgoing.get()
            try:
                await self.process.layer.send(self.reply, message)
            except Exception:
                logger.exception("webrtc event not sent peer=%s event=%s", self.peer, message["event"])
            finally:
                self.outgoing.task_done()

    async def _receive_chunks(self, channel: str) -> None:
        while True:
            message = await self.process.layer.receive(channel)
            if message.get("type") == CHUNK_MESSAGE:
                self.chunk(message)

    def chunk(self, event: dict) -> None:
        """A chunk of the session, as the socket's ``session_chunk`` admits it (``StreamPosition``)."""
        header = event["header"]
        if self.position.admit(header):
            self.viewer.take_admitted(self.session_id, header, event.get("media"))

    def _started(self, header: dict) -> None:
        generated_at = header.get("generated_at")
        if generated_at is not None:
            header = {**header, "delivery_ms": max(0.0, (time.time() - generated_at) * 1000.0)}
        self.emit("chunk", header=header)

    def _skipped(self, index: int) -> None:
        self.emit("skipped", index=index)

    def _state(self, state: str) -> None:
        self.emit("state", state=state)
        if state in ("failed", "closed"):
            asyncio.get_running_loop().call_soon(self.process.forget, self.peer)

    async def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        await self.viewer.close()
        if self.chunk_channel is not None:
            await self.process.layer.group_discard(group_name(self.session_id), self.chunk_channel)
        # Let the last events (an error, a final state) go before the sender stops: join() waits
        # for the one being sent too, not only for the queue to be empty.
        try:
            await asyncio.wait_for(self.outgoing.join(), 2.0)
        except TimeoutError:
            logger.warning("webrtc events not sent before close peer=%s", self.peer)
        for task in self.tasks:
            task.cancel()  # the chunk receiver's cancellation unsubscribes its channel


class MediaProcess:
    """The process's peers and its registration; ``step()`` handles one control message."""

    def __init__(self, *, layer=None) -> None:
        self.layer = layer or get_channel_layer()
        self.peers: dict[str, MediaPeer] = {}
        self.channel: str | None = None
        self.stopping = asyncio.Event()
        self.background: set[asyncio.Task] = set()

    async def start(self) -> str:
        """Its control channel, registered (the web processes send offers there)."""
        self.channel = await self.layer.new_channel()
        await self._register()
        logger.info("media process up channel=%s", self.channel)
        return self.channel

    async def run(self) -> None:
        if self.channel is None:
            await self.start()
        heartbeat = asyncio.create_task(self._heartbeat())
        stopping = asyncio.create_task(self.stopping.wait())
        try:
            while not self.stopping.is_set():
                receiving = asyncio.create_task(self.layer.receive(self.channel))
                done, _ = await asyncio.wait({receiving, stopping}, return_when=asyncio.FIRST_COMPLETED)
                if receiving in done:
                    await self.handle(receiving.result())
                else:
                    receiving.cancel()
        finally:
            heartbeat.cancel()
            stopping.cancel()
            await self.shutdown()

    async def step(self) -> bool:
        """Receive one control message and handle it; whether it was one this process acts on."""
        return await self.handle(await self.layer.receive(self.channel))

    async def handle(self, message: dict) -> bool:
        kind, peer = message.get("type"), message.get("peer")
        if kind == OFFER_MESSAGE:
            if peer in self.peers:  # the same offer twice: keep the first
                return False
            # Known at once, so that a close right behind the offer finds it; answered concurrently
            # (aiortc gathers its candidates before answering).
            media_peer = self.peers[peer] = MediaPeer(
                process=self,
                peer=peer,
                reply=message["reply"],
                session_id=str(message["session"]),
                ice=message.get("ice") or [],
            )
            task = asyncio.create_task(self._offer(media_peer, message.get("sdp")))
            self.background.add(task)
            task.add_done_callback(self.background.discard)
            return True
        if kind == ICE_MESSAGE and peer in self.peers:
            await self._candidate(self.peers[peer], message)
            return True
        if kind == CLOSE_MESSAGE and peer in self.peers:
            await self.peers.pop(peer).close()
            return True
        return False

    async def _offer(self, media_peer: MediaPeer, sdp: object) -> None:
        try:
            answer = await media_peer.open(sdp)
        except SignallingError as exc:
            media_peer.emit("error", code=exc.code, detail=str(exc))
            self.forget(media_peer.peer)
            return
        except Exception as exc:  # aiortc failing on an offer must not take the process down
            logger.exception("webrtc offer failed peer=%s", media_peer.peer)
            media_peer.emit("error", code="bad_sdp", detail=f"the offer could not be answered: {exc}")
            self.forget(media_peer.peer)
            return
        if media_peer.closed:  # closed while it was being answered (the socket went)
            return
        media_peer.emit("answer", sdp=answer)

    async def _candidate(self, media_peer: MediaPeer, message: dict) -> None:
        try:
            await media_peer.viewer.add_candidate(
                message.get("candidate"), message.get("sdpMid"), message.get("sdpMLineIndex")
            )
        except SignallingError as exc:
            media_peer.emit("error", code=exc.code, detail=str(exc))

    def forget(self, peer: str) -> None:
        """Close and drop a peer (its connection failed or closed, or its offer was refused)."""
        media_peer = self.peers.pop(peer, None)
        if media_peer is not None:
            task = asyncio.ensure_future(media_peer.close())
            self.background.add(task)
            task.add_done_callback(self.background.discard)

    def stop(self) -> None:
        self.stopping.set()

    async def shutdown(self) -> None:
        if self.channel is not None:
            try:
                await asyncio.to_thread(media_process_leave, registry_client(), self.channel)
            except Exception:
                logger.exception("media process not deregistered channel=%s", self.channel)
        peers, self.peers = list(self.peers.values()), {}
        await asyncio.gather(*(p.close() for p in peers), return_exceptions=True)
        if self.background:
            await asyncio.gather(*self.background, return_exceptions=True)

    async def _register(self) -> None:
        await asyncio.to_thread(media_process_register, registry_client(), self.channel, len(self.peers))

    async def _heartbeat(self) -> None:
        while True:
            await asyncio.sleep(MEDIA_HEARTBEAT_S)
            try:
                await self._register()
            except Exception:  # Redis away: the lease lapses and the web processes stop choosing us
                logger.exception("media process lease not renewed")


def media_settings_problem() -> str | None:
    """Why this deployment would not use a media process (``WEBRTC_MEDIA=inline``), for the command."""
    if settings.STREAMSERVE["WEBRTC_MEDIA"] != "process":
        return "WEBRTC_MEDIA=inline: the web processes run WebRTC themselves and send no offer here"
    return None
