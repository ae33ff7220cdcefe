"""Natural frames for the media benchmarks, with no model and nothing downloaded (light to import:
numpy, Pillow and matplotlib's sample data; no torch): ``bench_media`` and ``bench_delivery``'s
publisher both send these.

- ``photo_frames``: matplotlib's sample photograph (``grace_hopper.jpg``) through a camera that pans
  and zooms frame by frame, what a video codec's motion search is for;
- ``noise_frames``: smooth random noise, new every frame: content no codec compresses much, the
  worst case for the bytes on the wire (what ``bench_delivery`` sent before it had a photograph).
"""

from __future__ import annotations

import io

import matplotlib.cbook
import numpy as np
from PIL import Image

CONTENTS = ("photo", "noise")


def photo_frames(width: int, height: int, count: int) -> np.ndarray:
    """The sample photograph seen through a moving, zooming camera: ``count`` frames [T, H, W, 3]."""
    with matplotlib.cbook.get_sample_data("grace_hopper.jpg") as handle:
        image = Image.open(io.BytesIO(handle.read())).convert("RGB")
    aspect = width / height
    frames = []
    for t in range(count):
        progress = t / max(count - 1, 1)
        # The crop shrinks from the widest window of the output's aspect to 70 % of it (zoom in)
        # while its centre drifts left to right and a little down (pan).
        crop_w = min(image.width, image.height * aspect) * (1.0 - 0.3 * progress)
        crop_h = crop_w / aspect
        cx = crop_w / 2 + (image.width - crop_w) * progress
        cy = crop_h / 2 + (image.height - crop_h) * (0.3 + 0.2 * progress)
        box = (cx - crop_w / 2, cy - crop_h / 2, cx + crop_w / 2, cy + crop_h / 2)
        frames.append(np.asarray(image.resize((width, height), Image.Resampling.BICUBIC, box=box)))
    return np.stack(frames)


def noise_frames(width: int, height: int, count: int, *, seed: int = 0) -> np.ndarray:
    """``count`` frames of smooth noise with fine grain [T, H, W, 3]."""
    rng = np.random.default_rng(seed)
    frames = []
    for _ in range(count):
        coarse = rng.integers(0, 256, size=(max(height // 4, 1), max(width // 4, 1), 3), dtype=np.uint8)
        image = Image.fromarray(coarse, mode="RGB").resize((width, height), Image.BILINEAR)
        fine = np.asarray(image, dtype=np.int16) + rng.integers(-28, 29, size=(height, width, 3))
        frames.append(fine.clip(0, 255).astype(np.uint8))
    return np.stack(frames)


def content_frames(content: str, width: int, height: int, count: int) -> np.ndarray:
    """``count`` frames of ``content`` (one of ``CONTENTS``)."""
    if content == "photo":
        return photo_frames(width, height, count)
    if content == "noise":
        return noise_frames(width, height, count)
    raise ValueError(f"unknown content {content!r}; choose one of {', '.join(CONTENTS)}")
