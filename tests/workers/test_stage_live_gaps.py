"""Live stage workers (issue 15), the worker-side gaps: one-shot jobs on a ``DC`` worker daemon fed
by a real encoder process (``manage.py gpuworker --stages E``), bit-identical to an ``EDC`` worker's
and movable between the two; and a ``DC`` session whose encoder process dies mid prompt switch waits
(the reason in its heartbeat) and resumes, gap- and duplicate-free, on another encoder named by
``set_encoder``."""

from __future__ import annotations

import os
import queue
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import redis
import torch
from django.conf import settings

from contracts.wire.channel import send_command, stream_key
from gpu.models import GpuWorker
from tests.daemons import stepped_daemon
from tests.e2e.conftest import wait_for
from tests.factories import GpuWorkerFactory, SessionFactory
from tests.workers.test_stage_roles import answer_of, send, steps_until_all
from workers.daemon import WorkerDaemon
from workers.ports import Reporter
from workers.runtime.encoding import encode_mp4
from workers.runtime.engine import ChunkEngine
from workers.runtime.stages.staged_model import staged_engine_model
from workers.runtime.transport import MigrationListener

pytestmark = pytest.mark.django_db(transaction=True)

ROOT = Path(__file__).resolve().parents[2]
JOB = {"job_kind": "video", "model": "tiny", "prompt": "a red fox in snow", "width": 64, "height": 64}
JOB |= {"frames": 16, "steps": 10, "seed": 11, "priority": 0}
IMAGE = JOB | {"job_kind": "image", "frames": 1, "steps": 4, "prompt": "a lighthouse"}


class EncoderProcess:
    def __init__(self, row: GpuWorker, process: subprocess.Popen) -> None:
        self.row, self.process = row, process

    @property
    def spec(self) -> dict[str, str]:
        return {"worker": self.row.name, "address": self.row.migration_address}


@pytest.fixture
def encoders(tmp_path) -> Iterator[Any]:
    """Start ``gpuworker --stages E`` (or ``role``) processes, each registered ready in the test
    database."""
    started: list[tuple[subprocess.Popen, Any]] = []
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

    def start(count: int, role: str = "E") -> list[EncoderProcess]:
        pending = []
        for _ in range(count):
            name = f"{role.lower()}-{uuid.uuid4().hex[:8]}"
            argv = [sys.executable, "manage.py", "gpuworker", "--name", name, "--preset", "tiny"]
            argv += ["--device", "cpu", "--stages", role]
            log_path = tmp_path / f"{name}.log"
            log = log_path.open("w")
            process = subprocess.Popen(argv, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
            started.append((process, log))
            pending.append((name, process, log_path))
        out = []
        for name, process, log_path in pending:
            row = wait_for(
                lambda name=name, process=process, log_path=log_path: (
                    GpuWorker.objects.filter(name=name, status=GpuWorker.Status.READY).first()
                    or (process.poll() is not None and pytest.fail(log_path.read_text()))
                ),
                120,
                message=f"a {role} worker to register ready",
            )
            out.append(EncoderProcess(row, process))
        return out

    yield start
    for process, log in started:
        if process.poll() is None:
            process.send_signal(signal.SIGCONT)
            process.send_signal(signal.SIGTERM)
            try:
                process.wait(timeout=20)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
        log.close()


# --- one-shot jobs on a DC worker ------------------------------------------------------------------


class RecordingReporter(Reporter):
    """The daemon's reports on a queue (the control plane's job side is ``sessions.jobs``)."""

    def __init__(self) -> None:
        self.reports: queue.Queue = queue.Queue()
        self.seen: list[tuple[str, tuple, dict]] = []

    def answer(self, command: dict, status: str, reason: str = "", result: dict | None = None) -> None:
        self.reports.put(("answer", (command["id"], status, reason, result or {}), {}))

    def migration_sent(self, command: dict, report: dict) -> None:
        self.reports.put(("migration_sent", (command["id"],), report))

    def migration_failed(self, command: dict, error: str) -> None:
        self.reports.put(("migration_failed", (command["id"], error), {}))

    def job_progress(self, *args: Any, **kwargs: Any) -> None:
        self.reports.put(("job_progress", args, kwargs))

    def job_completed(self, *args: Any, **kwargs: Any) -> None:
        self.reports.put(("job_completed", args, kwargs))

    def job_failed(self, *args: Any, **kwargs: Any) -> None:
        self.reports.put(("job_failed", args, kwargs))


class JobWorker:
    def __init__(self, engine: ChunkEngine, client: redis.Redis) -> None:
        self.name = f"jobs-{uuid.uuid4().hex[:8]}"
        self.client = client
        self.reporter = RecordingReporter()
        self.listener = MigrationListener()
        self.daemon = WorkerDaemon(
            name=self.name,
            engine=engine,
            redis_client=client,
            reporter=self.reporter,
            capacity=2,
            migration_listener=self.listener,
            heartbeat_s=60.0,
        )
        self.daemon.start()

    def send(self, kind: str, **fields: Any) -> str:
        command_id = str(uuid.uuid4())
        send_command(self.client, self.name, {"id": command_id, "kind": kind, **fields})
        return command_id

    def find(self, predicate: Any) -> Any:
        while True:
            try:
                self.reporter.seen.append(self.reporter.reports.get_nowait())
            except queue.Empty:
                break
        return next((r for r in self.reporter.seen if predicate(r)), None)

    def close(self) -> None:
        self.daemon.shutdown()
        self.listener.close()
        self.client.delete(stream_key(self.name))


@contextmanager
def job_workers(*engines: ChunkEngine) -> Iterator[list[JobWorker]]:
    torch.set_num_threads(1)
    client = redis.Redis.from_url(settings.REDIS_URL)
    made = [JobWorker(engine, client) for engine in engines]
    try:
        yield made
    finally:
        for worker in made:
            worker.close()


def drive(workers: list[JobWorker], predicate: Any, timeout: float = 90) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for worker in workers:
            worker.daemon.step()
        value = predicate()
        if value:
            return value
    raise AssertionError(f"timed out; seen: {[(w.name, [r[0] for r in w.reporter.seen]) for w in workers]}")


def answer(workers: list[JobWorker], worker: JobWorker, command_id: str) -> tuple[str, str, dict]:
    report = drive(workers, lambda: worker.find(lambda r: r[0] == "answer" and r[1][0] == command_id))
    return report[1][1:]


def completed(worker: JobWorker, job: str) -> Any:
    return worker.find(lambda r: r[0] in ("job_completed", "job_failed") and r[1][0] == job)


def uninterrupted_mp4(spec: dict) -> bytes:
    engine = ChunkEngine.from_preset("tiny", encode_workers=1)
    try:
        fields = {k: spec[k] for k in ("prompt", "seed", "width", "height", "frames", "steps")}
        engine.add_job("reference", kind="video", **fields)
        while engine.job_progress("reference")[0] < spec["steps"]:
            engine.job_step(["reference"])
        return encode_mp4(engine.job_frames("reference").numpy(), engine.model.fps)
    finally:
        engine.close()


def test_a_dc_daemon_runs_one_shot_jobs_with_the_edc_bytes_and_moves_them(encoders):
    (encoder,) = encoders(1)
    deadline = time.time() + 600
    with job_workers(ChunkEngine(staged_engine_model("tiny", "DC")), ChunkEngine.from_preset("tiny")) as pair:
        dc, edc = pair
        # A DC worker refuses a job that names no encoder,
        bare = dc.send("job_run", job="bare", epoch=1, deadline=deadline, **IMAGE)
        status, reason, _ = answer(pair, dc, bare)
        assert status == "refused" and "encoder: required for role DC" in reason
        # and with one, its image is the EDC worker's PNG, byte for byte.
        runs = [
            (dc, dc.send("job_run", job="img-dc", epoch=1, deadline=deadline, encoder=encoder.spec, **IMAGE)),
            (edc, edc.send("job_run", job="img-edc", epoch=1, deadline=deadline, **IMAGE)),
        ]
        assert [answer(pair, w, c)[0] for w, c in runs] == ["acked", "acked"]
        done = drive(
            pair, lambda: (a := completed(dc, "img-dc")) and (b := completed(edc, "img-edc")) and (a, b)
        )
        assert done[0][0] == "job_completed" and done[1][0] == "job_completed", done
        assert done[0][2]["content"].startswith(b"\x89PNG")
        assert done[0][2]["content"] == done[1][2]["content"]

        # A video job on the DC worker: paused, resumed, paused again, then moved to the EDC worker,
        video = dc.send("job_run", job="v", epoch=1, deadline=deadline, encoder=encoder.spec, **JOB)
        assert answer(pair, dc, video)[0] == "acked"
        drive(pair, lambda: dc.find(lambda r: r[0] == "job_progress" and r[1][0] == "v" and r[2]["step"] > 0))
        status, _, paused = answer(pair, dc, dc.send("job_pause", job="v", epoch=1))
        assert status == "acked" and 0 < paused["step"] < JOB["steps"], paused
        assert answer(pair, dc, dc.send("job_resume", job="v", epoch=1))[0] == "acked"
        status, _, paused = answer(pair, dc, dc.send("job_pause", job="v", epoch=1))
        assert status == "acked" and paused["step"] < JOB["steps"], paused
        incoming = edc.send("migrate_in", job="v", epoch=2, source=dc.name)
        assert answer(pair, edc, incoming)[0] == "acked"
        outgoing = dc.send("migrate_out", job="v", epoch=1, new_epoch=2, target_address=edc.listener.address)
        status, reason, _ = answer(pair, dc, outgoing)
        assert status == "acked", reason
        drive(pair, lambda: "v" in edc.daemon.jobs.jobs)
        assert answer(pair, edc, edc.send("job_resume", job="v", epoch=2))[0] == "acked"
        # and one on the EDC worker moved to the DC worker; both finish with an uninterrupted MP4.
        other = JOB | {"prompt": "a crane over water", "seed": 5}
        run = edc.send("job_run", job="w", epoch=1, deadline=deadline, **other)
        assert answer(pair, edc, run)[0] == "acked"
        drive(
            pair, lambda: edc.find(lambda r: r[0] == "job_progress" and r[1][0] == "w" and r[2]["step"] > 0)
        )
        assert answer(pair, edc, edc.send("job_pause", job="w", epoch=1))[0] == "acked"
        assert answer(pair, dc, dc.send("migrate_in", job="w", epoch=2, source=edc.name))[0] == "acked"
        out = edc.send("migrate_out", job="w", epoch=1, new_epoch=2, target_address=dc.listener.address)
        assert answer(pair, edc, out)[0] == "acked"
        drive(pair, lambda: "w" in dc.daemon.jobs.jobs)
        assert answer(pair, dc, dc.send("job_resume", job="w", epoch=2))[0] == "acked"
        # A third, cancelled on the DC worker, never completes.
        run = dc.send("job_run", job="x", epoch=1, deadline=deadline, encoder=encoder.spec, **JOB)
        assert answer(pair, dc, run)[0] == "acked"
        assert answer(pair, dc, dc.send("job_cancel", job="x", epoch=1)) == ("acked", "", {})
        v, w = drive(pair, lambda: (a := completed(edc, "v")) and (b := completed(dc, "w")) and (a, b))
        assert (
            v[0] == "job_completed"
            and v[1][1:] == (2, edc.name)
            and v[2]["content"] == uninterrupted_mp4(JOB)
        )
        assert (
            w[0] == "job_completed"
            and w[1][1:] == (2, dc.name)
            and w[2]["content"] == uninterrupted_mp4(other)
        )
        assert completed(dc, "x") is None and "x" not in dc.daemon.engine.sessions()


# --- encoder failover ------------------------------------------------------------------------------


class ChunkLog:
    """Every chunk index an engine generates, in order, with its raw frames."""

    def __init__(self) -> None:
        self.indices: list[int] = []
        self.rgb: dict[int, torch.Tensor] = {}
        self.lock = threading.Lock()

    def __call__(self, result, encoded) -> None:
        with self.lock:
            self.indices.append(result.chunk_index)
            self.rgb[result.chunk_index] = result.rgb.clone()

    def count(self) -> int:
        with self.lock:
            return len(self.indices)


def test_a_dc_session_waits_for_a_lost_encoder_and_resumes_on_another_gap_free(encoders, tmp_path):
    first, second = encoders(2)
    dc_log, edc_log = ChunkLog(), ChunkLog()
    rows = [GpuWorkerFactory(name=f"{label}-{uuid.uuid4().hex[:6]}", model_preset="tiny") for label in "dm"]
    options = {"capacity": 2, "checkpoint_dir": tmp_path, "heartbeat_s": 0.2}
    with (
        stepped_daemon(
            rows[0],
            max_batch=2,
            engine=ChunkEngine(staged_engine_model("tiny", "DC"), on_chunk=dc_log),
            **options,
        ) as dc,
        stepped_daemon(
            rows[1], max_batch=2, engine=ChunkEngine.from_preset("tiny", on_chunk=edc_log), **options
        ) as edc,
    ):
        daemons = [dc, edc]
        session = SessionFactory(status="executing", worker=dc.worker, state_location="worker")
        twin = SessionFactory(status="executing", worker=edc.worker, state_location="worker")
        prompts = [[0, "a heron"]]
        starts = [
            send(dc.worker, "start", session=session, epoch=1, seed=3, prompts=prompts, encoder=first.spec),
            send(edc.worker, "start", session=twin, epoch=1, seed=3, prompts=prompts),
        ]
        assert all(answer_of(daemons, body).status == "acked" for body in starts)
        steps_until_all(daemons, lambda: dc_log.count() >= 2)
        # When the encoder stops answering, a prompt switch is asked of it, and then it dies,
        first.process.send_signal(signal.SIGSTOP)
        at = max(dc.engine.next_chunk(str(session.pk)), edc.engine.next_chunk(str(twin.pk))) + 1
        switches = [
            send(dc.worker, "prompt", session=session, from_chunk=at, text="a crane", encoder=first.spec),
            send(edc.worker, "prompt", session=twin, from_chunk=at, text="a crane"),
        ]
        assert [answer_of(daemons, body).result["from_chunk"] for body in switches] == [at, at]
        first.process.kill()
        first.process.wait()
        # then the DC session stops at the switch, and its heartbeat says it waits for an encoder
        telemetry = steps_until_all(
            daemons,
            lambda: (t := GpuWorker.objects.get(pk=dc.worker.pk).telemetry).get("encoder_wait") and t,
            timeout=60,
        )
        assert telemetry["encoder_wait"]["sessions"] == [str(session.pk)]
        assert first.row.name in telemetry["encoder_wait"]["reason"], telemetry
        assert dc.engine.next_chunk(str(session.pk)) == at and max(dc_log.indices) == at - 1
        # When set_encoder names another encoder, the stream resumes
        moved = send(dc.worker, "set_encoder", encoder=second.spec)
        row = answer_of(daemons, moved)
        assert row.status == "acked" and row.result["encoder"] == second.row.name, row.reason
        steps_until_all(daemons, lambda: dc_log.count() >= at + 3 and edc_log.count() >= at + 3)
        # gap-free, duplicate-free and bit-identical to the monolithic twin's, the switch included.
        assert dc_log.indices[: at + 3] == list(range(at + 3))
        for index in range(at + 3):
            assert torch.equal(dc_log.rgb[index], edc_log.rgb[index]), f"chunk {index} differs"
        assert not dc.stage.waiting
