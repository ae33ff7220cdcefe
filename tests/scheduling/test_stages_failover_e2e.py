"""End to end (docs/stages.md, "Encoders"): a real DC worker daemon fed by a real encoder process
(``gpuworker --stages E``) loses it mid prompt switch; its heartbeat says so, the real scheduler run
names the other encoder process in a ``set_encoder``, and the stream goes on gap- and duplicate-free."""

from __future__ import annotations

import signal
import uuid

import pytest

from gpu.models import GpuWorker
from scheduling.live.run import scheduler_run
from scheduling.models import WorkerCommand
from tests.daemons import stepped_daemon
from tests.factories import GpuWorkerFactory, SessionFactory
from tests.workers.test_stage_live_gaps import ChunkLog, encoders  # noqa: F401 (the fixture)
from tests.workers.test_stage_roles import answer_of, send, steps_until_all
from workers.runtime.engine import ChunkEngine
from workers.runtime.stages.staged_model import staged_engine_model

pytestmark = pytest.mark.django_db(transaction=True)


def test_the_scheduler_gives_a_dc_worker_another_encoder_when_its_own_dies(encoders, tmp_path):  # noqa: F811
    first, second = encoders(2)
    log = ChunkLog()
    row = GpuWorkerFactory(name=f"dc-{uuid.uuid4().hex[:6]}", model_preset="tiny", stage_role="DC")
    engine = ChunkEngine(staged_engine_model("tiny", "DC"), on_chunk=log)
    with stepped_daemon(
        row, max_batch=2, engine=engine, capacity=2, checkpoint_dir=tmp_path, heartbeat_s=0.2
    ) as dc:
        daemons = [dc]
        session = SessionFactory(status="executing", worker=dc.worker, state_location="worker", epoch=1)
        start = send(
            dc.worker, "start", session=session, epoch=1, seed=3, prompts=[[0, "a heron"]], encoder=first.spec
        )
        assert answer_of(daemons, start).status == "acked"
        steps_until_all(daemons, lambda: log.count() >= 2)
        # given a prompt switch asked of the encoder, which then dies
        first.process.send_signal(signal.SIGSTOP)
        at = dc.engine.next_chunk(str(session.pk)) + 1
        switch = send(
            dc.worker, "prompt", session=session, epoch=1, from_chunk=at, text="a crane", encoder=first.spec
        )
        assert answer_of(daemons, switch).status == "acked"
        first.process.kill()
        first.process.wait()
        steps_until_all(
            daemons,
            lambda: (
                "lost"
                in str(GpuWorker.objects.get(pk=row.pk).telemetry.get("encoder_wait", {}).get("reason"))
            ),
            timeout=60,
        )
        # when the scheduler runs
        scheduler_run(trigger="tick")
        # then the DC worker is told to use the other encoder, acknowledges, and the stream goes on
        command = WorkerCommand.objects.get(worker=row, kind="set_encoder")
        assert command.payload["encoder"] == second.spec and command.payload["lost"] == first.row.name
        assert answer_of(daemons, {"id": str(command.pk)}).status == "acked"
        steps_until_all(daemons, lambda: log.count() >= at + 3)
        assert log.indices[: at + 3] == list(range(at + 3))
