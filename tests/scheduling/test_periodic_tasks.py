"""The beat schedule: declared once in settings, installed as django-celery-beat rows, each periodic
task registered with its app and routed to the scheduler's workers; the split of the old audit
maintenance row by a migration that keeps the operator's period."""

from __future__ import annotations

from datetime import timedelta
from importlib import import_module

import pytest
from django.conf import settings
from django.db import connection
from django.db.migrations.executor import MigrationExecutor
from django.utils import timezone
from django_celery_beat.models import IntervalSchedule, PeriodicTask

from controlplane.celery import app
from gpu import tasks as gpu_tasks
from gpu.models import CostLedgerEntry, GpuWorker
from scheduling.services import beat_schedule_install
from sessions import tasks as session_tasks
from sessions.models import ChunkLatencyRollup, ChunkRecord
from tests.factories import ChunkRecordFactory, GpuWorkerFactory

BEFORE_SPLIT = ("scheduling", "0005_event_vocabulary")
SPLIT = ("scheduling", "0006_periodic_tasks_by_app")
RETIRED_TASK = "scheduling.tasks.audit_maintenance"
SPLIT_INTO = import_module("scheduling.migrations.0006_periodic_tasks_by_app").SPLIT_INTO


def _every(seconds: int) -> IntervalSchedule:
    interval, _ = IntervalSchedule.objects.get_or_create(every=seconds, period=IntervalSchedule.SECONDS)
    return interval


def _rows() -> dict[str, tuple[str, int, bool]]:
    return {
        row.name: (row.task, row.interval.every, row.enabled)
        for row in PeriodicTask.objects.select_related("interval")
    }


def _declared() -> dict[str, tuple[str, int, bool]]:
    return {name: (entry["task"], entry["every_s"], True) for name, entry in settings.PERIODIC_TASKS.items()}


def test_every_declared_task_is_registered_and_runs_on_the_scheduler_queue():
    app.loader.import_default_modules()  # the worker's autodiscovery of each app's tasks module
    for entry in settings.PERIODIC_TASKS.values():
        assert entry["task"] in app.tasks
        assert app.amqp.router.route({}, entry["task"])["queue"].name == "scheduler"
    assert RETIRED_TASK not in app.tasks


@pytest.mark.django_db
def test_install_seeds_the_declared_rows_and_keeps_an_operators_period():
    # Given: no rows (a database flushed by an earlier test), then the operator slows the ledger down
    PeriodicTask.objects.all().delete()
    beat_schedule_install()
    assert _rows() == _declared()
    PeriodicTask.objects.filter(name="cost ledger").update(interval=_every(300))

    # When: the platform starts again
    beat_schedule_install()

    # Then: the operator's period stands, and nothing was duplicated
    rows = _rows()
    assert rows["cost ledger"][1] == 300
    assert PeriodicTask.objects.count() == len(settings.PERIODIC_TASKS)


@pytest.mark.django_db
def test_install_with_a_fast_tick_sets_only_the_tick_period():
    PeriodicTask.objects.all().delete()
    beat_schedule_install()
    beat_schedule_install(tick_s=1)
    expected = {
        name: (task, 1 if task == "scheduling.tasks.scheduler_tick" else every, enabled)
        for name, (task, every, enabled) in _declared().items()
    }
    assert _rows() == expected


@pytest.mark.django_db(transaction=True)
def test_the_split_migration_replaces_audit_maintenance_and_keeps_its_schedule():
    # Given: a database migrated before the split, whose operator set the maintenance to 120 s, off
    executor = MigrationExecutor(connection)
    latest = executor.loader.graph.leaf_nodes("scheduling")
    executor.migrate([BEFORE_SPLIT])
    PeriodicTask.objects.all().delete()
    PeriodicTask.objects.create(
        name="scheduler tick", task="scheduling.tasks.scheduler_tick", interval=_every(2)
    )
    PeriodicTask.objects.create(
        name="audit maintenance", task=RETIRED_TASK, interval=_every(120), enabled=False
    )

    # When: it migrates
    executor = MigrationExecutor(connection)
    executor.migrate([SPLIT])

    # Then: one row per declared task; the split ones carry the operator's schedule
    expected = _declared()
    for name, (task, _every_s, _enabled) in expected.items():
        if task in SPLIT_INTO:
            expected[name] = (task, 120, False)
    assert _rows() == expected

    # And back: the retired row returns with that schedule, the split rows go (tasks declared since,
    # such as the chunk-record ingester, are not the split's to remove)
    executor = MigrationExecutor(connection)
    executor.migrate([BEFORE_SPLIT])
    later = {n: row for n, row in expected.items() if row[0] not in SPLIT_INTO and n != "scheduler tick"}
    assert _rows() == {
        "scheduler tick": ("scheduling.tasks.scheduler_tick", 2, True),
        "audit maintenance": (RETIRED_TASK, 120, False),
        **later,
    }
    executor = MigrationExecutor(connection)
    executor.migrate(latest)


@pytest.mark.django_db(transaction=True)
def test_the_viewer_rule_migration_seeds_its_row_on_a_database_seeded_before_it():
    # Given: a database whose periodic tasks were seeded before the viewer rule existed
    executor = MigrationExecutor(connection)
    latest = executor.loader.graph.leaf_nodes("streams")
    executor.migrate([("streams", "0006_job_deleted_at")])
    assert not PeriodicTask.objects.filter(name="session viewers").exists()

    # When: it migrates
    executor = MigrationExecutor(connection)
    executor.migrate(latest)

    # Then: the row is the declared one
    assert _rows()["session viewers"] == _declared()["session viewers"]


@pytest.mark.django_db(transaction=True)  # the tasks close stale connections, as on a Celery worker
def test_each_app_maintains_its_own_audit_data():
    # Given: a released worker billed for closed minutes, and chunk records past retention
    worker = GpuWorkerFactory(
        status=GpuWorker.Status.RELEASED,
        requested_at=timezone.now() - timedelta(minutes=10),
        released_at=timezone.now() - timedelta(minutes=5),
    )
    old = timezone.now() - timedelta(days=settings.STREAMSERVE["CHUNK_RETENTION_DAYS"] + 1)
    ChunkRecordFactory.create_batch(3, worker=worker, created_at=old)

    # When: beat runs each app's task
    ledger_rows = gpu_tasks.ledger_accrue()
    rollups = session_tasks.chunk_rollup()
    pruned = session_tasks.chunk_records_prune()

    # Then: the ledger, the rollups and the retention are each done by their app
    assert ledger_rows == CostLedgerEntry.objects.filter(worker=worker).count() > 0
    assert rollups == ChunkLatencyRollup.objects.count() == 1
    assert pruned == 3 and not ChunkRecord.objects.exists()
