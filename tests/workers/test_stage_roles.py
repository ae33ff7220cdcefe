"""Live stage roles (issue 15): a real ``E`` worker process (``manage.py gpuworker --stages E``)
serving prompt encodings to a real ``DC`` worker daemon over a hand-off link, frames compared with a
monolithic daemon's bit for bit; ``set_role`` at run time; the ``--stages`` flag."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import uuid
from pathlib import Path

import pytest
import torch
from django.conf import settings
from django.core.management import CommandError, call_command

from gpu.models import GpuWorker
from scheduling.live.outbox import Outbox
from scheduling.models import WorkerCommand
from tests.daemons import stepped_daemon, steps_until
from tests.e2e.conftest import wait_for
from tests.factories import GpuWorkerFactory, SessionFactory
from workers.runtime.engine import ChunkEngine
from workers.runtime.stages.contract import stage_weight_bytes
from workers.runtime.stages.staged_model import staged_engine_model

pytestmark = pytest.mark.django_db(transaction=True)

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def encoder_worker(tmp_path):
    """``gpuworker --stages E`` in its own process, registered ready in the test database."""
    name = f"enc-{uuid.uuid4().hex[:8]}"
    db = settings.DATABASES["default"]
    env = {
        **os.environ,
        "DATABASE_URL": f"postgres://{db['USER']}@{db['HOST']}:{db['PORT']}/{db['NAME']}",
        "REDIS_URL": settings.REDIS_URL,
        "CELERY_BROKER_URL": settings.REDIS_URL,
        "WEIGHTS_DIR": str(tmp_path / "weights"),
        "CHECKPOINT_DIR": str(tmp_path / "checkpoints"),
        "HEARTBEAT_INTERVAL_S": "0.3",
        "PYTHONUNBUFFERED": "1",
    }
    argv = [sys.executable, "manage.py", "gpuworker", "--name", name, "--preset", "tiny"]
    argv += ["--device", "cpu", "--stages", "E"]
    log = (tmp_path / "encoder.log").open("w")
    process = subprocess.Popen(argv, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
    try:
        row = wait_for(
            lambda: (
                GpuWorker.objects.filter(name=name, status=GpuWorker.Status.READY).first()
                or (process.poll() is not None and pytest.fail((tmp_path / "encoder.log").read_text()))
            ),
            90,
            message="the encoder worker to register ready",
        )
        yield row
    finally:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(timeout=20)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
        log.close()


class Frames:
    """Every chunk an engine generates (its ``on_chunk`` hook): raw RGB and the encoded JPEGs."""

    def __init__(self) -> None:
        self.by_chunk: dict[int, tuple[torch.Tensor, list[bytes]]] = {}
        self.lock = threading.Lock()

    def __call__(self, result, encoded) -> None:
        with self.lock:
            self.by_chunk[result.chunk_index] = (result.rgb.clone(), encoded.frames)

    def count(self) -> int:
        with self.lock:
            return len(self.by_chunk)


def send(worker, kind, session=None, **payload):
    outbox = Outbox()
    body = outbox.command(worker, kind, session=session, **payload)
    outbox.send()
    return body


def answered(body):
    row = WorkerCommand.objects.get(pk=body["id"])
    return row if row.status != "sent" else None


def answer_of(daemons, body):
    return steps_until_all(daemons, lambda: answered(body))


def steps_until_all(daemons, predicate, timeout: float = 60):
    """Step several daemons in turn until ``predicate`` holds."""
    first, *others = daemons

    def step_others_then_check():
        for other in others:
            other.step()
        return predicate()

    return steps_until(first, step_others_then_check, timeout)


def test_a_dc_daemon_fed_by_an_encoder_process_streams_the_monolithic_frames(encoder_worker, tmp_path):
    # Given a real encoder process, a DC daemon (no encoder weights) and a monolithic daemon,
    encoder = {"worker": encoder_worker.name, "address": encoder_worker.migration_address}
    dc_frames, edc_frames = Frames(), Frames()
    dc_engine = ChunkEngine(staged_engine_model("tiny", "DC"), max_batch=2, on_chunk=dc_frames)
    weights = stage_weight_bytes("tiny")
    assert dc_engine.model.staged.loaded_weight_bytes() == weights["D"] + weights["C"]
    rows = [GpuWorkerFactory(name=f"{label}-{uuid.uuid4().hex[:6]}", model_preset="tiny") for label in "dm"]
    options = {"capacity": 2, "checkpoint_dir": tmp_path, "heartbeat_s": 0.2}
    with (
        stepped_daemon(rows[0], max_batch=2, engine=dc_engine, **options) as dc,
        stepped_daemon(
            rows[1], max_batch=2, engine=ChunkEngine.from_preset("tiny", on_chunk=edc_frames), **options
        ) as edc,
    ):
        daemons = [dc, edc]
        # a DC worker refuses a start that names no encoder,
        session = SessionFactory(status="executing", worker=dc.worker, state_location="worker")
        bare = send(dc.worker, "start", session=session, epoch=1, seed=7, prompts=[[0, "a heron"]])
        row = answer_of(daemons, bare)
        assert row.status == "refused" and "encoder: required for role DC" in row.reason
        # when both start the same stream (the DC one with the encoder), a prompt switch at chunk 2,
        twin = SessionFactory(status="executing", worker=edc.worker, state_location="worker")
        prompts = [[0, "a heron"], [2, "a heron at dusk"]]
        starts = [
            send(dc.worker, "start", session=session, epoch=1, seed=7, prompts=prompts, encoder=encoder),
            send(edc.worker, "start", session=twin, epoch=1, seed=7, prompts=prompts),
        ]
        assert all(answer_of(daemons, body).status == "acked" for body in starts)
        steps_until_all(daemons, lambda: dc_frames.count() >= 4 and edc_frames.count() >= 4)
        # then every chunk is bit-identical, raw and encoded,
        for index in range(4):
            dc_rgb, dc_jpegs = dc_frames.by_chunk[index]
            edc_rgb, edc_jpegs = edc_frames.by_chunk[index]
            assert torch.equal(dc_rgb, edc_rgb) and dc_jpegs == edc_jpegs, f"chunk {index} differs"
        # and the encoder worker reports its role and the load it served in its heartbeat.
        telemetry = wait_for(
            lambda: (
                (t := GpuWorker.objects.get(pk=encoder_worker.pk).telemetry).get("encoder", {}).get("served")
                and t
            ),
            10,
            message="the encoder's heartbeat",
        )
        assert telemetry["stage_role"] == "E" and telemetry["session_capacity"] == 0
        assert telemetry["encoder"]["served"] >= 2 and telemetry["encoder"]["clients"] == 1

        # Role changes at run time: E would drop the resident session's stages,
        refused = send(dc.worker, "set_role", role="E")
        row = answer_of(daemons, refused)
        assert row.status == "refused" and f"session {session.pk}" in row.reason and "drops" in row.reason
        # EDC loads the encoder here, and the stream goes on bit-identical to the monolithic one.
        to_edc = send(dc.worker, "set_role", role="EDC")
        row = answer_of(daemons, to_edc)
        assert row.status == "acked" and row.result["role"] == "EDC" and row.result["loaded"] == "E"
        assert dc.stage.role == "EDC" and dc.engine.model.net.text is not None
        at = max(dc.engine.next_chunk(str(session.pk)), edc.engine.next_chunk(str(twin.pk))) + 2
        later = [
            send(dc.worker, "prompt", session=session, from_chunk=at, text="a crane", encoder=encoder),
            send(edc.worker, "prompt", session=twin, from_chunk=at, text="a crane"),
        ]
        assert [answer_of(daemons, body).result["from_chunk"] for body in later] == [at, at]
        back = send(dc.worker, "set_role", role="DC")
        row = answer_of(daemons, back)
        assert row.status == "acked" and row.result["dropped"] == "E" and dc.engine.model.net.text is None
        steps_until_all(daemons, lambda: dc_frames.count() >= at + 2 and edc_frames.count() >= at + 2)
        for index in range(at + 2):
            assert torch.equal(dc_frames.by_chunk[index][0], edc_frames.by_chunk[index][0]), f"chunk {index}"


def test_gpuworker_names_the_stages_flag_for_a_bad_role():
    with pytest.raises(CommandError, match="--stages"):
        call_command("gpuworker", name="bad-role", preset="tiny", device="cpu", stages="EC")
    with pytest.raises(CommandError, match=r"--stages: .*pipeline order"):
        call_command("gpuworker", name="bad-role", preset="tiny", device="cpu", stages="CE")
