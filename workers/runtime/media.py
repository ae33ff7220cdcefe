"""Live video as H.264 in fragmented MP4: one chunk, one closed GOP, one fragment.

A chunk (``frames_per_chunk`` frames) is encoded by a fresh encoder, so it starts with an IDR frame
and refers to nothing before it: a viewer can join, reconnect, or follow a migrated or recovered
session at any chunk, and no encoder state ever travels with a session (the state region, offload,
migration and checkpoints know nothing of video). PyAV's MP4 muxer packages it with
``frag_keyframe+empty_moov+default_base_moof`` — what Media Source Extensions and any MP4 reader
take — as an init segment (``ftyp`` + ``moov``, which depends only on the encoder, its options, the
resolution and the frame rate, so every chunk of a session yields the same bytes) and one media
segment (``moof`` + ``mdat``).

A fresh muxer starts its timeline at 0, so the fragment's decode time (``tfdt``) is moved to the
chunk's place in the session's timeline (``chunk_index × frames_per_chunk`` frames) and its
``mfhd`` sequence number to the chunk's: a player appending fragments in order, or a reader of
their concatenation (vLLM-Omni's example client decodes it with PyAV), sees one continuous stream.

The encoder is ``libx264`` on CPU; ``h264_nvenc`` is chosen when the worker has a GPU and the
FFmpeg build offers it (``select_h264_encoder``), falling back with a log line when it will not
open. Pure Python over PyAV and numpy (no torch, no Django).
"""

from __future__ import annotations

import io
import logging
import struct
import time
from dataclasses import dataclass, field
from fractions import Fraction

import numpy as np

logger = logging.getLogger(__name__)

MIME_MP4 = "video/mp4"
# Boxes whose payload is a sequence of boxes (ISO/IEC 14496-12); ``stsd`` and the sample entry
# have a header before their children, handled in ``_children``.
_CONTAINERS = {b"moov", b"trak", b"mdia", b"minf", b"stbl", b"moof", b"traf", b"mvex", b"edts", b"dinf"}
# Encoders for H.264, in the order they are preferred on each kind of worker.
CPU_ENCODERS = ("libx264", "libopenh264")
GPU_ENCODERS = ("h264_nvenc", *CPU_ENCODERS)


@dataclass(frozen=True)
class H264Options:
    """Rate control and speed of the live encoder. The defaults are what the wire measurements use
    (docs/media.md): x264 ``veryfast`` with ``zerolatency`` (no B-frames, no lookahead), constant
    quality CRF 23. ``threads`` 0 lets the encoder choose; 1 is the one-core figure."""

    preset: str = "veryfast"
    crf: int = 23
    threads: int = 0

    def codec_options(self, encoder: str, gop: int) -> dict[str, str]:
        # One keyframe per chunk and none inside it: a scene cut must not open a second GOP,
        # which would split the chunk into two fragments.
        if encoder == "libx264":
            return {
                "preset": self.preset,
                "tune": "zerolatency",
                "crf": str(self.crf),
                "threads": str(self.threads),
                "x264-params": f"keyint={gop}:min-keyint={gop}:scenecut=0:bframes=0:open-gop=0",
            }
        if encoder == "h264_nvenc":
            # NVENC's low-latency tuning; constant-quality VBR at the same nominal quality.
            return {
                "preset": "p4",
                "tune": "ull",
                "rc": "vbr",
                "cq": str(self.crf),
                "bf": "0",
                "g": str(gop),
                "forced-idr": "1",
                "no-scenecut": "1",
            }
        return {"threads": str(self.threads)}


@dataclass(frozen=True)
class Fragment:
    """One chunk as fragmented MP4. ``init`` is the session's init segment (the same bytes for
    every chunk of one resolution, frame rate and encoder), ``data`` the chunk's media segment."""

    init: bytes
    data: bytes
    mime: str
    encoder: str
    frames: int
    encode_ms: float
    chunk_index: int
    base_decode_time: int
    timescale: int = field(default=0)


class EncoderUnavailable(RuntimeError):
    pass


def select_h264_encoder(*, gpu: bool, available: set[str] | None = None) -> str:
    """The H.264 encoder this worker uses: NVENC on a GPU worker when the build has it and it opens
    (a build may list ``h264_nvenc`` on a machine without a usable GPU or driver), else libx264,
    else OpenH264. Each fallback is logged with its reason."""
    import av

    names = av.codecs_available if available is None else available
    for encoder in GPU_ENCODERS if gpu else CPU_ENCODERS:
        if encoder not in names:
            if encoder == "h264_nvenc":
                logger.warning("media.encoder h264_nvenc is not in this FFmpeg build; using the CPU encoder")
            continue
        reason = _open_failure(encoder)
        if reason is None:
            return encoder
        logger.warning("media.encoder %s does not open (%s); trying the next one", encoder, reason)
    raise EncoderUnavailable(
        f"none of the H.264 encoders {', '.join(GPU_ENCODERS if gpu else CPU_ENCODERS)} is usable"
    )


def _open_failure(encoder: str) -> str | None:
    """Encode two tiny frames; None when it works, else why not."""
    try:
        FragmentEncoder(encoder).encode(np.zeros((2, 64, 64, 3), np.uint8), fps=16, chunk_index=0)
    except Exception as exc:  # any failure to open or encode means this encoder is not usable here
        return f"{type(exc).__name__}: {exc}"
    return None


class FragmentEncoder:
    """Encodes chunks into fragments. Holds no state between chunks (each ``encode`` opens its own
    encoder and muxer), so one instance serves every session of a worker, from any thread."""

    def __init__(self, encoder: str = "libx264", options: H264Options | None = None) -> None:
        self.encoder = encoder
        self.options = options or H264Options()

    def encode(
        self, frames: np.ndarray, *, fps: float, chunk_index: int, frames_per_chunk: int | None = None
    ) -> Fragment:
        """RGB frames uint8 [T, H, W, 3] of chunk ``chunk_index`` → its fragment. Every chunk of a
        session has ``frames_per_chunk`` frames (default: this chunk's count); its first frame
        sits at ``chunk_index × frames_per_chunk`` on the session's timeline."""
        import av

        started = time.perf_counter()
        count, height, width, _ = frames.shape
        per_chunk = count if frames_per_chunk is None else frames_per_chunk
        # yuv420p needs even sides: an odd width or height repeats its last column or row.
        pad_h, pad_w = height % 2, width % 2
        if pad_h or pad_w:
            frames = np.pad(frames, ((0, 0), (0, pad_h), (0, pad_w), (0, 0)), mode="edge")
        rate = Fraction(fps).limit_denominator(1001)
        buffer = io.BytesIO()
        container = av.open(
            buffer, mode="w", format="mp4", options={"movflags": "frag_keyframe+empty_moov+default_base_moof"}
        )
        try:
            stream = container.add_stream(self.encoder, rate=rate)
            stream.width, stream.height = width + pad_w, height + pad_h
            stream.pix_fmt = "yuv420p"
            stream.codec_context.time_base = 1 / rate
            stream.codec_context.options = self.options.codec_options(self.encoder, max(count, 1))
            for i, frame in enumerate(frames):
                video_frame = av.VideoFrame.from_ndarray(frame, format="rgb24")
                video_frame.pts = i
                for packet in stream.encode(video_frame):
                    container.mux(packet)
            for packet in stream.encode(None):
                container.mux(packet)
        finally:
            container.close()
        raw = buffer.getvalue()
        split = _first_box(raw, b"moof")
        init, data = raw[:split], bytearray(raw[split:])
        timescale = media_timescale(init)
        base = round(Fraction(chunk_index * per_chunk) * timescale / rate)
        _place_fragments(data, base_decode_time=base, sequence=chunk_index * per_chunk + 1)
        return Fragment(
            init=init,
            data=bytes(data),
            mime=mime_type(init),
            encoder=self.encoder,
            frames=count,
            encode_ms=(time.perf_counter() - started) * 1000.0,
            chunk_index=chunk_index,
            base_decode_time=base,
            timescale=timescale,
        )


# --- boxes -----------------------------------------------------------------------------------------


def _boxes(data: bytes | bytearray, start: int = 0, end: int | None = None):
    """(type, offset, size, header) of each box in data[start:end], in order."""
    end = len(data) if end is None else end
    offset = start
    while offset + 8 <= end:
        size, kind = struct.unpack_from(">I4s", data, offset)
        header = 8
        if size == 1:
            (size,) = struct.unpack_from(">Q", data, offset + 8)
            header = 16
        elif size == 0:
            size = end - offset
        if size < header or offset + size > end:
            raise ValueError(f"malformed MP4 box {kind!r} at {offset}")
        yield kind, offset, size, header
        offset += size


def _child_range(kind: bytes, offset: int, size: int, header: int) -> tuple[int, int] | None:
    """Where a box's child boxes lie, or None for a box that holds none we read."""
    start = offset + header
    if kind == b"stsd":
        start += 8  # version/flags, entry count
    elif kind in (b"avc1", b"avc3"):
        start += 78  # the VisualSampleEntry's fields before its child boxes
    elif kind not in _CONTAINERS:
        return None
    return start, offset + size


def _walk(data, start: int = 0, end: int | None = None, path: tuple[bytes, ...] = ()):
    """(path of box types, offset, size, header) of every box, depth first."""
    for kind, offset, size, header in _boxes(data, start, end):
        here = (*path, kind)
        yield here, offset, size, header
        inside = _child_range(kind, offset, size, header)
        if inside is not None:
            yield from _walk(data, inside[0], inside[1], here)


def _first_box(data: bytes, kind: bytes) -> int:
    for found, offset, _size, _header in _boxes(data):
        if found == kind:
            return offset
    raise ValueError(f"no {kind.decode()} box: the muxer wrote no fragment")


def media_timescale(init: bytes) -> int:
    """Ticks per second of the video track (``mdhd``)."""
    for path, offset, _size, header in _walk(init):
        if path[-1] == b"mdhd":
            version = init[offset + header]
            at = offset + header + 4 + (16 if version == 1 else 8)
            return struct.unpack_from(">I", init, at)[0]
    raise ValueError("init segment without mdhd")


def mime_type(init: bytes) -> str:
    """``video/mp4; codecs="avc1.PPCCLL"`` from the init segment's ``avcC`` (RFC 6381): what
    ``MediaSource.isTypeSupported`` and ``addSourceBuffer`` take."""
    for path, offset, _size, header in _walk(init):
        if path[-1] == b"avcC":
            profile, constraints, level = init[offset + header + 1 : offset + header + 4]
            return f'{MIME_MP4}; codecs="avc1.{profile:02X}{constraints:02X}{level:02X}"'
    raise ValueError("init segment without avcC (not H.264?)")


def _place_fragments(data: bytearray, *, base_decode_time: int, sequence: int) -> None:
    """Shift every fragment of one chunk to the chunk's place on the session's timeline: the
    muxer's ``tfdt`` values (relative to the chunk's first frame) gain ``base_decode_time``, and the
    ``mfhd`` sequence numbers count on from ``sequence``."""
    seen = 0
    for path, offset, _size, header in _walk(data):
        kind = path[-1]
        if kind == b"mfhd":
            struct.pack_into(">I", data, offset + header + 4, sequence + seen)
            seen += 1
        elif kind == b"tfdt":
            at = offset + header + 4
            if data[offset + header] == 1:
                (value,) = struct.unpack_from(">Q", data, at)
                struct.pack_into(">Q", data, at, value + base_decode_time)
            else:
                (value,) = struct.unpack_from(">I", data, at)
                if value + base_decode_time >= 2**32:
                    raise ValueError("a version-0 tfdt cannot hold this decode time")
                struct.pack_into(">I", data, at, value + base_decode_time)
    if not seen:
        raise ValueError("no fragment (moof) in the media segment")


def fragment_placed(fragment: Fragment, *, chunk_index: int, fps: float) -> bytes:
    """``fragment``'s media segment moved to chunk ``chunk_index``'s place on the timeline (as if
    encoded for that index): how a benchmark sends a few encoded chunks as one long stream that a
    player presents chunk after chunk."""
    rate = Fraction(fps).limit_denominator(1001)
    base = round(Fraction(chunk_index * fragment.frames) * fragment.timescale / rate)
    data = bytearray(fragment.data)
    _place_fragments(
        data, base_decode_time=base - fragment.base_decode_time, sequence=chunk_index * fragment.frames + 1
    )
    return bytes(data)


def fragment_decode_time(data: bytes) -> int:
    """The first ``tfdt`` of a media segment (what a player places it by)."""
    for path, offset, _size, header in _walk(data):
        if path[-1] == b"tfdt":
            at = offset + header + 4
            return struct.unpack_from(">Q" if data[offset + header] == 1 else ">I", data, at)[0]
    raise ValueError("media segment without tfdt")


def decode_fragments(init: bytes, fragments: list[bytes]) -> tuple[np.ndarray, list[int]]:
    """Decode an init segment and fragments (in order) with PyAV: RGB frames [N, H, W, 3] and each
    frame's presentation time in frames of the stream's rate. What a viewer's decoder does; used
    by the tests and the media benchmark."""
    import av

    frames, pts = [], []
    with av.open(io.BytesIO(init + b"".join(fragments)), mode="r", format="mp4") as container:
        stream = container.streams.video[0]
        rate = stream.average_rate or stream.guessed_rate
        for frame in container.decode(stream):
            frames.append(frame.to_ndarray(format="rgb24"))
            pts.append(round(frame.pts * stream.time_base * rate) if frame.pts is not None else -1)
    if not frames:
        return np.zeros((0, 0, 0, 3), np.uint8), []
    return np.stack(frames), pts


__all__ = [
    "CPU_ENCODERS",
    "GPU_ENCODERS",
    "MIME_MP4",
    "EncoderUnavailable",
    "Fragment",
    "FragmentEncoder",
    "H264Options",
    "decode_fragments",
    "fragment_decode_time",
    "fragment_placed",
    "media_timescale",
    "mime_type",
    "select_h264_encoder",
]
