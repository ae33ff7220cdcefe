"""One WebRTC viewer: the peer connection that carries a session's H.264 to one browser.

Signalling rides on the session socket (``sessions.consumers.SessionConsumer``); this class takes the
browser's offer and answers it, adds the candidates the browser trickles, and feeds the track the
chunks the socket admits (``StreamPosition``: one owner's stream, each index once). The browser
offers and aiortc answers: the browser is the one that receives, and its offer names what it can
decode; the answer sends H.264 only (the worker's encoding, passed through) with packetization mode
1 (FU-A, needed for pictures larger than one packet).

It runs in a media process (``sessions.webrtc.media_process``, the default: ``WEBRTC_MEDIA=process``)
or in the web process's event loop beside the other sockets (``WEBRTC_MEDIA=inline``). aiortc is
asyncio, and passing encoded packets through leaves it ICE, DTLS and SRTP (C), and RTP packetization
per packet; the demux of each fragment runs in a thread (``AccessUnitCache``). docs/media.md has the
figures.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Callable

from aiortc import (
    RTCConfiguration,
    RTCIceCandidate,
    RTCIceServer,
    RTCPeerConnection,
    RTCRtpSender,
    RTCSessionDescription,
)
from aiortc.exceptions import OperationError
from aiortc.sdp import candidate_from_sdp

from sessions.webrtc.access_units import AccessUnitCache
from sessions.webrtc.track import ChunkTrack

logger = logging.getLogger(__name__)

# The longest SDP accepted (a browser's offer for one video track is about 5 KB).
MAX_SDP_CHARS = 12_000
_H264_RTPMAP = re.compile(r"^a=rtpmap:(\d+) H264/90000", re.IGNORECASE | re.MULTILINE)


class SignallingError(ValueError):
    """A signalling message the viewer cannot use; ``code`` and the message go in the ``error`` frame."""

    def __init__(self, code: str, detail: str) -> None:
        super().__init__(detail)
        self.code = code


def ice_servers(config: list[dict]) -> list[RTCIceServer]:
    """``WEBRTC_ICE_SERVERS`` (validated by the settings) as aiortc's objects."""
    return [
        RTCIceServer(
            urls=server["urls"], username=server.get("username"), credential=server.get("credential")
        )
        for server in config
    ]


def check_offer(sdp: object) -> str:
    """The offer's SDP when it can carry our stream, else ``SignallingError`` naming what is wrong."""
    if not isinstance(sdp, str) or not sdp.strip():
        raise SignallingError("bad_sdp", "an offer needs an 'sdp' string")
    if len(sdp) > MAX_SDP_CHARS:
        raise SignallingError("bad_sdp", f"the SDP is longer than {MAX_SDP_CHARS} characters")
    if not sdp.lstrip().startswith("v=0"):
        raise SignallingError("bad_sdp", "malformed SDP: it must start with 'v=0'")
    if not re.search(r"^m=video ", sdp, re.MULTILINE):
        raise SignallingError("bad_sdp", "the offer has no video section (m=video) to receive the stream")
    h264 = set(_H264_RTPMAP.findall(sdp))
    mode1 = {
        pt
        for pt in h264
        if re.search(rf"^a=fmtp:{pt} .*packetization-mode=1", sdp, re.IGNORECASE | re.MULTILINE)
    }
    if not mode1:
        raise SignallingError(
            "bad_sdp", "the offer cannot receive H.264 with packetization-mode=1, the stream's codec"
        )
    return sdp


def check_candidate(candidate: object, sdp_mid: object, sdp_mline_index: object) -> RTCIceCandidate | None:
    """A trickled candidate (``candidate`` as the browser's ``RTCIceCandidate.candidate``) parsed, or
    ``None`` for the empty one that means the browser has no more; else ``SignallingError``."""
    if candidate in (None, ""):
        return None
    if not isinstance(candidate, str):
        raise SignallingError("bad_candidate", "'candidate' must be a string")
    if not isinstance(sdp_mid, str | None) or not isinstance(sdp_mline_index, int | None):
        raise SignallingError("bad_candidate", "'sdpMid' must be a string and 'sdpMLineIndex' an integer")
    try:
        parsed = candidate_from_sdp(candidate.removeprefix("candidate:"))
    except (AssertionError, ValueError, IndexError) as exc:
        raise SignallingError("bad_candidate", f"malformed ICE candidate {candidate[:80]!r}") from exc
    parsed.sdpMid, parsed.sdpMLineIndex = sdp_mid, sdp_mline_index
    if sdp_mid is None and sdp_mline_index is None:
        parsed.sdpMLineIndex = 0
    return parsed


class WebRtcViewer:
    """The peer connection of one socket. ``on_started(header)``/``on_skipped(index)``: a chunk's
    first picture left / a chunk was dropped unsent; ``on_state(state)``: the connection's state
    (``connecting``, ``connected``, ``failed``, ``closed``)."""

    in_process = True  # fed its chunks by the socket (a ``MediaRelay``'s media process feeds its own)

    def __init__(
        self,
        *,
        ice: list[dict],
        cache: AccessUnitCache,
        on_started: Callable[[dict], None],
        on_skipped: Callable[[int], None],
        on_state: Callable[[str], None],
    ) -> None:
        self.cache = cache
        self.on_state = on_state
        self.pc = RTCPeerConnection(RTCConfiguration(iceServers=ice_servers(ice)))
        self.track = ChunkTrack(on_started=on_started, on_skipped=on_skipped)
        self.pc.on("connectionstatechange", self._state_changed)

    async def answer(self, sdp: object) -> str:
        """The answer's SDP to the browser's offer (all our candidates in it: aiortc gathers first)."""
        offer = check_offer(sdp)
        # The sending transceiver and its codecs before the offer is applied: aiortc settles the
        # codecs of an m-line when it applies the remote description, matching it to a transceiver
        # of its kind that has no mid yet; without this it answers the offer's first codec (VP8).
        transceiver = self.pc.addTransceiver(self.track, direction="sendonly")
        transceiver.setCodecPreferences(
            [
                codec
                for codec in RTCRtpSender.getCapabilities("video").codecs
                if codec.mimeType.lower() in ("video/h264", "video/rtx")
            ]
        )
        try:
            await self.pc.setRemoteDescription(RTCSessionDescription(sdp=offer, type="offer"))
        except OperationError as exc:
            raise SignallingError("bad_sdp", f"no H.264 codec in common with the offer ({exc})") from exc
        except Exception as exc:  # aiortc's parser raises whatever the malformed line trips
            raise SignallingError("bad_sdp", f"malformed SDP: {type(exc).__name__}: {exc}") from exc
        answer = await self.pc.createAnswer()
        if answer is None or "H264/90000" not in answer.sdp:
            raise SignallingError("bad_sdp", "no H.264 codec in common with the offer")
        await self.pc.setLocalDescription(answer)
        return self.pc.localDescription.sdp

    async def add_candidate(self, candidate: object, sdp_mid: object, sdp_mline_index: object) -> None:
        """One candidate the browser trickled (``candidate`` as its ``RTCIceCandidate.candidate``);
        an empty one means the browser has no more."""
        parsed = check_candidate(candidate, sdp_mid, sdp_mline_index)
        if parsed is not None and self.pc.remoteDescription is None:
            raise SignallingError("bad_candidate", "send the offer before its candidates")
        await self.pc.addIceCandidate(parsed)

    @property
    def live(self) -> bool:
        return self.pc.connectionState == "connected"

    def take_admitted(self, session_id: str, header: dict, media: dict | None) -> None:
        """A chunk the socket's ``StreamPosition`` admitted (``media``: the chunk message's H.264
        part, ``None`` when it was encoded without it). Nothing is sent before the connection is up:
        the stream starts at the next chunk, a closed GOP. A chunk without a fragment once the stream
        has begun is skipped (``on_skipped``), as on the socket."""
        if not self.live:
            return
        if media is None:
            if self.track.chunks_sent:
                self.track.on_skipped(int(header["index"]))
            return
        header = {**header, "codec": "h264", "mime": media["mime"], "transport": "webrtc"}
        key = (session_id, header.get("epoch"), header["index"], media.get("encoder"))
        self.offer_chunk(key, header, media)

    def offer_chunk(self, key: tuple, header: dict, media: dict) -> None:
        """Queue an admitted chunk (``media``: the channel message's ``init`` and its ``fragment``, or
        the ``fragment_ref`` of a fragment too large for the message, read from Redis once per web
        process: ``sessions.payloads``)."""
        fragment = media.get("fragment")
        ref = media.get("fragment_ref") if fragment is None else None
        self.track.offer(header, self.cache.units(key, media["init"], fragment, ref=ref))

    async def close(self) -> None:
        """Closed by its socket (gone, or a new offer): nobody is left to tell of the state."""
        self.on_state = lambda state: None
        self.track.stop()
        await self.pc.close()

    async def _state_changed(self) -> None:
        state = self.pc.connectionState
        logger.info("webrtc.state %s", state)
        self.on_state(state)
