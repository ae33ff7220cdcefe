"""Abandoning a job step when streams claim the device (issue 14, docs/jobs.md "Abandoning a step"):
a step stopped at any block boundary writes nothing, and a job whose steps were abandoned and run
again ends with the bytes of an uninterrupted run."""

from __future__ import annotations

import threading

import pytest
import torch

from workers.runtime.encoding import encode_mp4, encode_png
from workers.runtime.engine import ChunkEngine
from workers.runtime.models import build_model

PROMPT = "a red circle moving left on a blue background"
# (kind, width, height, frames) per model, and the block boundaries one of its steps checks.
CASES = {
    "demo": (("video", 40, 32, 5), 3),  # after the heads, after the render, after the noise
    "tiny": (("video", 32, 16, 4), 5),  # before each of its 4 blocks, after the noise
}
STEPS = 4


class SetAfter(threading.Event):
    """A flag that reads as set from its (checks + 1)-th look on: the step is abandoned at that
    block boundary, as if a stream's command had arrived while the blocks before it ran."""

    def __init__(self, checks: int) -> None:
        super().__init__()
        self.checks = checks
        self.looks = 0

    def is_set(self) -> bool:
        self.looks += 1
        return self.looks > self.checks


def add_job(engine: ChunkEngine, shape: tuple) -> None:
    kind, width, height, frames = shape
    engine.add_job(
        "j", kind=kind, prompt=PROMPT, seed=7, width=width, height=height, frames=frames, steps=STEPS
    )


def job_result(engine: ChunkEngine, kind: str) -> bytes:
    frames = engine.job_frames("j").numpy()
    return encode_png(frames[0]) if kind == "image" else encode_mp4(frames, engine.model.fps)


def abandon_every_step_then_redo(engine: ChunkEngine, boundaries: int) -> None:
    """Abandon each of job ``j``'s steps at one of its block boundaries in turn, checking nothing of
    the abandoned step was written, then run the step again to its end."""
    for step in range(STEPS):
        before = {name: t.clone() for name, t in engine.export_state("j")[1].items()}
        engine.thaw("j")
        flag = SetAfter(step % boundaries)
        report = engine.job_step(["j"], abandon=flag)
        # nothing of the abandoned step was written: same counter, same tensors
        assert report.abandoned and report.finished == [] and report.steps_done == {"j": step}
        assert flag.looks == step % boundaries + 1
        after = engine.export_state("j")[1]
        engine.thaw("j")
        assert all(torch.equal(before[name], after[name]) for name in before)
        # and the step run again (a flag never set: the step checks each boundary) advances it
        quiet = SetAfter(boundaries)
        report = engine.job_step(["j"], abandon=quiet)
        assert not report.abandoned and report.steps_done == {"j": step + 1}
        assert quiet.looks == boundaries


@pytest.mark.parametrize("preset", list(CASES))
def test_steps_abandoned_at_every_block_boundary_leave_the_job_as_it_was_and_the_result_identical(preset):
    torch.set_num_threads(1)
    model = build_model(preset, device="cpu")
    shape, boundaries = CASES[preset]
    straight, interrupted = ChunkEngine(model, encode_workers=1), ChunkEngine(model, encode_workers=1)
    try:
        add_job(straight, shape)
        add_job(interrupted, shape)
        while straight.job_progress("j")[0] < STEPS:
            straight.job_step(["j"])
        # Given a job whose every step is first abandoned at one of its block boundaries
        abandon_every_step_then_redo(interrupted, boundaries)
        # Then the result is bit-identical to the uninterrupted run's
        assert job_result(interrupted, shape[0]) == job_result(straight, shape[0])
    finally:
        straight.close()
        interrupted.close()
