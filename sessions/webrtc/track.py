"""The video track a WebRTC viewer receives: the worker's access units, paced by their timestamps.

aiortc's sender asks the track for one frame at a time (``recv``) and sends it at once; for an
``av.Packet`` it only packetizes (``H264Encoder.pack``), it never encodes. So the pacing is here:
each access unit leaves when its presentation time comes, on a wall clock anchored at the first one.

The outgoing timeline (the RTP timestamps the browser's jitter buffer schedules by) stays continuous
and close to the wall clock:

- a gap in the session's timeline (a chunk skipped, a new owner after a migration or a recovery) is
  closed: the next unit follows the last one sent by one frame, instead of the browser holding the
  picture for the missing time;
- a unit that comes late (its chunk arrived after its time: generation jitter, a stall) is sent at
  once and the timeline moves forward by the lateness, so the browser sees a pause where there was
  one rather than a burst it must buffer, and the added delay does not accumulate.

Chunks wait in a bounded queue; when a new one arrives to a full queue the oldest one not yet started
is dropped whole (a chunk is one closed GOP: dropping part of it would break the pictures after), and
the socket tells the client with a ``skipped`` frame, as for a slow socket.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from aiortc.mediastreams import MediaStreamError, MediaStreamTrack

from sessions.webrtc.access_units import RTP_CLOCK, AccessUnit, to_packet

logger = logging.getLogger(__name__)

MAX_PENDING_CHUNKS = 4
# A unit more than this late moves the outgoing timeline forward (smaller lateness is jitter the
# browser's buffer absorbs).
LATE_S = 0.05


@dataclass
class PendingChunk:
    header: dict
    units: Awaitable[list[AccessUnit]]


class ChunkTrack(MediaStreamTrack):
    """``offer(header, units)`` queues a chunk (``units``: a future of its access units, in decode
    order); ``recv`` hands aiortc the next unit when it is due. ``on_started(header)`` is called
    when a chunk's first unit leaves (the header plus ``rtp_pts``, that unit's outgoing pts), ``on_skipped(index)`` when a chunk is dropped unsent."""

    kind = "video"

    def __init__(
        self,
        *,
        on_started: Callable[[dict], None],
        on_skipped: Callable[[int], None],
        clock: Callable[[], float] = time.monotonic,
        max_pending: int = MAX_PENDING_CHUNKS,
    ) -> None:
        super().__init__()
        self.on_started, self.on_skipped = on_started, on_skipped
        self.clock = clock
        self.max_pending = max_pending
        self.pending: collections.deque[PendingChunk] = collections.deque()
        self.current: collections.deque[AccessUnit] = collections.deque()
        self.starting: dict | None = None  # the header of the chunk whose first unit is next
        self.arrived = asyncio.Event()
        self.shift = 0  # outgoing pts − session pts, in 90 kHz ticks
        self.last_pts: int | None = None  # outgoing pts of the last unit sent
        self.last_duration = 0
        self.anchor: tuple[float, int] | None = None  # (wall clock, outgoing pts) of the timeline
        self.units_sent = 0
        self.chunks_sent = 0

    def offer(self, header: dict, units: Awaitable[list[AccessUnit]]) -> None:
        if len(self.pending) >= self.max_pending:
            dropped = self.pending.popleft()
            self.on_skipped(int(dropped.header["index"]))
        self.pending.append(PendingChunk(header, units))
        self.arrived.set()

    async def recv(self):
        while not self.current:
            if self.readyState != "live":
                raise MediaStreamError
            if not self.pending:
                self.arrived.clear()
                await self.arrived.wait()
                continue
            chunk = self.pending.popleft()
            try:
                units = await chunk.units
            except Exception as exc:  # a fragment that cannot be read is skipped, not fatal
                logger.warning("webrtc.chunk unreadable index=%s: %s", chunk.header.get("index"), exc)
                self.on_skipped(int(chunk.header["index"]))
                continue
            self.current.extend(units)
            self.starting = chunk.header
        unit = self.current.popleft()
        pts, due = self._schedule(unit)
        wait = due - self.clock()
        if wait > 0:
            await asyncio.sleep(wait)
        if self.starting is not None:  # the chunk's first picture leaves now
            header, self.starting = self.starting, None
            self.chunks_sent += 1
            # ``rtp_pts``: this picture's RTP timestamp less aiortc's random origin (a constant per
            # sender), so a receiver can tell which presented picture starts which chunk.
            self.on_started({**header, "rtp_pts": pts})
        self.units_sent += 1
        return to_packet(unit, pts=pts)

    def _schedule(self, unit: AccessUnit) -> tuple[int, float]:
        """The unit's outgoing pts and the wall-clock time it is due (see the module's docstring)."""
        now = self.clock()
        if self.last_pts is None:
            self.shift = -unit.pts  # the outgoing timeline starts at 0
            pts = 0
            self.anchor = (now, 0)
        else:
            pts = unit.pts + self.shift
            following = self.last_pts + (self.last_duration or unit.duration or RTP_CLOCK // 16)
            if pts != following:  # a gap or a step back in the session's timeline
                self.shift += following - pts
                pts = following
        anchor_wall, anchor_pts = self.anchor
        due = anchor_wall + (pts - anchor_pts) / RTP_CLOCK
        if now - due > LATE_S:
            late = round((now - due) * RTP_CLOCK)
            self.shift += late
            pts += late
            due = now
        self.last_pts, self.last_duration = pts, unit.duration
        return pts, due
