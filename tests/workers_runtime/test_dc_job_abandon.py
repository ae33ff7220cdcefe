"""A ``DC`` stage worker's job steps abandon exactly like an ``EDC`` worker's (issues 14 and 15):
the stage wrapper (`StagedStreamingModel`) hands the abandon flag to the model it wraps, so a step
stops at the same block boundaries, leaves the job at the step boundary before it, and the job ends
with the bytes of an uninterrupted monolithic run."""

from __future__ import annotations

import pytest
import torch

from tests.workers_runtime.test_job_abandon import CASES, PROMPT, STEPS, SetAfter
from workers.runtime.encoding import encode_mp4, encode_png
from workers.runtime.engine import ChunkEngine
from workers.runtime.models import build_model
from workers.runtime.stages.serving import StagedStreamingModel, StageHost, staged_engine_model
from workers.runtime.transport import MigrationListener


def _add(engine: ChunkEngine, shape: tuple) -> None:
    kind, width, height, frames = shape
    engine.add_job(
        "j", kind=kind, prompt=PROMPT, seed=7, width=width, height=height, frames=frames, steps=STEPS
    )


def _result(engine: ChunkEngine, kind: str) -> bytes:
    frames = engine.job_frames("j").numpy()
    return encode_png(frames[0]) if kind == "image" else encode_mp4(frames, engine.model.fps)


@pytest.mark.parametrize("preset", list(CASES))
def test_a_dc_workers_job_steps_abandon_at_the_edc_block_boundaries_with_the_edc_bytes(preset):
    torch.set_num_threads(1)
    shape, boundaries = CASES[preset]
    with MigrationListener() as listener:
        # Given an encoder service, a DC engine fed by it and a monolithic (EDC) engine,
        encoder = StageHost(ChunkEngine(staged_engine_model(preset, "E")), store_address=listener.address)
        encoder.start()
        dc = ChunkEngine(staged_engine_model(preset, "DC"), encode_workers=1)
        host = StageHost(dc)
        host.use_encoder({"worker": "e", "address": listener.address})
        mono = ChunkEngine(build_model(preset, device="cpu"), encode_workers=1)
        try:
            assert isinstance(dc.model, StagedStreamingModel)
            _add(mono, shape)
            _add(dc, shape)
            # the EDC job runs its steps uninterrupted, each checking the flag at every boundary;
            while mono.job_progress("j")[0] < STEPS:
                quiet = SetAfter(boundaries)
                assert not mono.job_step(["j"], abandon=quiet).abandoned
                assert quiet.looks == boundaries
            # when every step of the DC job is first abandoned at one of those block boundaries,
            for step in range(STEPS):
                before = {name: t.clone() for name, t in dc.export_state("j")[1].items()}
                dc.thaw("j")
                flag = SetAfter(step % boundaries)
                report = dc.job_step(["j"], abandon=flag)
                # then nothing of the abandoned step was written (same counter, same tensors),
                assert report.abandoned and report.finished == [] and report.steps_done == {"j": step}
                assert flag.looks == step % boundaries + 1
                after = dc.export_state("j")[1]
                dc.thaw("j")
                assert all(torch.equal(before[name], after[name]) for name in before)
                # and run again the step checks as many boundaries as the EDC step did.
                quiet = SetAfter(boundaries)
                report = dc.job_step(["j"], abandon=quiet)
                assert not report.abandoned and report.steps_done == {"j": step + 1}
                assert quiet.looks == boundaries
            # Then the DC result is bit-identical to the uninterrupted EDC run's.
            assert _result(dc, shape[0]) == _result(mono, shape[0])
        finally:
            host.close()
            encoder.close()
            dc.close()
            mono.close()
