"""Admission control (lowering queue_max refuses new arrivals only; a refused client is told why)
and the command streams of workers that ended."""

from __future__ import annotations

import uuid

import pytest
from django.utils import timezone

from contracts.wire.channel import new_command, send_command, stream_key
from scheduling.core.types import Decision
from scheduling.live.apply import Pool, decision_apply
from scheduling.live.liveness import workers_check
from scheduling.live.outbox import Outbox, redis_client
from scheduling.live.scaling import command_streams_prune
from scheduling.models import SchedulerConfig, SchedulerDecision, WorkerCommand
from sessions import lifecycle
from sessions.models import GenerationSession
from sessions.selectors import session_status_message
from tests.factories import GpuWorkerFactory, SessionFactory

pytestmark = pytest.mark.django_db

Status = GenerationSession.Status


def apply_queue(sessions: list[GenerationSession], queue_max: int) -> None:
    config = SchedulerConfig.load()
    config.queue_max = queue_max
    config.save()
    record = SchedulerDecision.objects.create(
        trigger="tick", decided_at=timezone.now(), policy="turboserve", active_sessions=len(sessions),
        budget=0, target_budget=0, duration_ms=0.1,
    )  # fmt: skip
    decision = Decision(time=0.0, queue=tuple(str(s.pk) for s in sessions))
    pool = Pool(preset="tiny", workers={}, sessions={str(s.pk): s for s in sessions})
    decision_apply(decision=decision, record=record, pool=pool, config=config, outbox=Outbox())


def test_lowering_queue_max_keeps_the_waiting_and_refuses_only_new_arrivals():
    waiting = [SessionFactory(activity="active") for _ in range(3)]
    apply_queue(waiting, queue_max=5)
    assert [s.queue_position for s in waiting] == [1, 2, 3]
    arrival = SessionFactory(activity="active")
    # The operator lowers the limit below the number already waiting.
    apply_queue([*waiting, arrival], queue_max=2)
    for session in waiting:
        session.refresh_from_db()
    arrival.refresh_from_db()
    assert [(s.status, s.queue_position) for s in waiting] == [(Status.QUEUED, i) for i in (1, 2, 3)]
    assert arrival.status == Status.TERMINATED
    # The refused client's status message says why, not only "terminated".
    message = session_status_message(arrival)
    assert message["status"] == "terminated" and message["reason"] == "queue full (2 waiting)"
    assert session_status_message(waiting[0])["reason"] is None


def test_a_terminated_sessions_status_names_who_ended_it():
    session = SessionFactory()
    lifecycle.session_end(session=session, reason="user")
    session.refresh_from_db()
    assert session_status_message(session)["reason"] == "user"


def test_command_streams_of_ended_workers_are_deleted_once_their_commands_are_answered():
    client = redis_client()
    released = GpuWorkerFactory(status="released", released_at=timezone.now())
    failed_waiting = GpuWorkerFactory(status="failed", released_at=timezone.now())
    ready = GpuWorkerFactory()
    for worker in (released, failed_waiting, ready):
        send_command(client, worker.name, new_command("drain"))
    WorkerCommand.objects.create(
        id=uuid.uuid4(), worker=failed_waiting, kind="stop", created_at=timezone.now()
    )  # still waiting for its answer
    try:
        assert command_streams_prune() == [released.name]
        assert not client.exists(stream_key(released.name))
        assert client.exists(stream_key(failed_waiting.name)) and client.exists(stream_key(ready.name))
        # Once the tick times the command out, the failed worker's stream goes too.
        WorkerCommand.objects.filter(worker=failed_waiting).update(status="timed_out")
        assert workers_check() == [] and not client.exists(stream_key(failed_waiting.name))
    finally:
        client.delete(*(stream_key(w.name) for w in (released, failed_waiting, ready)))


def test_a_parked_state_is_handed_off_once_however_many_runs_ask_to_release_its_host():
    # Given a worker to be released that holds a suspended session's state, and another host
    leaving, other = GpuWorkerFactory(status="ready"), GpuWorkerFactory(status="ready")
    session = SessionFactory(activity="idle")
    lifecycle.session_place(session=session, worker=leaving)
    lifecycle.session_suspend(session=session)
    workers = {leaving.name: leaving, other.name: other}

    def run_releasing() -> None:
        record = SchedulerDecision.objects.create(
            trigger="tick", decided_at=timezone.now(), policy="turboserve", active_sessions=0,
            budget=2, target_budget=1, duration_ms=0.1,
        )  # fmt: skip
        session.refresh_from_db()
        pool = Pool(preset="tiny", workers=workers, sessions={str(session.pk): session})
        decision = Decision(time=0.0, release=(leaving.name,))
        decision_apply(
            decision=decision, record=record, pool=pool, config=SchedulerConfig.load(), outbox=Outbox()
        )

    # When every scheduler run (a tick a second) asks for the release while the hand-off is in flight
    for _ in range(3):
        run_releasing()

    # Then the state is handed off once (one migration, one command to each side) and the worker kept
    from scheduling.models import Migration

    assert list(Migration.objects.filter(session=session).values_list("reason", "outcome")) == [
        ("handoff", "pending")
    ]
    assert WorkerCommand.objects.filter(worker=leaving, kind="migrate_out").count() == 1
    assert WorkerCommand.objects.filter(worker=other, kind="migrate_in").count() == 1
    leaving.refresh_from_db()
    assert leaving.status == "ready"


def test_an_undrained_worker_is_told_so_before_the_sessions_assigned_to_it():
    # Given a worker the scheduler drained and a session waiting
    kept = GpuWorkerFactory(status="draining")
    session = SessionFactory()
    record = SchedulerDecision.objects.create(
        trigger="tick", decided_at=timezone.now(), policy="turboserve", active_sessions=1,
        budget=1, target_budget=1, duration_ms=0.1,
    )  # fmt: skip
    # When a decision keeps the worker after all and places the session on it
    decision = Decision(time=0.0, undrain=(kept.name,), assign=((str(session.pk), kept.name),))
    pool = Pool(preset="tiny", workers={kept.name: kept}, sessions={str(session.pk): session})
    decision_apply(
        decision=decision, record=record, pool=pool, config=SchedulerConfig.load(), outbox=Outbox()
    )

    # Then its row is ready and the daemon hears "undrain" before the start (its own draining flag
    # refuses every start until then)
    kept.refresh_from_db()
    assert kept.status == "ready"
    kinds = list(
        WorkerCommand.objects.filter(worker=kept).order_by("created_at").values_list("kind", flat=True)
    )
    assert kinds[:2] == ["undrain", "start"], kinds
