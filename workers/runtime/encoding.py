"""Frame encoding off the model's critical path: a chunk in the codecs its viewers want (a JPEG per
frame, and/or one H.264 fragment: ``encode_chunk``, docs/media.md), and the results of one-shot jobs
(PNG for an image, MP4 for a video; docs/jobs.md's result encoding).

Kept free of torch so a process-pool encoder's children import only Pillow, PyAV and numpy.
"""

from __future__ import annotations

import io
import time
from dataclasses import dataclass
from fractions import Fraction

import numpy as np

from workers.runtime.media import Fragment, FragmentEncoder

# What a chunk is encoded as when no viewer said (the native socket's default codec).
JPEG_ONLY = frozenset({"jpeg"})


@dataclass(frozen=True)
class EncodedChunk:
    """A chunk as its viewers read it: ``frames`` (one JPEG each; empty when no viewer reads JPEG)
    and ``fragment`` (its H.264 fragment with the session's init segment; None when none reads it)."""

    frames: list[bytes]
    mime: str
    encode_ms: float
    fragment: Fragment | None = None


def encode_chunk(
    frames: np.ndarray,
    *,
    codecs: frozenset[str] = JPEG_ONLY,
    quality: int = 85,
    fps: float = 16.0,
    chunk_index: int = 0,
    fragment_encoder: FragmentEncoder | None = None,
) -> EncodedChunk:
    """One chunk, uint8 [T, H, W, 3], once per codec in ``codecs`` ("jpeg", "h264")."""
    started = time.perf_counter()
    jpeg = encode_jpeg_frames(frames, quality).frames if "jpeg" in codecs else []
    fragment = None
    if "h264" in codecs:
        encoder = fragment_encoder or FragmentEncoder()
        fragment = encoder.encode(frames, fps=fps, chunk_index=chunk_index)
    return EncodedChunk(
        frames=jpeg,
        mime="image/jpeg" if jpeg else (fragment.mime if fragment else "image/jpeg"),
        encode_ms=(time.perf_counter() - started) * 1000.0,
        fragment=fragment,
    )


def encode_jpeg_frames(frames: np.ndarray, quality: int = 85) -> EncodedChunk:
    """JPEG-encode uint8 frames [T, H, W, 3]; a JPEG sequence plays smoothly in any browser."""
    from PIL import Image

    started = time.perf_counter()
    encoded = []
    for frame in frames:
        buffer = io.BytesIO()
        Image.fromarray(frame, mode="RGB").save(buffer, format="JPEG", quality=quality)
        encoded.append(buffer.getvalue())
    return EncodedChunk(frames=encoded, mime="image/jpeg", encode_ms=(time.perf_counter() - started) * 1000.0)


def encode_png(frame: np.ndarray) -> bytes:
    """One RGB frame uint8 [H, W, 3] → PNG bytes (lossless: the result is the model's frame)."""
    from PIL import Image

    buffer = io.BytesIO()
    Image.fromarray(frame, mode="RGB").save(buffer, format="PNG")
    return buffer.getvalue()


# H.264 where the installed FFmpeg has an encoder for it, MPEG-4 Part 2 otherwise.
MP4_CODECS = ("libx264", "libopenh264", "mpeg4")


def mp4_codec() -> str:
    import av

    for codec in MP4_CODECS:
        if codec in av.codecs_available:
            return codec
    raise RuntimeError(f"the installed PyAV has none of the MP4 encoders {', '.join(MP4_CODECS)}")


def encode_mp4(frames: np.ndarray, fps: float) -> bytes:
    """RGB frames uint8 [F, H, W, 3] → MP4 bytes (yuv420p, `fps`), encoded in memory.

    yuv420p needs even sides: an odd width or height is padded by repeating the last column/row.
    The stream is written with fixed encoder options, so the same frames give the same bytes.
    """
    import av

    _count, height, width, _ = frames.shape
    pad_h, pad_w = height % 2, width % 2
    if pad_h or pad_w:
        frames = np.pad(frames, ((0, 0), (0, pad_h), (0, pad_w), (0, 0)), mode="edge")
    buffer = io.BytesIO()
    with av.open(buffer, mode="w", format="mp4") as container:
        stream = container.add_stream(mp4_codec(), rate=_fps_fraction(fps))
        stream.width, stream.height = width + pad_w, height + pad_h
        stream.pix_fmt = "yuv420p"
        if stream.codec_context.name == "libx264":
            # One thread: x264's output depends on its thread count, and determinism is the contract.
            # No assembly either: with it, the same frames encoded twice in one process gave
            # different bytes (measured here: 64×64×16 frames, sizes 33346/33391/33591 on successive
            # encodes; asm=0 gave the same bytes every time). Only one-shot videos are encoded here.
            stream.codec_context.options = {
                "threads": "1",
                "preset": "medium",
                "crf": "18",
                "x264-params": "asm=0",
            }
        for frame in frames:
            for packet in stream.encode(av.VideoFrame.from_ndarray(frame, format="rgb24")):
                container.mux(packet)
        for packet in stream.encode(None):
            container.mux(packet)
    return buffer.getvalue()


def _fps_fraction(fps: float) -> Fraction:
    return Fraction(fps).limit_denominator(1001)
