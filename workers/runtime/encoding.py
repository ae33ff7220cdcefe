"""Frame encoding for the browser, off the model's critical path.

Kept free of torch so a process-pool encoder's children import only Pillow and numpy.
"""

from __future__ import annotations

import io
import time
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class EncodedChunk:
    frames: list[bytes]
    mime: str
    encode_ms: float


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
