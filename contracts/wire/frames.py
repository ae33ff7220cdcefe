"""The chunk wire format between workers, the channel layer and browsers (pure; no Django).

One contract, written once: the worker's publisher, the session consumer and the scheduler's
status broadcast all import it from here. Each session has one channel-layer group
(``group_name``); two message types travel on it:

- ``session.chunk`` (``chunk_message``): ``{"type": "session.chunk", "header": {...}, "frames":
  [bytes, ...]}``, sent once per chunk by the worker; a chunk sampled for tracing also carries
  ``"traceparent"`` (W3C, ``contracts.tracing``), beside the header so browsers never see it. It reaches the browser as one binary
  WebSocket frame (``encode_chunk_frame``): a 4-byte big-endian header length N, N bytes of UTF-8
  JSON header, then the frames' bytes concatenated (their lengths are listed in
  ``header["frames"]``).
- ``session.status`` (``status_message``): the session's status fields, sent after each committed
  change; the consumer forwards them to the browser as JSON text.

Large payloads travel beside the message, not in it (``chunk_message_offloaded``). The pub/sub
channel layer gives each web process one subscriber connection, and Redis closes a subscriber whose
unread output passes ``client-output-buffer-limit pubsub`` (32 MB hard, 8 MB for 60 s by default):
at 832×480 a chunk is 0.1–2.4 MB, so a web process a second behind lost its connection, and with it
every message to every session it served (status included) until it had subscribed again, silently
(docs/media.md). So a codec's payload over ``PAYLOAD_INLINE_MAX_BYTES`` is written once to a Redis
key that lives ``PAYLOAD_TTL_S`` and the message carries a reference (``frames_ref``;
``media["fragment_ref"]``: the key and the payloads' sizes). The consumer reads it when it is about
to send the chunk, so a chunk a slow socket skips is never read; one whose key has expired is a
``skipped`` chunk, as for a slow client: loss the viewer is told of.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Callable

HEADER_LENGTH = struct.Struct(">I")
CHUNK_MESSAGE = "session.chunk"
STATUS_MESSAGE = "session.status"
# The tiny preset's 4 JPEGs of 64×64 (about 6 KB) stay inline, one round trip as before; a 832×480
# chunk does not. Hundreds of messages of this size fit in the subscriber's 8 MB soft limit.
PAYLOAD_INLINE_MAX_BYTES = 16 * 1024
# How long a chunk's payload can be read: well beyond a socket's outbox (8 chunks, 4-6 s at the
# presets' periods), after which the chunk would be skipped anyway. Redis holds at most this many
# seconds of every session's bitrate per codec watched (about 1.1 MB per H.264 832×480 session).
PAYLOAD_TTL_S = 10


def group_name(session_id: str) -> str:
    return f"session.{session_id}"


def chunk_message(header: dict, frames: list[bytes], *, media: dict | None = None) -> dict:
    """``media``: the chunk's H.264 fragment when a viewer reads H.264 (``init``: the session's
    init segment, ``fragment``: the chunk's ``moof``+``mdat``, ``mime``, ``encoder``)."""
    message = {"type": CHUNK_MESSAGE, "header": header, "frames": frames}
    if media is not None:
        message["media"] = media
    return message


def payload_key(header: dict, codec: str) -> str:
    """Where a chunk's ``codec`` payload waits for the consumers (one key per chunk, epoch and codec:
    a new owner's copy of an index never overwrites the old owner's)."""
    return f"chunk-payload:{header['session']}:{header['epoch']}:{header['index']}:{codec}"


def chunk_message_offloaded(
    header: dict, frames: list[bytes], *, media: dict | None = None, store: Callable[[dict[str, bytes]], None]
) -> dict:
    """``chunk_message``, with each codec's payload over ``PAYLOAD_INLINE_MAX_BYTES`` handed to
    ``store`` (``{key: bytes}``, one call, before the message is sent: write them with
    ``PAYLOAD_TTL_S``) and referenced in the message instead."""
    message = chunk_message(header, frames, media=media)
    payloads = {}
    if sum(len(f) for f in frames) > PAYLOAD_INLINE_MAX_BYTES:
        key = payload_key(header, "jpeg")
        payloads[key] = b"".join(frames)
        message["frames"] = []
        message["frames_ref"] = {"key": key, "sizes": [len(f) for f in frames]}
    if media is not None and len(media["fragment"]) > PAYLOAD_INLINE_MAX_BYTES:
        key = payload_key(header, "h264")
        payloads[key] = media["fragment"]
        message["media"] = {k: v for k, v in media.items() if k != "fragment"} | {
            "fragment_ref": {"key": key, "sizes": [len(media["fragment"])]}
        }
    if payloads:
        store(payloads)
    return message


def chunk_has_jpeg(message: dict) -> bool:
    """Whether a chunk message carries JPEG frames, inline or by reference."""
    return bool(message["frames"]) or "frames_ref" in message


def payload_split(blob: bytes, sizes: list[int]) -> list[bytes]:
    """The payloads a reference's key holds, concatenated, cut back at ``sizes``."""
    if len(blob) != sum(sizes):
        raise ValueError(f"payload is {len(blob)} bytes, its reference says {sum(sizes)}")
    parts, offset = [], 0
    for size in sizes:
        parts.append(blob[offset : offset + size])
        offset += size
    return parts


def status_message(status: dict) -> dict:
    return {"type": STATUS_MESSAGE, **status}


def encode_chunk_frame(header: dict, frames: list[bytes]) -> bytes:
    header = {**header, "type": "chunk", "frames": [len(f) for f in frames]}
    encoded = json.dumps(header, separators=(",", ":")).encode()
    return b"".join([HEADER_LENGTH.pack(len(encoded)), encoded, *frames])


def decode_chunk_frame(data: bytes) -> tuple[dict, list[bytes]]:
    if len(data) < HEADER_LENGTH.size:
        raise ValueError("chunk frame shorter than its length prefix")
    (length,) = HEADER_LENGTH.unpack_from(data)
    start = HEADER_LENGTH.size
    header = json.loads(data[start : start + length])
    frames, offset = [], start + length
    for size in header["frames"]:
        frames.append(data[offset : offset + size])
        offset += size
    if offset != len(data):
        raise ValueError("chunk frame length does not match its header")
    return header, frames
