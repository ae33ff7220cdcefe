"""One-shot jobs through the worker daemon (docs/jobs.md): two real worker processes, each a
`WorkerDaemon` over a tiny engine with its own migration listener, commanded through their real
Redis command streams; a paused video job moves from one to the other over Gloo and finishes there
with the MP4 of an uninterrupted run. And one daemon stepped on a fake clock: job steps only in the
slack the stream's next chunk leaves, chunks when it is spent.

The workers report through the ``Reporter`` seam into a queue the test reads: the control plane's
side (``sessions.jobs``, behind ``DjangoReporter``) is built on another branch (h14live).
"""

from __future__ import annotations

import multiprocessing as mp
import os
import queue
import time
import uuid
from typing import Any

import pytest
import redis
import torch
from django.conf import settings

from contracts.coserve import stream_slack_s
from contracts.wire.channel import send_command, stream_key
from workers.daemon import WorkerDaemon
from workers.ports import Reporter
from workers.runtime.encoding import encode_mp4
from workers.runtime.engine import ChunkEngine

TIMEOUT_S = 60.0
JOB = {"job_kind": "video", "model": "tiny", "prompt": "a red fox in snow", "width": 64, "height": 64}
JOB |= {"frames": 16, "steps": 120, "seed": 11, "priority": 0}
CONTEXT = mp.get_context("forkserver")
# Children fork from a server that has already imported torch and the daemon: seconds saved each.
CONTEXT.set_forkserver_preload(["torch", "workers.runtime.engine", "workers.runtime.transport"])


class QueueReporter(Reporter):
    """Every report of the child's daemon, as (method, args, kwargs) on a queue for the test."""

    def __init__(self, reports: Any) -> None:
        self.reports = reports

    def answer(self, command: dict, status: str, reason: str = "", result: dict | None = None) -> None:
        self.reports.put(("answer", (command["id"], status, reason, result or {}), {}))

    def job_progress(self, *args: Any, **kwargs: Any) -> None:
        self.reports.put(("job_progress", args, kwargs))

    def job_completed(self, *args: Any, **kwargs: Any) -> None:
        self.reports.put(("job_completed", args, kwargs))

    def job_failed(self, *args: Any, **kwargs: Any) -> None:
        self.reports.put(("job_failed", args, kwargs))


def _worker_main(name: str, redis_url: str, reports: Any) -> None:
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "controlplane.settings")
    import django

    django.setup()  # the chunk publisher's channel layer reads the settings
    from workers.daemon import WorkerDaemon
    from workers.runtime.transport import MigrationListener

    torch.set_num_threads(1)
    engine = ChunkEngine.from_preset("tiny", encode_workers=1)
    listener = MigrationListener(engine.device)
    daemon = WorkerDaemon(
        name=name,
        engine=engine,
        redis_client=redis.Redis.from_url(redis_url),
        reporter=QueueReporter(reports),
        capacity=2,
        migration_listener=listener,
        heartbeat_s=60.0,
    )
    reports.put(("address", (listener.address,), {}))
    daemon.run()


class Worker:
    def __init__(self, client: redis.Redis) -> None:
        self.name = f"jobs-{uuid.uuid4().hex[:8]}"
        self.client = client
        self.reports = CONTEXT.Queue()
        self.process = CONTEXT.Process(
            target=_worker_main, args=(self.name, settings.REDIS_URL, self.reports), daemon=True
        )
        self.process.start()
        self.seen: list[tuple[str, tuple, dict]] = []
        (self.address,) = self.expect(lambda r: r[0] == "address")[1]

    def send(self, kind: str, **fields: Any) -> str:
        command_id = str(uuid.uuid4())
        send_command(self.client, self.name, {"id": command_id, "kind": kind, **fields})
        return command_id

    def expect(self, predicate: Any) -> tuple[str, tuple, dict]:
        """The first report (seen before or arriving) that satisfies `predicate`."""
        for report in self.seen:
            if predicate(report):
                return report
        deadline = time.monotonic() + TIMEOUT_S
        while time.monotonic() < deadline:
            try:
                report = self.reports.get(timeout=1.0)
            except queue.Empty:
                assert self.process.is_alive(), f"worker {self.name} died"
                continue
            self.seen.append(report)
            if predicate(report):
                return report
        raise AssertionError(f"no such report from {self.name}; seen: {[r[0] for r in self.seen]}")

    def answer(self, command_id: str) -> tuple[str, str, dict]:
        _kind, (_id, status, reason, result), _ = self.expect(
            lambda r: r[0] == "answer" and r[1][0] == command_id
        )
        return status, reason, result

    def stop(self) -> None:
        self.send("shutdown")
        self.process.join(20)
        if self.process.is_alive():
            self.process.kill()
        self.client.delete(stream_key(self.name))


@pytest.fixture(scope="module")
def workers():
    client = redis.Redis.from_url(settings.REDIS_URL)
    pair = [Worker(client), Worker(client)]
    yield pair
    for worker in pair:
        worker.stop()


@pytest.fixture(scope="module")
def uninterrupted_mp4() -> bytes:
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


def test_a_paused_job_moves_to_another_worker_and_finishes_with_the_uninterrupted_mp4(
    workers, uninterrupted_mp4
):
    source, target = workers
    job = str(uuid.uuid4())
    # Given a video job running on the source, paused once it has made progress
    run = source.send("job_run", job=job, epoch=1, deadline=time.time() + 600, **JOB)
    assert source.answer(run) == ("acked", "", {"admitted": True})
    source.expect(lambda r: r[0] == "job_progress" and r[2]["step"] > 0)
    status, _, paused = source.answer(source.send("job_pause", job=job, epoch=1))
    steps_done = paused["step"]
    assert status == "acked" and 0 < steps_done < JOB["steps"], paused
    assert (
        source.expect(lambda r: r[0] == "job_progress" and r[2]["state"] == "paused")[2]["step"] == steps_done
    )

    # When the control plane moves it (migrate_in on the target, migrate_out with "job" on the source)
    incoming = target.send("migrate_in", job=job, epoch=2, source=source.name)
    assert target.answer(incoming)[0] == "acked"
    outgoing = source.send("migrate_out", job=job, epoch=1, new_epoch=2, target_address=target.address)
    status, reason, sent = source.answer(outgoing)
    assert status == "acked", reason
    assert sent["bytes"] > 0
    arrived = target.expect(lambda r: r[0] == "job_progress" and r[1][0] == job)
    assert arrived[1][1:] == (2, target.name)
    assert arrived[2] == {"state": "paused", "step": steps_done, "steps": JOB["steps"]}

    # Then the source no longer holds it, the target refuses the old epoch, and a resume at the new
    # epoch finishes it there with the bytes of an uninterrupted run
    assert source.answer(source.send("job_resume", job=job, epoch=2))[0] == "refused"
    status, reason, _ = target.answer(target.send("job_resume", job=job, epoch=1))
    assert status == "refused" and "stale epoch" in reason
    assert target.answer(target.send("job_resume", job=job, epoch=2))[0] == "acked"
    _, (job_id, epoch, worker), done = target.expect(lambda r: r[0] in ("job_completed", "job_failed"))
    assert (job_id, epoch, worker) == (job, 2, target.name) and "reason" not in done
    assert done["content_type"] == "video/mp4" and done["extension"] == "mp4" and done["run_s"] > 0
    assert done["content"] == uninterrupted_mp4


# Larger frames than JOB: a step of tens of milliseconds, so a command lands inside one.
ABANDONED_JOB = JOB | {"width": 128, "height": 128, "steps": 60, "seed": 12}


def test_a_session_start_abandons_the_job_step_in_flight_and_the_job_still_ends_with_the_uninterrupted_mp4(
    workers,
):
    _, worker = workers  # the other test of this module reads the first worker's next completion
    engine = ChunkEngine.from_preset("tiny", encode_workers=1)
    try:
        fields = {k: ABANDONED_JOB[k] for k in ("prompt", "seed", "width", "height", "frames", "steps")}
        engine.add_job("reference", kind="video", **fields)
        while engine.job_progress("reference")[0] < ABANDONED_JOB["steps"]:
            engine.job_step(["reference"])
        reference = encode_mp4(engine.job_frames("reference").numpy(), engine.model.fps)
    finally:
        engine.close()
    job = str(uuid.uuid4())
    # Given a video job stepping back to back on a worker with no stream
    run = worker.send("job_run", job=job, epoch=1, deadline=time.time() + 600, **ABANDONED_JOB)
    assert worker.answer(run)[0] == "acked"
    worker.expect(lambda r: r[0] == "job_progress" and r[1][0] == job and r[2]["step"] > 0)
    # When a session starts there (one read between two steps abandons nothing: stop it, try again)
    abandoned = None
    for attempt in range(10):
        session = str(uuid.uuid4())
        start = worker.send("start", session=session, epoch=1, seed=attempt, prompts=[[0, "a heron"]])
        status, reason, result = worker.answer(start)
        assert status == "acked", reason
        assert worker.answer(worker.send("stop", session=session, epoch=1))[0] == "acked"
        if "job_step_abandoned" in result:
            abandoned = result["job_step_abandoned"]
            break
    # Then a start stopped the job's step in flight, losing part of one step's work
    assert abandoned is not None and abandoned["jobs"] == [job] and abandoned["lost_ms"] > 0
    # And the job, which redid that step, ends with the bytes of an uninterrupted run
    _, _, done = worker.expect(lambda r: r[0] in ("job_completed", "job_failed") and r[1][0] == job)
    assert "reason" not in done and done["content"] == reference


def test_job_commands_with_bad_fields_or_unknown_jobs_are_refused_with_the_reason(workers):
    worker, _ = workers
    job = str(uuid.uuid4())
    status, reason, _ = worker.answer(
        worker.send("job_run", job=job, epoch=1, deadline=0.0, **(JOB | {"width": 60}))
    )
    assert status == "refused" and "width" in reason
    status, reason, _ = worker.answer(worker.send("job_run", job=job, epoch=1, **JOB))
    assert status == "refused" and "'deadline'" in reason
    status, reason, _ = worker.answer(worker.send("job_pause", job=job, epoch=1))
    assert status == "refused" and "not on worker" in reason
    # An image is admitted, runs to the end and comes back as a PNG; a repeat is idempotent
    image = JOB | {"job_kind": "image", "frames": 1, "steps": 3}
    run = worker.send("job_run", job=job, epoch=1, deadline=time.time() + 60, **image)
    assert worker.answer(run)[0] == "acked"
    _, _, done = worker.expect(lambda r: r[0] == "job_completed")
    assert done["content"].startswith(b"\x89PNG") and done["content_type"] == "image/png"
    assert worker.answer(worker.send("job_cancel", job=job, epoch=1)) == ("acked", "", {"already": True})


class FakeClock:
    def __init__(self, now: float) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def test_on_a_fake_clock_the_daemon_runs_job_steps_in_the_slack_the_stream_leaves_and_chunks_when_it_is_spent():
    # Given a daemon (not started: no publisher or heartbeat threads) on a fake clock, with one stream
    # (a 0.5 s chunk period, one chunk of look-ahead) and one image job
    torch.set_num_threads(1)
    client = redis.Redis.from_url(settings.REDIS_URL)
    clock, reports = FakeClock(100.0), queue.Queue()
    daemon = WorkerDaemon(
        name=f"jobs-{uuid.uuid4().hex[:8]}",
        engine=ChunkEngine.from_preset("tiny", encode_workers=1),
        redis_client=client,
        reporter=QueueReporter(reports),
        capacity=2,
        clock=clock,
    )
    try:
        image = JOB | {"job_kind": "image", "frames": 1, "steps": 8}
        send_command(client, daemon.name, {"id": "s", "kind": "start", "session": "s", "epoch": 1, "seed": 3,
                                           "prompts": [[0, "a heron"]]})  # fmt: skip
        send_command(client, daemon.name, {"id": "j", "kind": "job_run", "job": "j", "epoch": 1,
                                           "deadline": time.time() + 60, **image})  # fmt: skip

        def progress() -> tuple[int, int]:
            return daemon.engine.next_chunk("s"), daemon.engine.job_progress("j")[0]

        # When the daemon steps: chunk 0 goes first (in the turn that applies both commands: a new
        # stream has no slack), though the job waits
        answered: list[tuple] = []
        for _ in range(10):  # the first turn reads the (empty) backlog of unacknowledged commands
            if len(answered) == 2:
                break
            daemon.step()
            while not reports.empty():
                kind, args, _ = reports.get()
                answered += [args] if kind == "answer" else []
        assert sorted(answered) == [("j", "acked", "", {"admitted": True}), ("s", "acked", "", {
            "restored_from_chunk": None, "next_chunk": 0})]  # fmt: skip
        assert progress() == (1, 0)

        def chunks_take(seconds: float) -> None:  # what the fake clock charges a chunk
            daemon.streams.chunk_generation_s = daemon.streams.batch_generation_s[1] = seconds

        chunks_take(0.05)
        # Then chunk 1, due by the look-ahead but to be done only half a chunk before it plays
        # (100.25 s), leaves slack for a job step, which runs first
        (demand,) = daemon.streams.demands()
        assert demand.finish_by == pytest.approx(100.25)
        daemon.step()
        assert progress() == (1, 1)
        # With less slack than a measured step, chunk 1 runs; then the job again
        step_s = daemon.jobs.times.estimate(daemon.jobs.jobs["j"].ticket.shape, 1)
        clock.now = demand.finish_by - demand.generation_s - 0.5 * step_s
        daemon.step()
        assert progress() == (2, 1)
        chunks_take(0.05)
        daemon.step()
        assert progress() == (2, 2)
    finally:
        daemon.jobs.close()
        daemon.engine.close()
        client.delete(stream_key(daemon.name))


@pytest.mark.parametrize("guard", [True, False])
def test_on_a_fake_clock_a_starved_job_step_may_take_part_of_the_streams_reserve_only_with_the_guard(guard):
    # Given a daemon on a fake clock with one stream and one image job whose step is estimated
    # far longer than any slack the stream leaves (as a tiny video's was, scaled from an image's);
    # the guard on at once (0 chunk periods without progress) or off
    torch.set_num_threads(1)
    client = redis.Redis.from_url(settings.REDIS_URL)
    clock, reports = FakeClock(100.0), queue.Queue()
    daemon = WorkerDaemon(
        name=f"jobs-{uuid.uuid4().hex[:8]}",
        engine=ChunkEngine.from_preset("tiny", encode_workers=1),
        redis_client=client,
        reporter=QueueReporter(reports),
        capacity=2,
        clock=clock,
        starved_after_chunks=0.0 if guard else None,
    )
    try:
        image = JOB | {"job_kind": "image", "frames": 1, "steps": 8}
        send_command(client, daemon.name, {"id": "s", "kind": "start", "session": "s", "epoch": 1, "seed": 3,
                                           "prompts": [[0, "a heron"]]})  # fmt: skip
        send_command(client, daemon.name, {"id": "j", "kind": "job_run", "job": "j", "epoch": 1,
                                           "deadline": time.time() + 60, **image})  # fmt: skip
        for _ in range(10):
            if "j" in daemon.jobs.jobs and daemon.engine.next_chunk("s") == 1:
                break
            daemon.step()
        daemon.streams.chunk_generation_s = daemon.streams.batch_generation_s[1] = 0.05
        normal = stream_slack_s(daemon.streams.demands(), now=clock.now)
        guarded = stream_slack_s(daemon.streams.demands(0.25), now=clock.now)
        assert guarded == pytest.approx(normal + 0.125)
        shape = daemon.jobs.jobs["j"].ticket.shape
        daemon.jobs.times.record(shape, 1, 10 * guarded)
        # When the daemon steps
        daemon.step()
        # Then with the guard the job's step is probed, in the slack the smaller reserve leaves, and
        # completes (a fake clock: it takes no time), its measurement replacing the estimate;
        # without the guard chunk 1 runs instead
        progress = daemon.engine.next_chunk("s"), daemon.engine.job_progress("j")[0]
        assert progress == ((1, 1) if guard else (2, 0))
        assert daemon.guard_steps == (1 if guard else 0)
        assert (daemon.jobs.times.estimate(shape, 1) < guarded) == guard
    finally:
        daemon.jobs.close()
        daemon.engine.close()
        client.delete(stream_key(daemon.name))
