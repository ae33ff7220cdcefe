"""A ``DC`` stage worker's job steps abandon exactly like an ``EDC`` worker's (issues 14 and 15):
the stage wrapper (`StagedStreamingModel`) hands the abandon flag to the model it wraps, so a step
stops at the same block boundaries, leaves the job at the step boundary before it, and the job ends
with the bytes of an uninterrupted monolithic run."""

from __future__ import annotations

import pytest
import torch

from tests.workers_runtime.test_job_abandon import (
    CASES,
    STEPS,
    SetAfter,
    abandon_every_step_then_redo,
    add_job,
    job_result,
)
from workers.runtime.engine import ChunkEngine
from workers.runtime.models import build_model
from workers.runtime.stages.host import StageHost
from workers.runtime.stages.staged_model import StagedStreamingModel, staged_engine_model
from workers.runtime.transport import MigrationListener


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
            add_job(mono, shape)
            add_job(dc, shape)
            # the EDC job runs its steps uninterrupted, each checking the flag at every boundary;
            while mono.job_progress("j")[0] < STEPS:
                quiet = SetAfter(boundaries)
                assert not mono.job_step(["j"], abandon=quiet).abandoned
                assert quiet.looks == boundaries
            # when every step of the DC job is first abandoned at one of those block boundaries
            # (nothing written), then run again checking as many boundaries as the EDC step did,
            abandon_every_step_then_redo(dc, boundaries)
            # Then the DC result is bit-identical to the uninterrupted EDC run's.
            assert job_result(dc, shape[0]) == job_result(mono, shape[0])
        finally:
            host.close()
            encoder.close()
            dc.close()
            mono.close()
