"""Live stage workers (issue 15), the split one-shot roles: ``D`` and ``ED`` worker daemons run
one-shot jobs whose final decode happens on a real decoder process (``manage.py gpuworker --stages
C``), with the prompt encoded by a real encoder process for ``D``; the PNG and MP4 are the bytes an
``EDC`` worker makes. Sessions are refused there (a stream keeps decode next to diffuse), and a
``C`` worker runs neither sessions nor jobs."""

from __future__ import annotations

import time

import pytest

from gpu.models import GpuWorker
from tests.e2e.conftest import wait_for
from tests.workers.test_stage_live_gaps import (  # noqa: F401 (encoders: the fixture)
    IMAGE,
    JOB,
    answer,
    completed,
    drive,
    encoders,
    job_workers,
    uninterrupted_mp4,
)
from workers.runtime.engine import ChunkEngine
from workers.runtime.stages.staged_model import staged_engine_model

pytestmark = pytest.mark.django_db(transaction=True)


def test_d_and_ed_daemons_decode_jobs_on_a_c_worker_with_the_edc_bytes(encoders):  # noqa: F811
    (encoder,) = encoders(1)
    (decoder,) = encoders(1, role="C")
    deadline = time.time() + 600
    engines = [ChunkEngine(staged_engine_model("tiny", role)) for role in ("D", "ED", "C")]
    with job_workers(*engines, ChunkEngine.from_preset("tiny")) as workers:
        d, ed, c, edc = workers
        # Sessions are refused on the one-shot roles with the reason, and a C worker runs no jobs.
        start = {"session": "s1", "prompt": "a fox", "seed": 1, "epoch": 1}
        status, reason, _ = answer(workers, d, d.send("start", encoder=encoder.spec, **start))
        assert status == "refused" and "decode next to diffuse" in reason, reason
        status, reason, _ = answer(
            workers, c, c.send("job_run", job="c", epoch=1, deadline=deadline, **IMAGE)
        )
        assert status == "refused" and "diffusion workers" in reason, reason
        # A D worker refuses a job that names no decoder,
        bare = d.send("job_run", job="bare", epoch=1, deadline=deadline, encoder=encoder.spec, **IMAGE)
        status, reason, _ = answer(workers, d, bare)
        assert status == "refused" and "decoder: required for role D" in reason, reason
        # and with an encoder and a decoder its image is the EDC worker's PNG, byte for byte;
        runs = [
            (
                d,
                d.send(
                    "job_run",
                    job="img-d",
                    epoch=1,
                    deadline=deadline,
                    encoder=encoder.spec,
                    decoder=decoder.spec,
                    **IMAGE,
                ),
            ),
            (edc, edc.send("job_run", job="img-edc", epoch=1, deadline=deadline, **IMAGE)),
            # an ED worker encodes its own prompt and decodes its video on the C worker.
            (ed, ed.send("job_run", job="v-ed", epoch=1, deadline=deadline, decoder=decoder.spec, **JOB)),
        ]
        assert [answer(workers, w, cid)[0] for w, cid in runs] == ["acked"] * 3
        image_d, image_edc, video = drive(
            workers,
            lambda: (
                (a := completed(d, "img-d"))
                and (b := completed(edc, "img-edc"))
                and (v := completed(ed, "v-ed"))
                and (a, b, v)
            ),
        )
        assert image_d[0] == "job_completed" and image_edc[0] == "job_completed", (image_d, image_edc)
        assert image_d[2]["content"].startswith(b"\x89PNG")
        assert image_d[2]["content"] == image_edc[2]["content"]
        assert video[0] == "job_completed" and video[2]["content"] == uninterrupted_mp4(JOB)
        # The C process reports its role and its decoder's load in its heartbeat.
        row = wait_for(
            lambda: (
                (w := GpuWorker.objects.get(pk=decoder.row.pk)).telemetry.get("decoder", {}).get("served", 0)
                >= 2
                and w
            ),
            30,
            message="the decoder's heartbeat to count its two decodes",
        )
        assert row.stage_role == "C" and row.telemetry["decoder"]["clients"] == 2
        assert row.telemetry["session_capacity"] == 0
