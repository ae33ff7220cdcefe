"""A real ``gpuworker`` with no control plane (no scheduler tick acknowledges its heartbeat, no
command after its session's start) checkpoints its session and exits non-zero after
``WORKER_ORPHAN_TIMEOUT_S`` (short here), naming why."""

from __future__ import annotations

import os
import uuid
from pathlib import Path

import pytest
import redis
from django.conf import settings

from contracts.wire.channel import stream_key
from gpu.models import GpuWorker
from scheduling.live.outbox import Outbox
from scheduling.models import WorkerCommand
from tests.e2e.conftest import wait_for
from tests.factories import SessionFactory
from workers.benchmarks.live import ProcessGroup
from workers.management.commands.gpuworker import ORPHANED_EXIT

ROOT = Path(settings.BASE_DIR)


@pytest.mark.django_db(transaction=True)
def test_a_worker_without_a_control_plane_checkpoints_and_exits_non_zero(tmp_path):
    db = settings.DATABASES["default"]
    env = {
        **os.environ,
        "DATABASE_URL": f"postgres://{db['USER']}@{db['HOST']}:{db['PORT']}/{db['NAME']}",
        "REDIS_URL": settings.REDIS_URL,
        "CELERY_BROKER_URL": settings.REDIS_URL,
        "WEIGHTS_DIR": str(tmp_path / "weights"),
        "CHECKPOINT_DIR": str(tmp_path / "checkpoints"),
        "HEARTBEAT_TIMEOUT_S": "1",
        "WORKER_ORPHAN_TIMEOUT_S": "10",
        "PYTHONUNBUFFERED": "1",
    }
    name = f"orphan-{uuid.uuid4().hex[:6]}"
    args = ("--device", "cpu", "--preset", "tiny", "--capacity", "1", "--weights-from", "disk")
    with ProcessGroup(tmp_path / "logs", env, ROOT, grace_s=15.0) as group:
        # Given a ready worker streaming one session
        process = group.spawn(name, "manage.py", "gpuworker", "--name", name, "--heartbeat", "0.5", *args)
        worker = wait_for(
            lambda: group.dead() is None and GpuWorker.objects.filter(name=name, status="ready").first(),
            timeout=90,
            message=f"a ready worker ({group.dead()})",
        )
        session = SessionFactory(status="executing", worker=worker, state_location="worker")
        outbox = Outbox()
        start = outbox.command(
            worker, "start", session=session, epoch=1, seed=3, prompts=[[0, "a fox"]], deliver_from=0
        )
        outbox.send()
        wait_for(
            lambda: WorkerCommand.objects.get(pk=start["id"]).status == "acked",
            timeout=10,
            message="the start acknowledged (within the orphan timeout)",
        )
        # When nothing acknowledges its heartbeat and no command comes for 10 s
        code = wait_for(lambda: process.poll(), timeout=60, message="the worker to exit")
        log = (tmp_path / "logs" / f"{name}.log").read_text(errors="replace")
    redis.Redis.from_url(settings.REDIS_URL).delete(stream_key(name))
    # Then it exited non-zero, saying why
    assert code == ORPHANED_EXIT, log[-3000:]
    assert "worker.orphaned" in log
    # with its session checkpointed and handed back (the database still answered)
    assert (tmp_path / "checkpoints" / f"{session.pk}.safetensors").exists(), log[-3000:]
    assert GpuWorker.objects.get(pk=worker.pk).status == GpuWorker.Status.RELEASED
