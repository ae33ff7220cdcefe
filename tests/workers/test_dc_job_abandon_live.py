"""A ``DC`` stage worker process abandons a job step for a stream exactly like an ``EDC`` worker
(issues 14 and 15): a worker process whose `WorkerDaemon` runs a ``DC`` engine, fed by a real encoder
process (``manage.py gpuworker --stages E``), both commanded through their real Redis streams; a
session's start stops the job's step in flight, and the job still ends with the MP4 of an
uninterrupted monolithic run."""

from __future__ import annotations

import time
import uuid

import pytest
import redis
import torch
from django.conf import settings

from tests.workers.dc_daemon_child import DcWorker
from tests.workers.test_jobs_daemon import ABANDONED_JOB
from tests.workers.test_stage_live_gaps import encoders  # noqa: F401 (the E worker processes)
from workers.runtime.encoding import encode_mp4
from workers.runtime.engine import ChunkEngine

pytestmark = pytest.mark.django_db(transaction=True)

JOB = ABANDONED_JOB | {"steps": 30}


def _uninterrupted_mp4() -> bytes:
    torch.set_num_threads(1)
    engine = ChunkEngine.from_preset("tiny", encode_workers=1)
    try:
        fields = {k: JOB[k] for k in ("prompt", "seed", "width", "height", "frames", "steps")}
        engine.add_job("reference", kind="video", **fields)
        while engine.job_progress("reference")[0] < JOB["steps"]:
            engine.job_step(["reference"])
        return encode_mp4(engine.job_frames("reference").numpy(), engine.model.fps)
    finally:
        engine.close()


def test_a_session_start_abandons_a_dc_workers_job_step_and_the_job_ends_with_the_edc_mp4(encoders):  # noqa: F811
    (encoder,) = encoders(1)
    reference = _uninterrupted_mp4()
    worker = DcWorker(redis.Redis.from_url(settings.REDIS_URL))
    try:
        job = str(uuid.uuid4())
        # Given a video job stepping back to back on a DC worker with no stream
        run = worker.send(
            "job_run", job=job, epoch=1, deadline=time.time() + 600, encoder=encoder.spec, **JOB
        )
        status, reason, _ = worker.answer(run)
        assert status == "acked", reason
        worker.expect(lambda r: r[0] == "job_progress" and r[1][0] == job and r[2]["step"] > 0)
        # When a session starts there (one read between two steps abandons nothing: stop it, try again)
        abandoned = None
        for attempt in range(10):
            session = str(uuid.uuid4())
            start = worker.send(
                "start",
                session=session,
                epoch=1,
                seed=attempt,
                prompts=[[0, "a heron"]],
                encoder=encoder.spec,
            )
            status, reason, result = worker.answer(start)
            assert status == "acked", reason
            assert worker.answer(worker.send("stop", session=session, epoch=1))[0] == "acked"
            if "job_step_abandoned" in result:
                abandoned = result["job_step_abandoned"]
                break
        # Then a start stopped the job's step in flight, losing part of one step's work
        assert abandoned is not None and abandoned["jobs"] == [job] and abandoned["lost_ms"] > 0
        # And the job, which redid that step, ends with the bytes of an uninterrupted EDC run
        _, _, done = worker.expect(lambda r: r[0] in ("job_completed", "job_failed") and r[1][0] == job)
        assert "reason" not in done and done["content"] == reference
    finally:
        worker.stop()
