"""The chunk wire format between workers, the channel layer and browsers (pure; no Django).

A chunk travels once per chunk through the channel layer to the session's group as
``{"type": "session.chunk", "header": {...}, "frames": [bytes, ...]}`` and reaches the browser as one
binary WebSocket frame: a 4-byte big-endian header length N, N bytes of UTF-8 JSON header, then the
frames' bytes concatenated (their lengths are listed in ``header["frames"]``).
"""

from __future__ import annotations

import json
import struct

HEADER_LENGTH = struct.Struct(">I")


def group_name(session_id: str) -> str:
    return f"session.{session_id}"


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
