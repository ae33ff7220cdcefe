"""Procedurally generated clips for the demo model, whose text names what they show.

A clip is one shape of one colour on a plain background, moving in a straight line (wrapping
around the frame's edges, so a stream can go on for ever) at one of two speeds. Its prompt names all
of that in one of several phrasings, e.g. "a red circle moving left on a blue background" or
"a fast yellow diamond sliding up over purple". Omitted words take their defaults (speed: slow,
background: black).

Everything here is numpy and Python (no torch): the vocabulary and tokenizer the model uses, the
attribute tables, the train / held-out split, and the ground-truth renderer the training data, the
evaluator's tests and the generator of reference clips share.

Coordinates: positions are fractions of the frame in [0, 1) on a torus (x to the right, y down);
the object is centred on its position and drawn with wrap-around.
"""

from __future__ import annotations

import itertools
import re
from dataclasses import dataclass

import numpy as np

# -- attributes ------------------------------------------------------------------------------------

SHAPES = ("circle", "square", "triangle", "diamond")
COLOURS: dict[str, tuple[int, int, int]] = {
    "red": (220, 40, 40),
    "green": (40, 170, 60),
    "blue": (40, 80, 220),
    "yellow": (240, 220, 40),
    "purple": (140, 60, 200),
    "orange": (245, 140, 30),
    "white": (240, 240, 240),
    "black": (15, 15, 15),
}
DIRECTIONS: dict[str, tuple[float, float]] = {
    "left": (-1.0, 0.0),
    "right": (1.0, 0.0),
    "up": (0.0, -1.0),
    "down": (0.0, 1.0),
}
# Displacement per video frame, as a fraction of the frame (at 8 fps: 0.16 and 0.4 frames/s).
SPEEDS: dict[str, float] = {"slow": 0.02, "fast": 0.05}
DEFAULT_SPEED = "slow"
DEFAULT_BACKGROUND = "black"
# Half-size of every shape, as a fraction of the frame (a circle's radius, half a square's side).
OBJECT_EXTENT = 0.14
ATTRIBUTES = ("shape", "colour", "background", "direction", "speed")

# -- the vocabulary and the tokenizer (built in code; no downloads) ---------------------------------

SPEED_WORDS = {"slow": "slow", "slowly": "slow", "fast": "fast", "quickly": "fast", "quick": "fast"}
VERBS = ("moving", "going", "sliding", "drifting", "travelling")
FILLER = ("a", "an", "the", "on", "over", "against", "background", "backdrop", "and", "to", "is")
PAD, UNK, END = 0, 1, 2
VOCAB: tuple[str, ...] = (
    "<pad>",
    "<unk>",
    "<end>",
    *SHAPES,
    *COLOURS,
    *DIRECTIONS,
    *SPEED_WORDS,
    *VERBS,
    *FILLER,
)
WORD_IDS = {word: i for i, word in enumerate(VOCAB)}
MAX_TOKENS = 16


def tokenize(prompt: str, max_tokens: int = MAX_TOKENS) -> list[int]:
    """Lower-cased words → vocabulary ids (unknown words → <unk>), then <end>, padded to max_tokens.

    Only the first `max_tokens - 1` words count.
    """
    words = re.findall(r"[a-z]+", prompt.lower())[: max_tokens - 1]
    ids = [WORD_IDS.get(w, UNK) for w in words] + [END]
    return ids + [PAD] * (max_tokens - len(ids))


# -- clip descriptions -----------------------------------------------------------------------------


@dataclass(frozen=True)
class ClipSpec:
    shape: str
    colour: str
    background: str
    direction: str
    speed: str

    def __post_init__(self) -> None:
        if self.shape not in SHAPES or self.direction not in DIRECTIONS or self.speed not in SPEEDS:
            raise ValueError(f"unknown attribute in {self}")
        if self.colour not in COLOURS or self.background not in COLOURS or self.colour == self.background:
            raise ValueError(f"colour and background must be two different known colours: {self}")

    def labels(self) -> dict[str, str]:
        return {name: getattr(self, name) for name in ATTRIBUTES}

    @property
    def velocity(self) -> tuple[float, float]:
        dx, dy = DIRECTIONS[self.direction]
        return dx * SPEEDS[self.speed], dy * SPEEDS[self.speed]


def all_combinations() -> list[tuple[str, str, str]]:
    """Every (shape, colour, direction) triple, in a fixed order."""
    return list(itertools.product(SHAPES, COLOURS, DIRECTIONS))


def held_out_combinations() -> frozenset[tuple[str, str, str]]:
    """(shape, colour, direction) triples never shown in training, with any background or speed.

    A fixed Latin-square-like pick: one triple per (shape, colour) pair for a quarter of the pairs,
    chosen so every pair of attributes still appears in training (checked by the tests).
    """
    held = set()
    shapes, colours, directions = list(SHAPES), list(COLOURS), list(DIRECTIONS)
    for i, shape in enumerate(shapes):
        for j, colour in enumerate(colours):
            if (i + j) % 4 == 0:
                held.add((shape, colour, directions[(i + 2 * j) % len(directions)]))
    return frozenset(held)


def sample_spec(rng: np.random.Generator, *, held_out: bool) -> ClipSpec:
    """A random clip description from the training split (or, with held_out, the held-out one)."""
    pool = sorted(held_out_combinations())
    if not held_out:
        excluded = held_out_combinations()
        pool = [c for c in all_combinations() if c not in excluded]
    shape, colour, direction = pool[int(rng.integers(len(pool)))]
    backgrounds = [c for c in COLOURS if c != colour]
    background = backgrounds[int(rng.integers(len(backgrounds)))]
    speed = list(SPEEDS)[int(rng.integers(len(SPEEDS)))]
    return ClipSpec(shape, colour, background, direction, speed)


def describe(spec: ClipSpec, rng: np.random.Generator | None = None, *, canonical: bool = False) -> str:
    """A prompt naming `spec`: the canonical phrasing, or one of several (words may be omitted
    where they name the default)."""
    speed_adj = {"slow": "slow", "fast": "fast"}[spec.speed]
    if canonical or rng is None:
        return f"a {speed_adj} {spec.colour} {spec.shape} moving {spec.direction} on a {spec.background} background"
    pick = lambda options: options[int(rng.integers(len(options)))]  # noqa: E731
    verb = pick(VERBS)
    if spec.speed == DEFAULT_SPEED and rng.random() < 0.3:
        before, after = "", ""
    elif rng.random() < 0.5:
        before, after = pick({"slow": ["slow"], "fast": ["fast", "quick"]}[spec.speed]) + " ", ""
    else:
        before, after = "", " " + pick({"slow": ["slowly"], "fast": ["quickly", "fast"]}[spec.speed])
    article = pick(["a ", "the ", ""])
    subject = f"{article}{before}{spec.colour} {spec.shape} {verb} {spec.direction}{after}"
    if spec.background == DEFAULT_BACKGROUND and rng.random() < 0.3:
        return subject
    place = pick(
        [
            f" on a {spec.background} background",
            f" over {spec.background}",
            f" against a {spec.background} backdrop",
            f" on {spec.background}",
        ]
    )
    return subject + place


def parse_prompt(prompt: str) -> ClipSpec | None:
    """The attributes a prompt names (defaults for omitted speed/background), or None when it does
    not name a shape, a colour and a direction. Used by the evaluator and the tests, never by the model."""
    words = re.findall(r"[a-z]+", prompt.lower())
    found: dict[str, str] = {}
    seen_place = False
    for word in words:
        if word in ("on", "over", "against"):
            seen_place = True
        elif word in SHAPES:
            found.setdefault("shape", word)
        elif word in COLOURS:
            found.setdefault("background" if seen_place else "colour", word)
        elif word in DIRECTIONS:
            found.setdefault("direction", word)
        elif word in SPEED_WORDS:
            found.setdefault("speed", SPEED_WORDS[word])
    if not {"shape", "colour", "direction"} <= found.keys():
        return None
    found.setdefault("speed", DEFAULT_SPEED)
    found.setdefault("background", DEFAULT_BACKGROUND)
    try:
        return ClipSpec(**found)
    except ValueError:
        return None


# -- ground-truth rendering -------------------------------------------------------------------------


def inside(shape: str, rel: np.ndarray) -> np.ndarray:
    """Whether points `rel` [..., 2] (offsets from the centre in units of OBJECT_EXTENT) are inside."""
    x, y = rel[..., 0], rel[..., 1]
    if shape == "circle":
        return x * x + y * y <= 1.0
    if shape == "square":
        return (np.abs(x) <= 1.0) & (np.abs(y) <= 1.0)
    if shape == "diamond":
        return np.abs(x) + np.abs(y) <= 1.0
    if shape == "triangle":  # apex up, base at the bottom
        return (y <= 1.0) & (2.0 * np.abs(x) - y <= 1.0)
    raise ValueError(f"unknown shape {shape!r}")


def wrapped_offset(points: np.ndarray, centre: np.ndarray) -> np.ndarray:
    """Offset of `points` from `centre` on the unit torus, each axis in [-0.5, 0.5)."""
    return (points - centre + 0.5) % 1.0 - 0.5


def coverage(
    shape: str, points: np.ndarray, centre: np.ndarray, pixel: float, samples: int = 4
) -> np.ndarray:
    """Fraction of each pixel (centre `points` [..., 2], size `pixel`) the shape covers
    (samples × samples supersampling): anti-aliased ground truth."""
    offsets = (np.arange(samples) + 0.5) / samples - 0.5
    total = np.zeros(points.shape[:-1])
    for ox in offsets:
        for oy in offsets:
            sub = points + np.array([ox, oy]) * pixel
            total += inside(shape, wrapped_offset(sub, centre) / OBJECT_EXTENT)
    return total / samples**2


def positions(start: np.ndarray, spec: ClipSpec, frames: int, first: int = 0) -> np.ndarray:
    """Object centre of frames first..first+frames-1: [frames, 2] on the torus."""
    t = np.arange(first, first + frames, dtype=np.float64)[:, None]
    return (start[None, :] + t * np.array(spec.velocity)[None, :]) % 1.0


def pixel_centres(width: int, height: int) -> np.ndarray:
    xs = (np.arange(width) + 0.5) / width
    ys = (np.arange(height) + 0.5) / height
    return np.stack(np.meshgrid(xs, ys, indexing="xy"), axis=-1)  # [H, W, 2]


def render_points(spec: ClipSpec, centre: np.ndarray, points: np.ndarray, pixel: float) -> np.ndarray:
    """RGB in [0, 1] of pixels centred on `points` [..., 2] for one frame with the object at `centre`."""
    alpha = coverage(spec.shape, points, centre, pixel)[..., None]
    fg = np.array(COLOURS[spec.colour], dtype=np.float64) / 255.0
    bg = np.array(COLOURS[spec.background], dtype=np.float64) / 255.0
    return alpha * fg + (1.0 - alpha) * bg


def render_clip(spec: ClipSpec, start: np.ndarray, frames: int, size: int = 128) -> np.ndarray:
    """Ground-truth clip: uint8 [frames, size, size, 3]."""
    grid = pixel_centres(size, size)
    out = np.empty((frames, size, size, 3), dtype=np.uint8)
    for i, centre in enumerate(positions(start, spec, frames)):
        rgb = render_points(spec, centre, grid, 1.0 / size)
        out[i] = np.clip(np.round(rgb * 255.0), 0, 255).astype(np.uint8)
    return out
