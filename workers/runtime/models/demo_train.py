"""Training the demo model on procedurally generated clips (``python manage.py train_demo_model``).

Every step draws a batch of clips from the training split (``demo_data``: held-out combinations of
shape, colour and direction never appear), each with a prompt in one of several phrasings, a random
starting position and a random frame of the clip. The loss has two parts:
- pixels: the frame's pixels at random points (most of them near the object, the rest anywhere),
  rendered by the model's decoder with the object at the clip's ground-truth position (the latent
  is teacher-forced), against the anti-aliased ground truth — mean squared error in RGB;
- motion: the predicted displacement per frame against the clip's track (position of the next frame
  minus this one, on the torus).

Determinism: the data come from a numpy generator seeded with `seed`, the initial weights from
`torch.manual_seed(seed)`; with the same thread count on the same CPU build of torch the run gives
the same weights bit for bit (a different thread count may change float rounding).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from workers.runtime.models.demo import CUTOFF, WEIGHTS_DIR, DemoNetwork
from workers.runtime.models.demo import PRESETS as DEMO_PRESETS
from workers.runtime.models.demo_data import (
    MAX_TOKENS,
    describe,
    positions,
    render_points,
    sample_spec,
    tokenize,
    wrapped_offset,
)

FAR_POINTS, NEAR_POINTS = 128, 384
CLIP_FRAMES = 16


@dataclass
class TrainReport:
    seed: int
    steps: int
    seconds: float
    final_loss: float
    pixel_loss: float
    motion_loss: float
    parameters: int
    out: str

    def as_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)


def make_batch(rng: np.random.Generator, batch: int, pixel: float) -> dict[str, torch.Tensor]:
    ids, points, targets, centres, steps = [], [], [], [], []
    for _ in range(batch):
        spec = sample_spec(rng, held_out=False)
        ids.append(tokenize(describe(spec, rng), MAX_TOKENS))
        start = rng.random(2)
        frame = int(rng.integers(CLIP_FRAMES - 1))
        track = positions(start, spec, 2, first=frame)  # this frame and the next one
        centre = track[0]
        near = (centre + rng.uniform(-1.1 * CUTOFF, 1.1 * CUTOFF, size=(NEAR_POINTS, 2))) % 1.0
        pts = np.concatenate([rng.random((FAR_POINTS, 2)), near])
        points.append(pts)
        targets.append(render_points(spec, centre, pts, pixel))
        centres.append(centre)
        steps.append(wrapped_offset(track[1], track[0]))
    return {
        "ids": torch.tensor(ids),
        "offsets": torch.tensor(
            np.stack([wrapped_offset(p, c) for p, c in zip(points, centres, strict=True)]),
            dtype=torch.float32,
        ),
        "targets": torch.tensor(np.stack(targets), dtype=torch.float32),
        "steps": torch.tensor(np.stack(steps), dtype=torch.float32),
    }


def losses(net: DemoNetwork, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    fg, bg, step, code = net.heads(net.text_features(batch["ids"]))
    alpha = net.coverage(batch["offsets"], code)[..., None]
    rgb = bg[:, None, :] + alpha * (fg - bg)[:, None, :]
    pixel = torch.mean((rgb - batch["targets"]) ** 2)
    motion = torch.mean(((step - batch["steps"]) / 0.01) ** 2)
    return pixel, motion


def train(
    *,
    seed: int = 0,
    steps: int = 3000,
    minutes: float | None = None,
    batch: int = 64,
    lr: float = 3e-3,
    threads: int = 1,
    preset: str = "demo",
    out: str | Path | None = None,
    progress: Callable[[int, int, float], None] | None = None,
) -> TrainReport:
    """Train from scratch and write the weights (safetensors) to `out` (default: the shipped file).

    Stops after `steps` steps, or after `minutes` of wall time if that comes first (then the run is
    no longer deterministic in its number of steps; the report says how many ran).
    """
    if steps < 1:
        raise ValueError("steps must be at least 1")
    cfg = DEMO_PRESETS[preset]
    torch.set_num_threads(threads)
    torch.manual_seed(seed)
    rng = np.random.default_rng(seed)
    net = DemoNetwork(cfg)
    optimizer = torch.optim.Adam(net.parameters(), lr=lr)
    schedule = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda i: 0.03 + 0.97 * 0.5 * (1 + math.cos(math.pi * min(i, steps) / steps))
    )
    pixel_size = 1.0 / cfg.width
    started = time.perf_counter()
    deadline = started + minutes * 60.0 if minutes is not None else None
    pixel = motion = torch.tensor(0.0)
    done = 0
    for done in range(1, steps + 1):
        data = make_batch(rng, batch, pixel_size)
        pixel, motion = losses(net, data)
        loss = pixel + 0.01 * motion
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        schedule.step()
        if progress is not None:
            progress(done, steps, float(loss.detach()))
        if deadline is not None and time.perf_counter() > deadline:
            break
    path = Path(out) if out is not None else WEIGHTS_DIR / cfg.weights
    path.parent.mkdir(parents=True, exist_ok=True)
    from safetensors.torch import save_file

    save_file({k: v.detach().contiguous() for k, v in net.state_dict().items()}, str(path))
    return TrainReport(
        seed=seed,
        steps=done,
        seconds=round(time.perf_counter() - started, 1),
        final_loss=float(pixel.detach() + 0.01 * motion.detach()),
        pixel_loss=float(pixel.detach()),
        motion_loss=float(motion.detach()),
        parameters=sum(p.numel() for p in net.parameters()),
        out=str(path),
    )
