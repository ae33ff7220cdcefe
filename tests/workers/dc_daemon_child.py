"""A ``DC`` worker daemon in a child process, for tests (`DcWorker`). Kept apart from the test
modules that import Django models: the forkserver child imports this module before
``django.setup()``."""

from __future__ import annotations

import os
import uuid
from typing import Any

import redis
import torch
from django.conf import settings

from tests.workers.test_jobs_daemon import CONTEXT, QueueReporter, Worker
from workers.runtime.engine import ChunkEngine


def _dc_worker_main(name: str, redis_url: str, reports: Any) -> None:
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "controlplane.settings")
    import django

    django.setup()  # the chunk publisher's channel layer reads the settings
    # Imported in the child, after django.setup() (the daemon's publisher needs the settings).
    from workers.daemon import WorkerDaemon
    from workers.runtime.stages.staged_model import staged_engine_model
    from workers.runtime.transport import MigrationListener

    torch.set_num_threads(1)
    engine = ChunkEngine(staged_engine_model("tiny", "DC"), encode_workers=1)
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


class DcWorker(Worker):
    """`Worker` (a real daemon process on its command stream), its engine a ``DC`` one."""

    def __init__(self, client: redis.Redis) -> None:
        self.name = f"dc-jobs-{uuid.uuid4().hex[:8]}"
        self.client = client
        self.reports = CONTEXT.Queue()
        self.process = CONTEXT.Process(
            target=_dc_worker_main, args=(self.name, settings.REDIS_URL, self.reports), daemon=True
        )
        self.process.start()
        self.seen: list[tuple[str, tuple, dict]] = []
        (self.address,) = self.expect(lambda r: r[0] == "address")[1]
