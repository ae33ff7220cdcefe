"""The web process's side of a WebRTC viewer whose peer connection runs in a media process.

Why a media process: aiortc runs every peer connection's ICE consent, DTLS, SRTP and RTP packetization
on the event loop it is given. In the web process that is the loop every other socket's chunks wait
on; measured (docs/media.md), 25 WebRTC viewers took the socket viewers' delivery p99 past 20 ms.
``manage.py runmedia`` (``sessions.webrtc.media_process``) runs them in a process of its own, beside
the web process, one or several (a pool).

The path (all of it over the channel layer both processes already have, so no new service):

- **Which media process.** Each one holds a lease in Redis, renewed every ``MEDIA_HEARTBEAT_S``: one
  sorted set per channel-layer prefix (``ss:media:<prefix>:processes``), members the process's
  channel-layer channel scored by the lease's end, beside a hash of how many peers each serves. The
  web process sends an offer to the live one serving the fewest (``media_process_choose``).
- **Signalling** still arrives on the session socket; the web process checks it (a malformed SDP or
  candidate is answered there, as before) and relays it: ``media.offer`` (the SDP, the ICE servers,
  the session, the channel to answer on), ``media.ice``, ``media.close`` to the media process's
  channel.
- **Events back** (``webrtc.relay`` messages, ``event`` one of ``answer``, ``error``, ``state``,
  ``chunk``, ``skipped``) arrive on a channel of this relay's own (``new_channel``), read by its own
  task: the consumer is busy awaiting the answer while it comes, and Channels dispatches one message
  at a time per consumer.
- **Chunks** do not pass through here: the media process joins the session's group itself, fences
  the stream with the socket's ``StreamPosition``, and reads the fragments (or their Redis
  references) as the socket would. The web process only relays each chunk's ``webrtc.chunk``
  announcement (with its ``delivery_ms``, measured where the picture leaves) to the page.
- **When the media process is not there**: an offer no media process answers within
  ``WEBRTC_MEDIA_ANSWER_TIMEOUT_S`` (or with none registered) is an ``error`` frame
  ``webrtc_unavailable``, and the page falls back to the socket; a media process whose lease lapses
  while it serves this viewer (killed, stuck) is a ``webrtc.state`` ``failed``, likewise.
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
import uuid
from collections.abc import Callable

import redis
from asgiref.sync import sync_to_async
from django.conf import settings

from sessions.webrtc.peer import SignallingError, check_candidate, check_offer

logger = logging.getLogger(__name__)

MEDIA_LEASE_S = 15.0
MEDIA_HEARTBEAT_S = 5.0
RELAY_MESSAGE = "webrtc.relay"  # media process → web process
OFFER_MESSAGE, ICE_MESSAGE, CLOSE_MESSAGE = "media.offer", "media.ice", "media.close"
INLINE, PROCESS = "inline", "process"


def registry_key() -> str:
    """The media processes serving this deployment's channel layer (another prefix is another
    deployment on the same Redis: its channels never carry our groups)."""
    prefix = settings.CHANNEL_LAYERS["default"].get("CONFIG", {}).get("prefix", "asgi")
    return f"ss:media:{prefix}:processes"


def _load_key() -> str:
    return registry_key() + ":peers"


def media_process_register(client: redis.Redis, channel: str, peers: int) -> None:
    """Take or renew ``channel``'s lease and say how many peers it serves; lapsed leases go."""
    now = time.time()
    key, load = registry_key(), _load_key()
    lapsed = client.zrangebyscore(key, 0, now)
    pipe = client.pipeline()
    pipe.zadd(key, {channel: now + MEDIA_LEASE_S})
    pipe.hset(load, channel, peers)
    if lapsed:
        pipe.zrem(key, *lapsed)
        pipe.hdel(load, *lapsed)
    pipe.expire(key, int(MEDIA_LEASE_S * 4))
    pipe.expire(load, int(MEDIA_LEASE_S * 4))
    pipe.execute()


def media_process_leave(client: redis.Redis, channel: str) -> None:
    client.pipeline().zrem(registry_key(), channel).hdel(_load_key(), channel).execute()


def media_process_choose(client: redis.Redis) -> str | None:
    """The live media process serving the fewest peers (ties at random), counted one more at once
    so that a burst of offers spreads before the next heartbeats; ``None`` when none is live."""
    live = [c.decode() for c in client.zrangebyscore(registry_key(), time.time(), "+inf")]
    if not live:
        return None
    loads = client.hmget(_load_key(), live)
    fewest = min(int(n or 0) for n in loads)
    chosen = random.choice([c for c, n in zip(live, loads, strict=True) if int(n or 0) == fewest])
    client.hincrby(_load_key(), chosen, 1)
    return chosen


def media_process_alive(client: redis.Redis, channel: str) -> bool:
    score = client.zscore(registry_key(), channel)
    return score is not None and score > time.time()


_redis_client: redis.Redis | None = None


def registry_client() -> redis.Redis:
    global _redis_client
    if _redis_client is None:
        _redis_client = redis.Redis.from_url(settings.REDIS_URL)
    return _redis_client


async def _registry(call, *args):
    # Off the event loop and off the ORM's single sync thread.
    return await sync_to_async(call, thread_sensitive=False)(registry_client(), *args)


class MediaRelay:
    """One socket's WebRTC viewer, served by a media process: the same methods the socket calls on
    an in-process ``WebRtcViewer`` (``answer``, ``add_candidate``, ``close``), the same callbacks
    (``on_started(header)`` with ``delivery_ms``, ``on_skipped(index)``, ``on_state(state)``), and
    ``on_error(code, detail)`` for a signalling error the media process found after the answer."""

    in_process = False

    def __init__(
        self,
        *,
        layer,
        session_id: str,
        ice: list[dict],
        on_started: Callable[[dict], None],
        on_skipped: Callable[[int], None],
        on_state: Callable[[str], None],
        on_error: Callable[[str, str], None],
        timeout_s: float | None = None,
    ) -> None:
        self.layer, self.session_id, self.ice = layer, session_id, ice
        self.on_started, self.on_skipped, self.on_state, self.on_error = (
            on_started,
            on_skipped,
            on_state,
            on_error,
        )
        self.timeout_s = (
            timeout_s if timeout_s is not None else settings.STREAMSERVE["WEBRTC_MEDIA_ANSWER_TIMEOUT_S"]
        )
        self.peer = uuid.uuid4().hex
        self.media_channel: str | None = None
        self.reply_channel: str | None = None
        self.answered: asyncio.Future | None = None
        self.reader: asyncio.Task | None = None
        self.failed = False

    async def answer(self, sdp: object) -> str:
        offer = check_offer(sdp)  # answered here, without a round trip, as in-process
        channel = await _registry(media_process_choose)
        if channel is None:
            raise SignallingError(
                "webrtc_unavailable", "no media process is running to serve WebRTC; use the socket"
            )
        self.media_channel = channel
        self.reply_channel = await self.layer.new_channel()
        self.answered = asyncio.get_running_loop().create_future()
        self.reader = asyncio.create_task(self._read_events())
        await self.layer.send(
            channel,
            {
                "type": OFFER_MESSAGE,
                "peer": self.peer,
                "reply": self.reply_channel,
                "session": self.session_id,
                "sdp": offer,
                "ice": self.ice,
            },
        )
        try:
            event = await asyncio.wait_for(asyncio.shield(self.answered), self.timeout_s)
        except TimeoutError:
            raise SignallingError(
                "webrtc_unavailable",
                f"the media process did not answer within {self.timeout_s:g} s; use the socket",
            ) from None
        if event["event"] == "error":
            raise SignallingError(event["code"], event["detail"])
        return event["sdp"]

    async def add_candidate(self, candidate: object, sdp_mid: object, sdp_mline_index: object) -> None:
        check_candidate(candidate, sdp_mid, sdp_mline_index)  # a malformed one is answered here
        if self.media_channel is None:
            raise SignallingError("bad_candidate", "send the offer before its candidates")
        await self.layer.send(
            self.media_channel,
            {
                "type": ICE_MESSAGE,
                "peer": self.peer,
                "candidate": candidate,
                "sdpMid": sdp_mid,
                "sdpMLineIndex": sdp_mline_index,
            },
        )

    async def check_alive(self) -> None:
        """Called now and then by the socket: a media process whose lease lapsed while serving this
        viewer is a failed connection to the page (which falls back to the socket)."""
        if self.media_channel is None or self.failed or self.answered is None or not self.answered.done():
            return
        try:
            alive = await _registry(media_process_alive, self.media_channel)
        except redis.RedisError:
            return  # Redis away says nothing about the media process
        if not alive:
            self.failed = True
            logger.warning(
                "webrtc media process gone channel=%s session=%s", self.media_channel, self.session_id
            )
            self.on_state("failed")

    async def close(self) -> None:
        self.on_started, self.on_skipped = (lambda header: None), (lambda index: None)
        self.on_state, self.on_error = (lambda state: None), (lambda code, detail: None)
        if self.media_channel is not None:
            try:
                await self.layer.send(self.media_channel, {"type": CLOSE_MESSAGE, "peer": self.peer})
            except Exception:  # the media process also closes a peer whose browser went away
                logger.warning("webrtc close not relayed peer=%s", self.peer)
        if self.reader is not None:
            self.reader.cancel()  # unsubscribes the reply channel

    async def _read_events(self) -> None:
        while True:
            message = await self.layer.receive(self.reply_channel)
            if message.get("type") == RELAY_MESSAGE and message.get("peer") == self.peer:
                self.handle(message)

    def handle(self, message: dict) -> None:
        event = message["event"]
        if event in ("answer", "error") and self.answered is not None and not self.answered.done():
            self.answered.set_result(message)
        elif event == "error":
            self.on_error(message["code"], message["detail"])
        elif event == "state":
            self.on_state(message["state"])
        elif event == "chunk":
            self.on_started(message["header"])
        elif event == "skipped":
            self.on_skipped(int(message["index"]))
