"""The WebRTC pass-through: a chunk's fragment in, the worker's own H.264 access units out (no
re-encoding), decodable on their own, on the session's 90 kHz timeline; and the track's pacing."""

from __future__ import annotations

import asyncio
import struct

import numpy as np
import pytest

from sessions.webrtc.access_units import (
    RTP_CLOCK,
    AccessUnit,
    AccessUnitCache,
    MalformedFragment,
    PayloadGone,
    fragment_access_units,
)
from sessions.webrtc.track import ChunkTrack
from workers.runtime.media import FragmentEncoder, _walk, decode_fragments

FPS, PER_CHUNK = 16, 12


def moving_frames(count: int = PER_CHUNK, height: int = 96, width: int = 128) -> np.ndarray:
    y, x = np.mgrid[0:height, 0:width]
    return np.stack(
        [np.stack([(x + 9 * i) % 256, (y + 5 * i) % 256, (x + y + 3 * i) % 256], -1) for i in range(count)]
    ).astype(np.uint8)


@pytest.fixture(scope="module")
def fragment():
    return FragmentEncoder().encode(moving_frames(), fps=FPS, chunk_index=5, frames_per_chunk=PER_CHUNK)


def avcc_samples(init: bytes, data: bytes) -> tuple[list[bytes], list[bytes], list[list[bytes]]]:
    """Read independently of PyAV: the SPS and PPS of ``avcC`` and each sample's NAL units (``trun``
    sizes over ``mdat``), as the MP4 muxer wrote them."""
    for path, offset, _size, header in _walk(init):
        if path[-1] == b"avcC":
            at = offset + header + 5
            sps, pps = [], []
            count = init[at] & 0x1F
            at += 1
            for _ in range(count):
                (n,) = struct.unpack_from(">H", init, at)
                sps.append(init[at + 2 : at + 2 + n])
                at += 2 + n
            count = init[at]
            at += 1
            for _ in range(count):
                (n,) = struct.unpack_from(">H", init, at)
                pps.append(init[at + 2 : at + 2 + n])
                at += 2 + n
    sizes, mdat = [], None
    for path, offset, size, header in _walk(data):
        if path[-1] == b"trun":
            flags = int.from_bytes(data[offset + header + 1 : offset + header + 4], "big")
            (count,) = struct.unpack_from(">I", data, offset + header + 4)
            at = offset + header + 8 + (4 if flags & 0x1 else 0) + (4 if flags & 0x4 else 0)
            for _ in range(count):
                at += 4 if flags & 0x100 else 0
                sizes.append(struct.unpack_from(">I", data, at)[0])
                at += 4 if flags & 0x200 else 0
                at += (4 if flags & 0x400 else 0) + (4 if flags & 0x800 else 0)
        elif path[-1] == b"mdat":
            mdat = data[offset + header : offset + size]
    samples, at = [], 0
    for size in sizes:
        sample, nals, inner = mdat[at : at + size], [], 0
        while inner < len(sample):
            (n,) = struct.unpack_from(">I", sample, inner)
            nals.append(sample[inner + 4 : inner + 4 + n])
            inner += 4 + n
        samples.append(nals)
        at += size
    return sps, pps, samples


def nal_units(annexb: bytes) -> list[bytes]:
    """Split on 3- or 4-byte start codes (a NAL unit never ends with a zero byte: its trailing bits)."""
    return [nal.rstrip(b"\x00") for nal in annexb.split(b"\x00\x00\x01") if nal.rstrip(b"\x00")]


def test_a_fragment_becomes_the_workers_own_access_units_in_annex_b(fragment):
    # Given the fragment of chunk 5 as the worker encoded it
    sps, pps, samples = avcc_samples(fragment.init, fragment.data)

    # When it is passed through
    units = fragment_access_units(fragment.init, fragment.data)

    # Then each access unit carries exactly the sample's NAL units (not one byte re-encoded), the
    # first one (the IDR picture) preceded by the SPS and PPS so the chunk decodes on its own
    assert len(units) == len(samples) == PER_CHUNK
    first = nal_units(units[0].data)
    assert units[0].keyframe and units[0].nal_types()[-1] == 5
    assert sps[0] in first and pps[0] in first
    assert [n for n in first if n not in (sps[0], pps[0])] == samples[0]
    for unit, sample in zip(units[1:], samples[1:], strict=True):
        assert not unit.keyframe and nal_units(unit.data) == sample

    # and the timestamps are the session's timeline on RTP's 90 kHz clock: chunk 5 starts at frame 60
    frame = RTP_CLOCK // FPS
    assert [u.pts for u in units] == [(5 * PER_CHUNK + i) * frame for i in range(PER_CHUNK)]
    assert {u.duration for u in units} == {frame}


def test_the_access_units_decode_into_the_chunks_frames(fragment):
    import av

    # Given the access units of a chunk, as a WebRTC receiver reassembles them
    units = fragment_access_units(fragment.init, fragment.data)

    # When a bare H.264 decoder (no container, no extradata: only what travels over RTP) decodes them
    decoder = av.CodecContext.create("h264", "r")
    pictures = []
    for unit in units:
        pictures += [f.to_ndarray(format="rgb24") for f in decoder.decode(av.Packet(unit.data))]
    pictures += [f.to_ndarray(format="rgb24") for f in decoder.decode(None)]

    # Then they are the same pictures the MSE path decodes from the fragment
    expected, _ = decode_fragments(fragment.init, [fragment.data])
    assert len(pictures) == PER_CHUNK
    np.testing.assert_array_equal(np.stack(pictures), expected)


def test_a_fragment_that_is_not_mp4_is_refused_by_name():
    with pytest.raises(MalformedFragment, match="cannot demux"):
        fragment_access_units(b"not an init segment", b"\x00\x00\x00\x10moof" + bytes(8))


@pytest.mark.asyncio
async def test_each_chunk_is_demuxed_once_for_all_viewers_of_a_process(fragment):
    cache = AccessUnitCache()
    key = ("session", 1, 5, "libx264")
    first, second = (
        cache.units(key, fragment.init, fragment.data),
        cache.units(key, fragment.init, fragment.data),
    )
    assert first is second and cache.demuxes == 1
    assert len(await first) == PER_CHUNK


@pytest.mark.asyncio
async def test_a_fragment_sent_beside_its_message_is_read_from_redis_and_a_gone_one_is_said_so(fragment):
    # given a fragment too large for its pub/sub message, stored as the worker's publisher stores it
    import redis as sync_redis
    from django.conf import settings

    client = sync_redis.Redis.from_url(settings.REDIS_URL)
    key = "chunk-payload:test-webrtc:1:5:h264"
    client.set(key, fragment.data, ex=30)
    try:
        cache = AccessUnitCache()
        # when the WebRTC path asks for its access units by reference
        units = await cache.units(
            ("s", 1, 5, "x"), fragment.init, None, ref={"key": key, "sizes": [len(fragment.data)]}
        )
        # then they are the ones of the fragment itself
        assert [u.data for u in units] == [
            u.data for u in fragment_access_units(fragment.init, fragment.data)
        ]
        # and a reference whose key has expired fails as gone (the track skips the chunk and says so)
        with pytest.raises(PayloadGone):
            await cache.units(
                ("s", 1, 6, "x"), fragment.init, None, ref={"key": key + ":gone", "sizes": [10]}
            )
    finally:
        client.delete(key)


# --- the track: pacing by timestamps ---------------------------------------------------------------


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def units_of_chunk(index: int, *, per_chunk: int = 4, fps: int = 8) -> list[AccessUnit]:
    frame = RTP_CLOCK // fps
    return [
        AccessUnit(
            data=b"\x00\x00\x00\x01\x65", pts=(index * per_chunk + i) * frame, duration=frame, keyframe=i == 0
        )
        for i in range(per_chunk)
    ]


def done(value) -> asyncio.Future:
    future = asyncio.get_running_loop().create_future()
    future.set_result(value)
    return future


@pytest.mark.asyncio
async def test_the_track_paces_units_by_their_timestamps_and_closes_gaps(monkeypatch):
    # Given a track on a clock the test moves, and sleeps that move it
    clock, waits = FakeClock(), []

    async def sleep(seconds):
        waits.append(round(seconds, 4))
        clock.now += seconds

    monkeypatch.setattr("sessions.webrtc.track.asyncio.sleep", sleep)
    started = []
    track = ChunkTrack(
        on_started=lambda h: started.append((h["index"], clock.now, h["rtp_pts"])),
        on_skipped=print,
        clock=clock,
    )

    # When chunks 0 and 1 arrive together, then chunk 3 (chunk 2 was skipped) once they are played
    track.offer({"index": 0}, done(units_of_chunk(0)))
    track.offer({"index": 1}, done(units_of_chunk(1)))
    sent = [await track.recv() for _ in range(8)]
    track.offer({"index": 3}, done(units_of_chunk(3)))
    sent += [await track.recv() for _ in range(4)]

    # Then each unit leaves one frame (125 ms at 8 fps) after the one before, none early, and the
    # outgoing timeline has no hole where chunk 2 was: twelve frames, evenly spaced
    frame = RTP_CLOCK // 8
    assert [p.pts for p in sent] == [i * frame for i in range(12)]
    assert waits == [0.125] * 11
    assert [index for index, _, _ in started] == [0, 1, 3]
    assert started[1][1] == pytest.approx(100.5)  # chunk 1's first picture leaves at its time
    # and each chunk is announced with its first picture's outgoing pts (what the browser's
    # rtpTimestamp shows, less the sender's origin): the page maps presented pictures to chunks by it
    assert [rtp_pts for _, _, rtp_pts in started] == [sent[0].pts, sent[4].pts, sent[8].pts]


@pytest.mark.asyncio
async def test_a_late_chunk_leaves_at_once_and_moves_the_timeline_not_the_delay(monkeypatch):
    clock = FakeClock()

    async def sleep(seconds):
        clock.now += seconds

    monkeypatch.setattr("sessions.webrtc.track.asyncio.sleep", sleep)
    track = ChunkTrack(on_started=lambda h: None, on_skipped=print, clock=clock)
    track.offer({"index": 0}, done(units_of_chunk(0)))
    first = [await track.recv() for _ in range(4)]

    # When chunk 1 comes 300 ms after its time (generation jitter)
    clock.now += 0.125 + 0.3
    track.offer({"index": 1}, done(units_of_chunk(1)))
    before = clock.now
    late = [await track.recv() for _ in range(4)]

    # Then its first picture leaves at once, and the timestamps say the 300 ms pause that happened
    # (the browser shows a pause, it does not buffer 300 ms more for the rest of the stream)
    frame = RTP_CLOCK // 8
    assert late[0].pts - first[-1].pts == frame + round(0.3 * RTP_CLOCK)
    assert clock.now - before == pytest.approx(3 * 0.125)  # the rest of the chunk at its pace


@pytest.mark.asyncio
async def test_a_full_queue_drops_the_oldest_whole_chunk_and_says_so():
    skipped = []
    track = ChunkTrack(on_started=lambda h: None, on_skipped=skipped.append, max_pending=2)
    for index in range(4):
        track.offer({"index": index}, done(units_of_chunk(index)))
    assert [c.header["index"] for c in track.pending] == [2, 3]
    assert skipped == [0, 1]
