"""The whole closed loop with real processes: ASGI server, Celery worker + beat, ≥ 2 CPU workers.

Order matters inside this module (one platform, started once): the tests build on each other's
cluster state the way an operator's day would (first session, pause/resume, a second worker,
a forced migration, scale-out, a worker killed, scale-in).
"""

from __future__ import annotations

import asyncio
import io
import json
import os
import signal
import time

import httpx
import pytest
import redis
import websockets
from django.conf import settings
from PIL import Image
from rest_framework.authtoken.models import Token

from contracts.wire.frames import decode_chunk_frame
from contracts.wire.records import STREAM as RECORD_STREAM
from gpu.models import GpuWorker
from scheduling.models import Migration, ScalingAction
from sessions.models import ChunkRecord, GenerationSession, SessionEvent
from tests.e2e.conftest import wait_for
from tests.factories import StaffFactory, UserFactory

# Each test reads through its own (rolled back) transaction; at READ COMMITTED it still sees every
# row the platform's processes commit. Module fixtures commit their data outside it.
pytestmark = [pytest.mark.e2e, pytest.mark.slow, pytest.mark.django_db]


@pytest.fixture(scope="module")
def accounts(platform, django_db_blocker):
    with django_db_blocker.unblock():
        user, other, staff = UserFactory(), UserFactory(), StaffFactory()
        return {
            "user": Token.objects.create(user=user).key,
            "other": Token.objects.create(user=other).key,
            "staff": Token.objects.create(user=staff).key,
        }


def api(platform, token):
    return httpx.Client(base_url=platform.url, headers={"Authorization": f"Token {token}"}, timeout=30)


def create_session(platform, token, prompt="a lighthouse in a storm", seed=11) -> str:
    with api(platform, token) as client:
        response = client.post("/api/sessions/", json={"prompt": prompt, "model": "tiny", "seed": seed})
        assert response.status_code == 201, response.text
        return response.json()["id"]


class Stream:
    """A WebSocket client that records chunks and status messages."""

    def __init__(self, platform, session_id: str, token: str) -> None:
        self.url = f"{platform.ws_url}/ws/sessions/{session_id}/?token={token}&codec=jpeg"  # frames as images
        self.chunks: list[tuple[dict, list[bytes]]] = []
        self.texts: list[dict] = []

    async def collect(self, *, chunks: int, timeout: float, send: list[dict] | None = None, until=None):
        async with websockets.connect(self.url, max_size=None) as ws:
            for message in send or []:
                await ws.send(json.dumps(message))
            deadline = time.monotonic() + timeout
            got = 0
            while got < chunks and time.monotonic() < deadline:
                if until is not None and until(self):
                    break
                try:
                    message = await asyncio.wait_for(ws.recv(), timeout=max(0.1, deadline - time.monotonic()))
                except TimeoutError:
                    break
                if isinstance(message, bytes):
                    self.chunks.append(decode_chunk_frame(message))
                    got += 1
                else:
                    self.texts.append(json.loads(message))
        return self

    def indices(self) -> list[int]:
        return [h["index"] for h, _ in self.chunks]


def collect(platform, session_id, token, **kwargs) -> Stream:
    return asyncio.run(Stream(platform, session_id, token).collect(**kwargs))


def records_ingested() -> bool:
    """The chunk-record stream is drained: every record published so far is in PostgreSQL."""
    return redis.Redis.from_url(settings.REDIS_URL).xlen(RECORD_STREAM) == 0


def session_row(session_id) -> GenerationSession:
    return GenerationSession.objects.select_related("worker").get(pk=session_id)


def test_a_client_receives_consecutive_chunks(platform, accounts, live_db):
    session_id = create_session(platform, accounts["user"])
    stream = collect(platform, session_id, accounts["user"], chunks=6, timeout=90)
    indices = stream.indices()
    assert len(indices) == 6, platform.logs()
    assert indices == list(range(indices[0], indices[0] + 6))
    header, frames = stream.chunks[0]
    assert header["worker"].startswith("local-cpu")
    assert header["generation_ms"] > 0 and header["delivery_ms"] >= 0
    assert len(frames) == 4
    image = Image.open(io.BytesIO(frames[0]))
    assert image.format == "JPEG" and image.size == (64, 64)
    assert stream.texts[0]["type"] == "status"
    wait_for(
        lambda: ChunkRecord.objects.filter(session_id=session_id).count() >= 6, 10, message="chunk records"
    )


def test_idle_session_is_suspended_and_resumes_at_the_next_index(platform, accounts, live_db):
    from scheduling.models import WorkerCommand

    session_id = GenerationSession.objects.order_by("created_at").first().pk
    # The pause goes out on connect: the socket is read until the session says it is suspended (the
    # chunks already under way arrive before that), not for a chunk count the pause may never reach.
    before = collect(
        platform, session_id, accounts["user"], chunks=2, timeout=30, send=[{"type": "pause"}],
        until=lambda s: any(t.get("status") == "suspended" for t in s.texts),
    )  # fmt: skip
    wait_for(
        lambda: WorkerCommand.objects.filter(session_id=session_id, kind="suspend", status="acked").exists(),
        60,
        message="the worker to suspend the session",
    )
    row = session_row(session_id)
    assert row.status == "suspended" and row.state_location == "host" and row.host_worker_id is not None
    # The worker stopped at a chunk boundary; once its records are ingested, nothing more comes.
    wait_for(records_ingested, 15, message="the record stream to be drained")
    paused_index = session_row(session_id).delivered_index
    assert paused_index >= max(before.indices(), default=-1)
    time.sleep(1.5)
    assert session_row(session_id).delivered_index == paused_index
    after = collect(platform, session_id, accounts["user"], chunks=3, timeout=60, send=[{"type": "resume"}])
    assert after.indices() == list(range(paused_index + 1, paused_index + 4))
    assert any(t.get("status") == "executing" for t in after.texts)


def test_other_users_cannot_open_the_stream(platform, accounts, live_db):
    session_id = GenerationSession.objects.order_by("created_at").first().pk

    async def attempt(token):
        async with websockets.connect(f"{platform.ws_url}/ws/sessions/{session_id}/?token={token}") as ws:
            error = json.loads(await ws.recv())
            with pytest.raises(websockets.ConnectionClosed) as closed:
                await ws.recv()
            return error, closed.value.rcvd.code

    error, code = asyncio.run(attempt(accounts["other"]))
    assert (code, error["code"]) == (4404, "not_found")
    error, code = asyncio.run(attempt("not-a-token"))
    assert (code, error["code"]) == (4401, "not_authenticated")


def test_forced_migration_keeps_indices_contiguous_and_content_identical(platform, accounts, live_db):
    with api(platform, accounts["staff"]) as staff:
        assert staff.patch("/api/scheduler/config/", json={"min_gpus": 2}).status_code == 200
    wait_for(lambda: GpuWorker.objects.filter(status="ready").count() >= 2, 120, message="a second worker")
    # Pause the first session so the migrating one runs alone (same batch composition as the replay).
    first = GenerationSession.objects.order_by("created_at").first()
    with api(platform, accounts["user"]) as client:
        client.post(f"/api/sessions/{first.pk}/pause/")
    session_id = create_session(platform, accounts["user"], prompt="a glacier at dawn", seed=2024)
    wait_for(lambda: session_row(session_id).status == "executing", 60, message="placement")
    source = session_row(session_id).worker.name
    target = GpuWorker.objects.filter(status="ready").exclude(name=source).first().name

    async def watch_and_migrate():
        stream = Stream(platform, session_id, accounts["user"])

        def migrate_after_three(s: Stream) -> bool:
            if len(s.chunks) == 3 and not getattr(s, "asked", False):
                s.asked = True
                with api(platform, accounts["staff"]) as staff:
                    response = staff.post(f"/api/sessions/{session_id}/migrate/", json={"target": target})
                    assert response.status_code == 202, response.text
            return False

        return await stream.collect(chunks=10, timeout=90, until=migrate_after_three)

    stream = asyncio.run(watch_and_migrate())
    indices = stream.indices()
    assert indices == list(range(indices[0], indices[0] + len(indices))) and len(indices) == 10
    workers = [h["worker"] for h, _ in stream.chunks]
    assert workers[0] == source and workers[-1] == target, workers
    migration = Migration.objects.get(session_id=session_id)
    assert migration.outcome == "succeeded" and migration.state_bytes > 0
    # Replay without migration: same seed and prompt, from chunk 0, alone on one worker.
    replay_id = create_session(platform, accounts["user"], prompt="a glacier at dawn", seed=2024)
    replay = collect(platform, replay_id, accounts["user"], chunks=indices[-1] + 1, timeout=120)
    replayed = {h["index"]: frames for h, frames in replay.chunks}
    for header, frames in stream.chunks:
        if header["index"] in replayed:
            assert frames == replayed[header["index"]], f"chunk {header['index']} differs after migration"
    assert len(set(replayed) & set(indices)) >= 5
    with api(platform, accounts["user"]) as client:
        client.post(f"/api/sessions/{replay_id}/terminate/")


def test_scale_out_adds_a_worker_and_sessions_spread_onto_it(platform, accounts, live_db):
    with api(platform, accounts["staff"]) as staff:
        assert staff.patch("/api/scheduler/config/", json={"max_gpus": 4}).status_code == 200
    actions_before = ScalingAction.objects.filter(direction="out").count()
    before = set(
        GpuWorker.objects.filter(status__in=["provisioning", "ready"]).values_list("name", flat=True)
    )
    sessions = [
        create_session(platform, accounts["user"], prompt=f"crowd {i}", seed=100 + i) for i in range(3)
    ]
    wait_for(
        lambda: ScalingAction.objects.filter(direction="out").count() > actions_before,
        60,
        message="a scale-out decision",
    )
    wait_for(
        lambda: set(GpuWorker.objects.filter(status="ready").values_list("name", flat=True)) - before,
        120,
        message="the new worker to be ready",
    )
    new = set(GpuWorker.objects.filter(status="ready").values_list("name", flat=True)) - before
    wait_for(
        lambda: GenerationSession.objects.filter(worker__name__in=new, status="executing").exists(),
        60,
        message="a session placed on the new worker",
    )
    for sid in sessions:
        wait_for(
            lambda sid=sid: session_row(sid).status == "executing", 60, message="every session executing"
        )


def test_killed_worker_sessions_continue_elsewhere_without_duplicate_indices(platform, accounts, live_db):
    victim_session = GenerationSession.objects.filter(status="executing").order_by("created_at").last()
    sid = str(victim_session.pk)
    worker = session_row(sid).worker
    pid = int(worker.external_id.split("@")[0])

    def kill_after_third_chunk(stream: Stream) -> bool:
        # Checked right after each chunk arrives: the worker dies within a millisecond of the third.
        if len(stream.chunks) == 3:
            os.kill(pid, signal.SIGKILL)
            return True
        return False

    before = collect(platform, sid, accounts["user"], chunks=4, timeout=30, until=kill_after_third_chunk)
    assert len(before.chunks) == 3 and before.chunks[-1][0]["worker"] == worker.name
    wait_for(lambda: GpuWorker.objects.get(pk=worker.pk).status == "failed", 30, message="failure detection")
    after = collect(platform, sid, accounts["user"], chunks=3, timeout=90)
    assert after.indices(), platform.logs()
    assert after.indices()[0] > max(before.indices())
    assert all(h["worker"] != worker.name for h, _ in after.chunks)
    assert SessionEvent.objects.filter(session_id=sid, kind="restart").exists()

    # No audit loss (issue 17, defect 8): every chunk the client received has a record, the last one
    # from the killed worker included; indices have no hole; the counters agree with the records.
    received = set(before.indices()) | set(after.indices())

    def recorded() -> list[int]:
        return list(ChunkRecord.objects.filter(session_id=sid).values_list("chunk_index", flat=True))

    wait_for(lambda: received <= set(recorded()), 15, message="a record for every received chunk")
    indices = recorded()
    assert len(indices) == len(set(indices))
    assert sorted(indices) == list(range(min(indices), max(indices) + 1))
    with api(platform, accounts["user"]) as client:
        client.post(f"/api/sessions/{sid}/terminate/")

    def counters_agree() -> bool:
        row, last = session_row(sid), max(recorded())
        return (row.chunks_generated, row.delivered_index) == (last + 1, last)

    wait_for(counters_agree, 15, message="the counters to match the highest recorded index")


def test_scale_in_hands_parked_state_over_then_drains_and_releases(platform, accounts, live_db):
    from scheduling.models import WorkerCommand

    # A suspended session parked in one worker's host memory…
    parked_id = create_session(platform, accounts["user"], prompt="a parked harbour", seed=77)
    before = collect(platform, parked_id, accounts["user"], chunks=2, timeout=60)
    with api(platform, accounts["user"]) as client:
        client.post(f"/api/sessions/{parked_id}/pause/")
    wait_for(
        lambda: WorkerCommand.objects.filter(session_id=parked_id, kind="suspend", status="acked").exists(),
        60,
        message="the session to be parked",
    )
    host = session_row(parked_id).host_worker
    # …survives its worker being drained and released: the state is handed to another host first.
    with api(platform, accounts["staff"]) as staff:
        assert staff.patch("/api/scheduler/config/", json={"min_gpus": 1}).status_code == 200
        assert staff.post(f"/api/workers/{host.pk}/drain/").status_code == 200
    with api(platform, accounts["user"]) as client:
        for session in GenerationSession.objects.exclude(status="terminated").exclude(pk=parked_id):
            client.post(f"/api/sessions/{session.pk}/terminate/")
    wait_for(
        lambda: Migration.objects.filter(
            session_id=parked_id, reason="handoff", outcome="succeeded"
        ).exists(),
        90,
        message="the parked state to be handed over",
    )
    wait_for(
        lambda: GpuWorker.objects.get(pk=host.pk).status == "released",
        90,
        message="the drained worker's release",
    )
    wait_for(
        lambda: ScalingAction.objects.filter(direction="in", outcome="succeeded").exists(),
        90,
        message="scale-in",
    )
    assert session_row(parked_id).host_worker_id not in (None, host.pk)
    paused_index = session_row(parked_id).delivered_index
    after = collect(platform, parked_id, accounts["user"], chunks=2, timeout=60, send=[{"type": "resume"}])
    assert after.indices() == [paused_index + 1, paused_index + 2]
    assert paused_index >= max(before.indices())
    with api(platform, accounts["user"]) as client:
        client.post(f"/api/sessions/{parked_id}/terminate/")
    wait_for(
        lambda: GpuWorker.objects.filter(status__in=["ready", "draining"]).count() == 1,
        120,
        message="the pool to shrink to the minimum",
    )
