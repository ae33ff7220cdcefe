"""Issue 31, the audit hole: a session restarted from its checkpoint after its worker was killed
while its publisher lagged must have every generated index recorded, contiguously, and
``chunks_generated`` equal to the records' count.

Real services: two stepped worker daemons (tiny engine, real Redis command and record streams, the
real reporter), the control plane's own liveness and scheduler functions, the real ingester. The
first worker's publisher is stalled (as it is while frames encode, viewers resubscribe after an
outage, or Redis is down) and the worker is then dropped without a shutdown, as SIGKILL drops it.
"""

from __future__ import annotations

import queue
import uuid

import pytest
import redis
import torch
from django.utils import timezone

from contracts.wire.channel import stream_key
from gpu import services as gpu_services
from scheduling.live.liveness import sessions_recover
from scheduling.live.outbox import Outbox
from scheduling.live.run import scheduler_run
from scheduling.models import WorkerCommand
from sessions.ingest import chunk_records_drain
from sessions.models import ChunkRecord, GenerationSession, SessionEvent
from tests.daemons import stepped_daemon, steps_until
from tests.factories import GpuWorkerFactory, SessionFactory
from workers.adapters.reporting import DjangoReporter
from workers.daemon import WorkerDaemon
from workers.runtime.engine import ChunkEngine

pytestmark = pytest.mark.django_db(transaction=True)


def recorded(session) -> list[int]:
    return list(
        ChunkRecord.objects.filter(session=session)
        .order_by("chunk_index")
        .values_list("chunk_index", flat=True)
    )


def drained(client: redis.Redis, session, at_least: int) -> bool:
    chunk_records_drain(client=client)
    return len(recorded(session)) >= at_least


def answered(command_id) -> bool:
    return WorkerCommand.objects.get(pk=command_id).status != "sent"


def test_a_restart_from_a_checkpoint_after_a_killed_worker_leaves_no_hole_in_the_audit(tmp_path, settings):
    # The control plane looks for checkpoints where the workers write them.
    settings.STREAMSERVE = {**settings.STREAMSERVE, "CHECKPOINT_DIR": str(tmp_path)}
    client = redis.Redis.from_url(settings.REDIS_URL)
    options = {"capacity": 2, "checkpoint_dir": tmp_path, "checkpoint_every": 2, "heartbeat_s": 0.2}
    tag = uuid.uuid4().hex[:6]
    old = GpuWorkerFactory(
        name=f"old-{tag}", model_preset="tiny", gpu_type="cpu", last_heartbeat=timezone.now()
    )
    torch.set_num_threads(1)
    first = WorkerDaemon(
        name=old.name,
        engine=ChunkEngine.from_preset("tiny", max_batch=2),
        redis_client=client,
        reporter=DjangoReporter(old.pk, old.name),
        **options,
    )
    first.start()
    stalled: queue.Queue = first.publisher.items
    try:
        # Given a session streaming on the first worker, its first chunks recorded
        session = SessionFactory(status="executing", worker=old, state_location="worker", epoch=1)
        outbox = Outbox()
        start = outbox.command(
            old, "start", session=session, epoch=1, seed=3, prompts=[[0, "a fox"]], deliver_from=0
        )
        outbox.send()
        steps_until(first, lambda: answered(start["id"]))
        steps_until(first, lambda: drained(client, session, 3))
        # When its publisher stalls (the thread waits on the queue it holds; new chunks queue
        # behind) while the hot loop generates on, checkpointing every 2 chunks
        first.publisher.items = queue.Queue()
        sid = str(session.pk)
        generated_before = first.engine.next_chunk(sid)
        steps_until(first, lambda: first.engine.next_chunk(sid) >= generated_before + 6)
    finally:
        # and the worker is killed (no shutdown: nothing more is published or checkpointed)
        first.stopping.set()
        stalled.put(None)
        first.reporter.close()
        first.engine.close()
    # and the control plane declares it lost and restarts the session on a new worker
    gpu_services.worker_fail(worker=old)
    sessions_recover(worker=old)
    GenerationSession.objects.filter(pk=session.pk).update(activity="active", last_active_at=timezone.now())
    new = GpuWorkerFactory(
        name=f"new-{tag}", model_preset="tiny", gpu_type="cpu", last_heartbeat=timezone.now()
    )
    with stepped_daemon(new, max_batch=2, **options) as second:
        scheduler_run(trigger="worker")
        restart = SessionEvent.objects.get(session=session, kind=SessionEvent.Kind.RESTART)
        assert restart.detail["worker"] == new.name and restart.detail["checkpoint"]
        start = WorkerCommand.objects.get(worker=new, kind="start")
        steps_until(second, lambda: answered(start.pk))
        assert WorkerCommand.objects.get(pk=start.pk).status == "acked", start.result
        steps_until(second, lambda: second.engine.next_chunk(sid) >= generated_before + 12)
        steps_until(second, lambda: drained(client, session, generated_before + 10))
    chunk_records_drain(client=client)
    client.delete(stream_key(old.name))
    # Then every index is recorded once, with no hole, and the counter counts exactly the records
    indices = recorded(session)
    assert indices == list(range(len(indices))), f"hole: {sorted(set(range(indices[-1] + 1)) - set(indices))}"
    session.refresh_from_db()
    assert session.chunks_generated == len(indices)
