"""Each part of the live loop, called directly against the real database and Redis."""

from __future__ import annotations

import json
import threading
import time
from datetime import timedelta
from pathlib import Path

import pytest
import redis
from django.conf import settings
from django.db import connection, transaction
from django.utils import timezone

from contracts.wire.channel import stream_key
from gpu.models import GpuWorker
from scheduling.live.answers import command_answered, migration_completed, migration_failed
from scheduling.live.liveness import sessions_recover, workers_check
from scheduling.live.operator import MigrationRefused, migration_request
from scheduling.live.outbox import Outbox
from scheduling.live.run import scheduler_run
from scheduling.live.scaling import release, scale_in, scale_out
from scheduling.models import Migration, SchedulerDecision, WorkerCommand
from scheduling.receivers import session_event_received
from sessions import lifecycle
from sessions.models import GenerationSession, SessionEvent
from tests.factories import GpuWorkerFactory, SessionFactory

pytestmark = pytest.mark.django_db(transaction=False)

Status = GenerationSession.Status


@pytest.fixture
def client():
    client = redis.Redis.from_url(settings.REDIS_URL)
    yield client


def worker(**kwargs) -> GpuWorker:
    kwargs.setdefault("gpu_type", "cpu")
    kwargs.setdefault("last_heartbeat", timezone.now())
    return GpuWorkerFactory(**kwargs)


def commands(worker: GpuWorker, kind: str | None = None):
    rows = WorkerCommand.objects.filter(worker=worker)
    return rows.filter(kind=kind) if kind else rows


def test_a_run_places_an_active_session_and_sends_its_start_after_commit(
    client, django_capture_on_commit_callbacks
):
    ready = worker()
    client.delete(stream_key(ready.name))
    session = SessionFactory(activity="active", last_active_at=timezone.now())
    with django_capture_on_commit_callbacks(execute=False) as callbacks:
        decisions = scheduler_run(trigger="active", session_id=str(session.pk))
    session.refresh_from_db()
    assert (session.status, session.worker_id, session.epoch) == (Status.EXECUTING, ready.pk, 1)
    decision = SchedulerDecision.objects.get(pk=decisions[0])
    assert decision.trigger == "active" and decision.placements_changed == 1
    start = commands(ready, "start").get()
    assert start.decision_id == decision.pk and start.payload["epoch"] == 1
    assert session.events.filter(kind=SessionEvent.Kind.PLACE).exists()
    # Nothing reached the worker's stream inside the transaction; the outbox sends it after commit.
    assert client.xlen(stream_key(ready.name)) == 0
    outbox_send = callbacks[-1]
    outbox_send()
    sent = [json.loads(fields[b"json"]) for _, fields in client.xrange(stream_key(ready.name))]
    assert [c["kind"] for c in sent] == ["start"] and sent[0]["id"] == str(start.pk)


def test_a_tick_that_changes_nothing_is_not_recorded():
    worker()
    assert scheduler_run(trigger="tick") == []
    assert not SchedulerDecision.objects.exists()


def test_a_refused_start_puts_the_session_back_in_the_queue():
    ready = worker()
    session = SessionFactory(activity="active", last_active_at=timezone.now())
    scheduler_run(trigger="active", session_id=str(session.pk))
    start = commands(ready, "start").get()
    # An answer for an older epoch changes nothing but its command row.
    command_answered(command={**start.payload, "epoch": 0}, status="failed", reason="old", result={})
    assert GenerationSession.objects.get(pk=session.pk).status == Status.EXECUTING
    start.status = WorkerCommand.Status.SENT
    start.save()
    command_answered(command=start.payload, status="failed", reason="out of memory", result={})
    session.refresh_from_db()
    assert (session.status, session.worker_id, session.state_location) == (Status.QUEUED, None, "none")
    assert session.events.filter(kind=SessionEvent.Kind.REQUEUE).get().detail["reason"] == "out of memory"
    assert WorkerCommand.objects.get(pk=start.pk).status == "failed"


def _migrating(source: GpuWorker, target: GpuWorker):
    session = SessionFactory()
    lifecycle.session_place(session=session, worker=source)
    migration = migration_request(session_id=str(session.pk), target_name=target.name)
    return GenerationSession.objects.get(pk=session.pk), migration


def test_an_operator_migration_then_the_flip_and_activation():
    source, target = worker(), worker()
    session, migration = _migrating(source, target)
    assert session.status == Status.MIGRATING
    out = commands(source, "migrate_out").get().payload
    assert commands(target, "migrate_in").get().payload["migration"] == migration.pk
    migration_completed(command=out, report={"bytes": 1234})
    session.refresh_from_db()
    migration.refresh_from_db()
    assert (session.status, session.worker_id, session.epoch) == (Status.EXECUTING, target.pk, 2)
    assert (migration.outcome, migration.state_bytes) == ("succeeded", 1234)
    assert commands(target, "activate").get().payload["epoch"] == 2


def test_a_flip_after_the_session_changed_is_aborted_and_the_copy_freed():
    source, target = worker(), worker()
    session, migration = _migrating(source, target)
    out = commands(source, "migrate_out").get().payload
    lifecycle.session_end(session=session, reason="user")
    migration_completed(command=out, report={})
    migration.refresh_from_db()
    assert migration.outcome == "aborted"
    assert commands(target, "stop").get().payload["epoch"] == 2
    assert not commands(target, "activate").exists()


def test_a_failed_migration_leaves_the_session_on_its_source():
    source, target = worker(), worker()
    session, migration = _migrating(source, target)
    migration_failed(command={"migration": migration.pk, "session": str(session.pk)}, error="peer reset")
    session.refresh_from_db()
    assert (session.status, session.worker_id, session.epoch) == (Status.EXECUTING, source.pk, 1)
    assert Migration.objects.get(pk=migration.pk).outcome == "failed"
    assert commands(target, "stop").exists()
    # A second report of the same failure changes nothing.
    migration_failed(command={"migration": migration.pk, "session": str(session.pk)}, error="again")
    assert session.events.filter(kind=SessionEvent.Kind.MIGRATE_FAILED).count() == 1


@pytest.mark.parametrize("side", ["migrate_out", "migrate_in"])
def test_a_migration_command_refused_by_either_worker_fails_the_migration_at_once(side):
    # Given a migration under way
    source, target = worker(), worker()
    session, migration = _migrating(source, target)
    refused = commands(source if side == "migrate_out" else target, side).get()
    # When the worker refuses its command (e.g. it no longer holds the session at that epoch)
    command_answered(command=refused.payload, status="refused", reason="stale epoch 1 < 2", result={})
    # Then the migration fails now, not at the deadline, and the session runs on at its source
    migration.refresh_from_db()
    session.refresh_from_db()
    assert (migration.outcome, migration.error) == ("failed", f"{side} refused: stale epoch 1 < 2")
    assert (session.status, session.worker_id) == (Status.EXECUTING, source.pk)
    assert WorkerCommand.objects.get(pk=refused.pk).status == "refused"
    # A target that refused installed nothing for this migration: a copy it holds is not freed
    assert commands(target, "stop").exists() == (side == "migrate_out")


def test_a_silent_worker_that_still_beats_in_redis_is_not_lost():
    # Given a worker whose heartbeat row is stale (PostgreSQL was down) but that beats in Redis
    from contracts.wire.channel import heartbeat_beat

    quiet_row = worker(last_heartbeat=timezone.now() - timedelta(minutes=5))
    heartbeat_beat(redis.Redis.from_url(settings.REDIS_URL), quiet_row.name, ttl_s=30)
    # Then it is alive: lost means silent on both channels
    assert workers_check() == []
    assert GpuWorker.objects.get(pk=quiet_row.pk).status == GpuWorker.Status.READY


def test_operator_requests_that_cannot_happen_are_refused():
    source = worker()
    session = SessionFactory()
    with pytest.raises(MigrationRefused, match="only executing"):
        migration_request(session_id=str(session.pk), target_name=source.name)
    lifecycle.session_place(session=session, worker=source)
    with pytest.raises(MigrationRefused, match="already runs"):
        migration_request(session_id=str(session.pk), target_name=source.name)
    with pytest.raises(MigrationRefused, match="not a ready worker"):
        migration_request(session_id=str(session.pk), target_name="nobody")


def test_a_silent_worker_is_declared_lost_and_its_sessions_recovered(tmp_path, settings):
    settings.STREAMSERVE = {**settings.STREAMSERVE, "CHECKPOINT_DIR": str(tmp_path)}
    silent = worker(last_heartbeat=timezone.now() - timedelta(minutes=5))
    alive = worker()
    running, parked = SessionFactory(activity="active"), SessionFactory(activity="idle")
    lifecycle.session_place(session=running, worker=silent)
    lifecycle.session_place(session=parked, worker=silent)
    lifecycle.session_suspend(session=parked)
    Path(tmp_path, f"{running.pk}.safetensors").write_bytes(b"checkpoint")
    # Judged at the instant of the live worker's last heartbeat: a slow machine cannot make it look silent.
    assert workers_check(now=alive.last_heartbeat) == [silent.name]
    running.refresh_from_db()
    parked.refresh_from_db()
    assert GpuWorker.objects.get(pk=silent.pk).status == GpuWorker.Status.FAILED
    assert GpuWorker.objects.get(pk=alive.pk).status == GpuWorker.Status.READY
    assert (running.status, running.state_location, running.worker_id) == (Status.QUEUED, "checkpoint", None)
    assert (parked.status, parked.state_location, parked.host_worker_id) == (Status.SUSPENDED, "none", None)
    assert sessions_recover(worker=silent) == 0  # nothing left on it


def test_overdue_commands_time_out_and_overdue_migrations_fail():
    source, target = worker(), worker()
    session, migration = _migrating(source, target)
    long_ago = timezone.now() - timedelta(hours=1)
    WorkerCommand.objects.update(created_at=long_ago)
    Migration.objects.update(started_at=long_ago)
    workers_check()
    assert set(commands(source).values_list("status", flat=True)) == {"timed_out"}
    assert Migration.objects.get(pk=migration.pk).outcome == "failed"
    assert GenerationSession.objects.get(pk=session.pk).status == Status.EXECUTING


def _decision() -> SchedulerDecision:
    return SchedulerDecision.objects.create(
        trigger="tick",
        decided_at=timezone.now(),
        policy="turboserve",
        active_sessions=0,
        budget=1,
        target_budget=2,
        duration_ms=0.0,
        rho_max=0.9,
        rho_hat=0.7,
    )


def test_scale_out_asks_the_provisioner_after_the_decision_and_scale_in_releases(settings):
    settings.STREAMSERVE = {
        **settings.STREAMSERVE,
        "PROVISIONER": "static",
        "STATIC_WORKERS": "cpu-9@localhost:cpu",
    }
    outbox = Outbox()
    action = scale_out(decision=_decision(), preset="tiny", gpu_type="cpu", count=1, budget=1, outbox=outbox)
    assert not GpuWorker.objects.filter(name="cpu-9").exists()  # nothing asked inside the decision
    (provision_call,) = outbox.after
    provision_call()
    action.refresh_from_db()
    provisioned = GpuWorker.objects.get(name="cpu-9")
    assert action.outcome == "requested" and list(action.workers.all()) == [provisioned]
    assert provisioned.status == GpuWorker.Status.PROVISIONING

    idle = worker(provider="static")
    outbox = Outbox()
    action = scale_in(decision=_decision(), worker=idle, budget=2, outbox=outbox)
    assert GpuWorker.objects.get(pk=idle.pk).status == GpuWorker.Status.DRAINING
    assert (action.direction, action.from_budget, action.to_budget) == ("in", 2, 1)
    release(worker_id=idle.pk, action_id=action.pk)  # what the worker_release task runs
    action.refresh_from_db()
    assert commands(idle, "shutdown").exists()
    assert action.outcome == "succeeded", action.provisioner_result


def test_a_prompt_event_is_forwarded_to_the_holder_and_wakes_the_scheduler(client):
    holder = worker()
    session = SessionFactory()
    lifecycle.session_place(session=session, worker=holder)
    prompt = session.prompts.create(text="a heron at dawn", from_chunk=3)
    queue = "scheduler"  # CELERY_TASK_ROUTES sends every scheduling task there
    broker = redis.Redis.from_url(settings.CELERY_BROKER_URL)
    before = broker.llen(queue)
    session_event_received(
        session_id=str(session.pk), kind="prompt", detail={"prompt_id": prompt.pk, "from_chunk": 3}
    )
    forwarded = commands(holder, "prompt").get().payload
    assert (forwarded["text"], forwarded["from_chunk"], forwarded["epoch"]) == ("a heron at dawn", 3, 1)
    assert broker.llen(queue) == before + 1
    message = json.loads(broker.lrange(queue, 0, 0)[0])
    assert message["headers"]["task"] == "scheduling.tasks.scheduler_event"
    broker.lpop(queue)  # leave the broker as it was: no worker consumes this queue in unit tests
    # A lifecycle transition is the scheduler's own doing: it wakes nothing.
    session_event_received(session_id=str(session.pk), kind="suspend", detail={})
    assert broker.llen(queue) == before


def _wait_until_blocked_on_a_lock(timeout_s: float = 10.0) -> None:
    """Until some other backend of this database waits on a row lock (the run behind our update)."""
    with connection.cursor() as cursor:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            # pg_locks, not pg_stat_activity: the latter is snapshotted once per transaction.
            cursor.execute("SELECT count(*) FROM pg_locks WHERE NOT granted")
            if cursor.fetchone()[0]:
                return
            time.sleep(0.02)
    raise AssertionError("the scheduler run never waited on the session's row lock")


@pytest.mark.django_db(transaction=True)
def test_a_flip_committed_while_a_run_waits_on_the_session_lock_does_not_crash_the_run(client):
    # Issue 17 defect 7: the run locks the pool's sessions FOR NO KEY UPDATE OF the session only.
    # When a migration flips a session (worker: source → target) while the run waits on that row,
    # PostgreSQL re-checks the newer row version against the *old* joined worker row (EvalPlanQual);
    # the join fails, the outer join yields NULL worker columns, and the run saw
    # ``status=executing, worker=None`` → AttributeError in ``_session_view``.
    source, target = worker(), worker()
    session, migration = _migrating(source, target)
    out = commands(source, "migrate_out").get().payload
    outcome: dict = {}

    def run() -> None:
        try:
            outcome["decisions"] = scheduler_run(trigger="tick")
        except Exception as exc:
            outcome["error"] = exc
        finally:
            connection.close()

    with transaction.atomic():
        migration_completed(command=out, report={"bytes": 1})  # flips the row, holds its lock
        runner = threading.Thread(target=run)
        runner.start()
        _wait_until_blocked_on_a_lock()
    runner.join(30)

    assert "error" not in outcome, repr(outcome.get("error"))
    assert not runner.is_alive()
    session.refresh_from_db()
    assert (session.status, session.worker_id, session.epoch) == (Status.EXECUTING, target.pk, 2)
    assert Migration.objects.get(pk=migration.pk).outcome == "succeeded"


def test_a_run_recovers_a_session_still_executing_on_a_worker_that_has_ended(tmp_path, settings):
    # The provisioner marked the worker failed (or a release raced a placement) before anything
    # recovered its sessions: the run used to raise "executing on unknown GPU" on every decision.
    settings.STREAMSERVE = {**settings.STREAMSERVE, "CHECKPOINT_DIR": str(tmp_path)}
    gone, alive = worker(), worker()
    session = SessionFactory(activity="active", last_active_at=timezone.now())
    lifecycle.session_place(session=session, worker=gone)
    GpuWorker.objects.filter(pk=gone.pk).update(status=GpuWorker.Status.FAILED)

    scheduler_run(trigger="tick")

    session.refresh_from_db()
    assert session.events.filter(kind=SessionEvent.Kind.RECOVER).get().detail["worker"] == gone.name
    # Recovered in the same run, then placed again by the same decision.
    assert (session.status, session.worker_id) == (Status.EXECUTING, alive.pk)
    assert commands(alive, "start").get().payload["epoch"] == session.epoch


def test_a_session_on_a_live_worker_of_another_pool_does_not_crash_the_run():
    worker()
    foreign = worker(model_preset="not-served")
    session = SessionFactory(activity="active", last_active_at=timezone.now())
    lifecycle.session_place(session=session, worker=foreign)

    scheduler_run(trigger="tick")  # seen as waiting; no placement can apply to it

    session.refresh_from_db()
    assert (session.status, session.worker_id, session.epoch) == (Status.EXECUTING, foreign.pk, 1)
