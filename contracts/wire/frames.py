"""The chunk wire format between workers, the channel layer and browsers (pure; no Django).

One contract, written once: the worker's publisher, the session consumer and the scheduler's
status broadcast all import it from here. Each session has one channel-layer group
(``group_name``); two message types travel on it:

- ``session.chunk`` (``chunk_message``): ``{"type": "session.chunk", "header": {...}, "frames":
  [bytes, ...]}``, sent once per chunk by the worker. It reaches the browser as one binary
  WebSocket frame (``encode_chunk_frame``): a 4-byte big-endian header length N, N bytes of UTF-8
  JSON header, then the frames' bytes concatenated (their lengths are listed in
  ``header["frames"]``).
- ``session.status`` (``status_message``): the session's status fields, sent after each committed
  change; the consumer forwards them to the browser as JSON text.
"""

from __future__ import annotations

import json
import struct

HEADER_LENGTH = struct.Struct(">I")
CHUNK_MESSAGE = "session.chunk"
STATUS_MESSAGE = "session.status"


def group_name(session_id: str) -> str:
    return f"session.{session_id}"


def chunk_message(header: dict, frames: list[bytes], *, media: dict | None = None) -> dict:
    """``media``: the chunk's H.264 fragment when a viewer reads H.264 (``init``: the session's
    init segment, ``fragment``: the chunk's ``moof``+``mdat``, ``mime``, ``encoder``)."""
    message = {"type": CHUNK_MESSAGE, "header": header, "frames": frames}
    if media is not None:
        message["media"] = media
    return message


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
