"""Scoring generated clips against their prompts (``python manage.py eval_demo_model``).

A plain measurement of the frames, not a learned judge:
- background: the palette colour most pixels of the clip are nearest to;
- object mask: pixels far (in RGB) from the background colour;
- colour: the palette colour (other than the background) most object pixels are nearest to;
- shape: per frame, the mask is rolled so the object sits in the middle (it may wrap around the
  edges), then its fill ratio of its bounding box (circle ≈ 0.79, square 1, triangle and diamond
  0.5) and the share of its area in the upper half of the box (triangle, apex up: 0.25; the others
  0.5) pick the nearest shape; the clip's shape is the majority over frames. Masks far too small or
  too large for the object measure as "none";
- direction and speed: the mask's centroid (a circular mean, because of the wrap-around) moves
  between consecutive frames; the mean displacement's larger axis and sign give the direction
  (below half a pixel per frame: "none") and its length the speed (threshold halfway between slow
  and fast).
A clip matches its prompt when every attribute matches.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from workers.runtime.models.demo_data import (
    ATTRIBUTES,
    COLOURS,
    OBJECT_EXTENT,
    SPEEDS,
    ClipSpec,
    describe,
    sample_spec,
)

PALETTE_NAMES = list(COLOURS)
PALETTE = np.array([COLOURS[name] for name in PALETTE_NAMES], dtype=np.float32)
SHAPE_PROTOTYPES = {
    "circle": (np.pi / 4, 0.5),
    "square": (1.0, 0.5),
    "triangle": (0.5, 0.25),
    "diamond": (0.5, 0.5),
}
FOREGROUND_DISTANCE = 60.0  # RGB distance from the background that counts as the object


def nearest_palette(pixels: np.ndarray) -> np.ndarray:
    """Index of the nearest palette colour for each RGB pixel [..., 3]."""
    d = ((pixels[..., None, :].astype(np.float32) - PALETTE) ** 2).sum(-1)
    return d.argmin(-1)


def circular_centroid(mask: np.ndarray) -> tuple[float, float]:
    """Centroid (x, y as fractions of the frame) of a boolean mask [H, W] on the torus."""
    h, w = mask.shape
    ys, xs = np.nonzero(mask)
    ax = np.angle(np.exp(2j * np.pi * (xs + 0.5) / w).mean()) / (2 * np.pi)
    ay = np.angle(np.exp(2j * np.pi * (ys + 0.5) / h).mean()) / (2 * np.pi)
    return float(ax % 1.0), float(ay % 1.0)


def measure_shape(mask: np.ndarray, centre: tuple[float, float]) -> str:
    h, w = mask.shape
    expected = (2 * OBJECT_EXTENT * w) * (2 * OBJECT_EXTENT * h)  # the square's area, in pixels
    area = int(mask.sum())
    if area < 0.2 * expected or area > 1.5 * expected:
        return "none"
    centred = np.roll(mask, (h // 2 - int(centre[1] * h), w // 2 - int(centre[0] * w)), axis=(0, 1))
    ys, xs = np.nonzero(centred)
    top, bottom, left, right = ys.min(), ys.max() + 1, xs.min(), xs.max() + 1
    box = (bottom - top) * (right - left)
    if (bottom - top) > 2.5 * OBJECT_EXTENT * h or (right - left) > 2.5 * OBJECT_EXTENT * w:
        return "none"  # scattered pixels, not one object
    fill = area / box
    upper = centred[top : (top + bottom) // 2].sum() + 0.5 * centred[(top + bottom) // 2].sum() * (
        (bottom - top) % 2
    )
    upper_share = float(upper) / area
    scores = {name: (fill - f) ** 2 + (upper_share - u) ** 2 for name, (f, u) in SHAPE_PROTOTYPES.items()}
    return min(scores, key=scores.get)


def measure_clip(frames: np.ndarray) -> dict[str, str]:
    """What a clip uint8 [T, H, W, 3] shows: {shape, colour, background, direction, speed}."""
    frames = np.asarray(frames)
    w = frames.shape[2]
    nearest = nearest_palette(frames)
    background = int(np.bincount(nearest.ravel(), minlength=len(PALETTE)).argmax())
    distance = np.sqrt(((frames.astype(np.float32) - PALETTE[background]) ** 2).sum(-1))
    masks = distance > FOREGROUND_DISTANCE
    result = {"background": PALETTE_NAMES[background]}
    votes = np.bincount(nearest[masks].ravel(), minlength=len(PALETTE)) if masks.any() else None
    if votes is not None:
        votes[background] = 0
    result["colour"] = PALETTE_NAMES[int(votes.argmax())] if votes is not None and votes.any() else "none"
    centres, shapes = [], []
    for mask in masks:
        if mask.sum() == 0:
            centres.append(None)
            shapes.append("none")
            continue
        centre = circular_centroid(mask)
        centres.append(centre)
        shapes.append(measure_shape(mask, centre))
    names, counts = np.unique(shapes, return_counts=True)
    result["shape"] = str(names[counts.argmax()])
    moves = [
        ((b[0] - a[0] + 0.5) % 1.0 - 0.5, (b[1] - a[1] + 0.5) % 1.0 - 0.5)
        for a, b in itertools.pairwise(centres)
        if a is not None and b is not None
    ]
    result["direction"] = result["speed"] = "none"
    if moves:
        dx, dy = np.mean(moves, axis=0)
        if max(abs(dx), abs(dy)) >= 0.5 / w:
            if abs(dx) >= abs(dy):
                result["direction"] = "right" if dx > 0 else "left"
            else:
                result["direction"] = "down" if dy > 0 else "up"
            threshold = 0.5 * (SPEEDS["slow"] + SPEEDS["fast"])
            result["speed"] = "fast" if float(np.hypot(dx, dy)) > threshold else "slow"
    return result


def score(measured: dict[str, str], spec: ClipSpec) -> dict[str, bool]:
    return {name: measured[name] == getattr(spec, name) for name in ATTRIBUTES}


def summarise(results: list[dict[str, bool]]) -> dict[str, Any]:
    n = len(results)
    per_attribute = {name: sum(r[name] for r in results) / n for name in ATTRIBUTES}
    overall = sum(all(r.values()) for r in results) / n
    return {"clips": n, "accuracy": per_attribute, "overall": overall}


def evaluate(
    model: Any,
    *,
    clips: int = 64,
    seed: int = 0,
    chunks: int = 4,
    batch: int = 8,
    held_out: bool = True,
    progress: Callable[[int], None] | None = None,
) -> dict[str, Any]:
    """Generate `clips` clips of `chunks` chunks for prompts of held-out (shape, colour, direction)
    combinations (random phrasing, background and speed) through the model contract, and score them."""
    rng = np.random.default_rng(seed)
    cases = []
    for i in range(clips):
        spec = sample_spec(rng, held_out=held_out)
        cases.append((spec, describe(spec, rng), seed * 100_003 + i))
    results, examples = [], []
    for offset in range(0, clips, batch):
        group = cases[offset : offset + batch]
        states = [model.create_state(prompt, clip_seed) for _, prompt, clip_seed in group]
        frames: list[list[np.ndarray]] = [[] for _ in group]
        for _ in range(chunks):
            for i, chunk in enumerate(model.generate(states)):
                frames[i].append(chunk.frames.cpu().numpy())
        for (spec, prompt, _), clip in zip(group, frames, strict=True):
            measured = measure_clip(np.concatenate(clip))
            verdict = score(measured, spec)
            results.append(verdict)
            if len(examples) < 8 or not all(verdict.values()):
                examples.append({"prompt": prompt, "expected": spec.labels(), "measured": measured})
        if progress is not None:
            progress(len(group))
    summary = summarise(results)
    summary["split"] = "held-out" if held_out else "train"
    summary["examples"] = examples[:24]
    return summary


def realtime_check(model: Any, *, chunks: int = 40, batch_sizes: tuple[int, ...] = (1, 4)) -> dict[str, Any]:
    """Chunk-step time (median over `chunks` steps) per batch size against the frame-rate budget."""
    budget_ms = 1000.0 * model.frames_per_chunk / model.fps
    rows = []
    for b in batch_sizes:
        states = [model.create_state("a red circle moving left on a blue background", i) for i in range(b)]
        model.generate(states)  # warm-up
        times = []
        for _ in range(chunks):
            started = time.perf_counter()
            model.generate(states)
            times.append((time.perf_counter() - started) * 1000.0)
        median = float(np.median(times))
        rows.append(
            {
                "batch": b,
                "chunk_ms_median": round(median, 2),
                "chunk_ms_p95": round(float(np.percentile(times, 95)), 2),
                "budget_ms": round(budget_ms, 1),
                "realtime_factor": round(budget_ms / median, 1),
            }
        )
    return {"fps": model.fps, "frames_per_chunk": model.frames_per_chunk, "per_batch": rows}
