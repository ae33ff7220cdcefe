"""A chunk's H.264 fragment (fragmented MP4) → its access units as WebRTC sends them, unchanged.

The worker encodes each chunk once (``workers/runtime/media.py``): one closed GOP, muxed as one
``moof``+``mdat`` fragment, whose samples are AVCC (length-prefixed NAL units) with the SPS and PPS
in the init segment's ``avcC``. RTP (RFC 6184) carries NAL units without a container, and aiortc's
H.264 packetizer (``H264Encoder.pack``) reads Annex-B (start-code-delimited) access units. So each
fragment is demuxed here with PyAV's MP4 reader (the same reader ``decode_fragments`` and vLLM-Omni's
clients use) and put through FFmpeg's ``h264_mp4toannexb`` bitstream filter, which rewrites the
length prefixes as start codes and puts the SPS and PPS in front of the IDR picture, so every chunk
is decodable on its own, as it is over MSE. No pixel is decoded or re-encoded: the slice bytes are
the worker's.

Why demux here rather than have the chunk message carry Annex-B packets: the fragment is already on
the channel layer for every H.264 viewer; a second copy of each chunk in another framing would double
the H.264 bytes through Redis for every session, watched over WebRTC or not. The demux costs a few
milliseconds per chunk (measured in docs/media.md), is done once per chunk per web process whatever
the number of WebRTC viewers there (``AccessUnitCache``), and off the event loop (a thread).

Timestamps are moved to RTP's 90 kHz clock from the fragment's own timescale, on the session's
timeline (the fragment's ``tfdt`` is ``chunk_index × frames_per_chunk`` frames), so chunks follow each
other without a seam. Pure Python over PyAV: no Django, no aiortc.
"""

from __future__ import annotations

import asyncio
import collections
import io
import weakref
from dataclasses import dataclass
from fractions import Fraction

from sessions.payloads import payload_read

RTP_CLOCK = 90_000
RTP_TIME_BASE = Fraction(1, RTP_CLOCK)
START_CODE = b"\x00\x00\x00\x01"


@dataclass(frozen=True)
class AccessUnit:
    """One coded picture in Annex-B, with its presentation time and duration in 90 kHz ticks."""

    data: bytes
    pts: int
    duration: int
    keyframe: bool

    def nal_types(self) -> list[int]:
        """The ``nal_unit_type`` of each NAL unit, in order (7 SPS, 8 PPS, 5 IDR slice, 1 slice, 6 SEI)."""
        types, at = [], 0
        while (at := self.data.find(b"\x00\x00\x01", at)) != -1:
            at += 3
            if at < len(self.data):
                types.append(self.data[at] & 0x1F)
        return types


class MalformedFragment(ValueError):
    """The fragment is not H.264 in fragmented MP4 that PyAV can read."""


def fragment_access_units(init: bytes, fragment: bytes) -> list[AccessUnit]:
    """The access units of one chunk: ``init`` is the session's init segment (``ftyp``+``moov``),
    ``fragment`` the chunk's media segment. Raises ``MalformedFragment`` when it cannot be read."""
    import av
    from av.bitstream import BitStreamFilterContext

    units: list[AccessUnit] = []
    try:
        with av.open(io.BytesIO(init + fragment), mode="r", format="mp4") as container:
            stream = container.streams.video[0]
            if stream.codec_context.name != "h264":
                raise MalformedFragment(f"the fragment's codec is {stream.codec_context.name}, not h264")
            annexb = BitStreamFilterContext("h264_mp4toannexb", stream)
            for packet in container.demux(stream):
                if packet.size:  # the demuxer's final empty packet only marks the end
                    units.extend(_unit(filtered) for filtered in annexb.filter(packet))
            units.extend(_unit(filtered) for filtered in annexb.filter(None))
    except (av.error.FFmpegError, IndexError) as exc:
        raise MalformedFragment(f"cannot demux the fragment: {exc}") from exc
    if not units:
        raise MalformedFragment("the fragment holds no H.264 sample")
    return units


def _unit(packet) -> AccessUnit:
    base = packet.time_base
    return AccessUnit(
        data=bytes(packet),
        pts=round(packet.pts * base * RTP_CLOCK),
        duration=round((packet.duration or 0) * base * RTP_CLOCK),
        keyframe=bool(packet.is_keyframe),
    )


def to_packet(unit: AccessUnit, *, pts: int):
    """An ``av.Packet`` of ``unit``'s bytes at ``pts`` (90 kHz): what aiortc's sender packs into RTP."""
    import av

    packet = av.Packet(unit.data)
    packet.pts = packet.dts = pts
    packet.time_base = RTP_TIME_BASE
    return packet


class AccessUnitCache:
    """Each chunk demuxed once per process, whatever the number of WebRTC viewers of its session
    here: keyed by (session, epoch, index), the demux itself in a thread so the event loop serving
    every other socket never waits on it. Concurrent viewers of one chunk share one demux."""

    def __init__(self, size: int = 64) -> None:
        self.size = size
        self.entries: collections.OrderedDict[tuple, asyncio.Future] = collections.OrderedDict()
        self.demuxes = 0  # how many chunks were actually demuxed (the tests read it)

    def units(
        self, key: tuple, init: bytes, fragment: bytes | None, *, ref: dict | None = None
    ) -> asyncio.Future:
        """A future of the chunk's access units (or its ``MalformedFragment``; ``PayloadGone`` when
        the fragment came as ``ref`` and its Redis key could no longer be read)."""
        found = self.entries.get(key)
        if found is not None:
            self.entries.move_to_end(key)
            return found
        self.demuxes += 1
        future = asyncio.ensure_future(_units(init, fragment, ref))
        self.entries[key] = future
        while len(self.entries) > self.size:
            self.entries.popitem(last=False)
        return future


class PayloadGone(LookupError):
    """A fragment sent beside its message (``sessions.payloads``) that could not be read in time."""


async def _units(init: bytes, fragment: bytes | None, ref: dict | None) -> list:
    if fragment is None:
        payloads = await payload_read(ref or {"key": "", "sizes": []})
        if not payloads:
            raise PayloadGone(f"chunk payload {ref and ref.get('key')!r} expired or unreadable")
        fragment = payloads[0]
    return await asyncio.to_thread(fragment_access_units, init, fragment)


_caches: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, AccessUnitCache] = weakref.WeakKeyDictionary()


def process_cache() -> AccessUnitCache:
    """The cache of this process's event loop (its futures belong to that loop)."""
    loop = asyncio.get_running_loop()
    cache = _caches.get(loop)
    if cache is None:
        cache = _caches[loop] = AccessUnitCache()
    return cache
