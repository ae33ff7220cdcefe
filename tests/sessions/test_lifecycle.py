"""The session lifecycle: compare-and-set transitions that record their own events."""

from __future__ import annotations

import pytest
import redis
from django.conf import settings

from contracts.wire.channel import PublishFence, delivered_key, epoch_key
from sessions import lifecycle
from sessions.models import GenerationSession, SessionEvent
from sessions.signals import session_event_committed
from tests.factories import GpuWorkerFactory, SessionFactory

pytestmark = pytest.mark.django_db

Status = GenerationSession.Status


def kinds(session):
    return list(session.events.values_list("kind", flat=True))


def test_place_then_suspend_bumps_the_epoch_and_records_each_transition():
    worker = GpuWorkerFactory()
    session = SessionFactory()
    assert lifecycle.session_place(session=session, worker=worker)
    row = GenerationSession.objects.get(pk=session.pk)
    assert (row.status, row.worker_id, row.state_location, row.epoch) == ("executing", worker.pk, "worker", 1)
    assert lifecycle.session_suspend(session=session)
    row.refresh_from_db()
    assert (row.status, row.worker_id, row.host_worker_id, row.state_location, row.epoch) == (
        "suspended",
        None,
        worker.pk,
        "host",
        2,
    )
    assert kinds(session) == [SessionEvent.Kind.PLACE, SessionEvent.Kind.SUSPEND]
    # Resumed on the worker whose host memory holds it: the place event says so.
    assert lifecycle.session_place(session=session, worker=worker)
    assert session.events.last().detail == {"worker": worker.name, "resumed": True}


def test_a_stale_instance_changes_nothing():
    worker = GpuWorkerFactory()
    session = SessionFactory()
    stale = GenerationSession.objects.get(pk=session.pk)
    assert lifecycle.session_place(session=session, worker=worker)
    # ``stale`` still believes the session is queued at epoch 0: its transition must not apply.
    assert not lifecycle.session_place(session=stale, worker=GpuWorkerFactory())
    assert not lifecycle.session_queue(session=stale, position=1)
    row = GenerationSession.objects.get(pk=session.pk)
    assert (row.status, row.worker_id, row.epoch) == ("executing", worker.pk, 1)
    assert stale.status == Status.QUEUED  # a refused transition leaves the instance alone too
    assert kinds(session) == [SessionEvent.Kind.PLACE]


def test_migration_flips_only_at_the_epoch_it_started_from():
    source, target = GpuWorkerFactory(), GpuWorkerFactory()
    session = SessionFactory()
    lifecycle.session_place(session=session, worker=source)
    assert lifecycle.session_migration_start(
        session=session, source=source, target=target, reason="rebalance"
    )
    assert GenerationSession.objects.get(pk=session.pk).status == Status.MIGRATING
    assert not lifecycle.session_migration_finish(session=session, target=target, epoch=0, new_epoch=2)
    assert lifecycle.session_migration_finish(session=session, target=target, epoch=1, new_epoch=2)
    row = GenerationSession.objects.get(pk=session.pk)
    assert (row.status, row.worker_id, row.epoch) == ("executing", target.pk, 2)


def test_failed_migration_of_a_parked_state_leaves_it_parked():
    host, target = GpuWorkerFactory(), GpuWorkerFactory()
    session = SessionFactory(status="suspended", host_worker=host, state_location="host")
    assert lifecycle.session_migration_start(
        session=session, source=host, target=target, reason="resume-remote"
    )
    assert GenerationSession.objects.get(pk=session.pk).worker_id == host.pk
    assert lifecycle.session_migration_fail(session=session, parked=True, error="peer reset")
    row = GenerationSession.objects.get(pk=session.pk)
    assert (row.status, row.worker_id, row.host_worker_id) == ("suspended", None, host.pk)


def test_requeue_of_a_refused_resume_keeps_the_state_on_that_host():
    worker = GpuWorkerFactory()
    session = SessionFactory(status="suspended", host_worker=worker, state_location="host")
    lifecycle.session_place(session=session, worker=worker)
    assert not lifecycle.session_requeue(session=session, epoch=0, kind="resume", reason="old epoch")
    assert lifecycle.session_requeue(session=session, epoch=1, kind="resume", reason="no such state")
    row = GenerationSession.objects.get(pk=session.pk)
    assert (row.status, row.worker_id, row.host_worker_id, row.state_location) == (
        "queued",
        None,
        worker.pk,
        "host",
    )


def test_recover_and_end():
    worker = GpuWorkerFactory()
    active = SessionFactory(activity="active")
    idle = SessionFactory(activity="idle")
    for session in (active, idle):
        lifecycle.session_place(session=session, worker=worker)
        assert lifecycle.session_recover(session=session, lost=worker, has_checkpoint=False)
    assert GenerationSession.objects.get(pk=active.pk).status == Status.QUEUED
    assert GenerationSession.objects.get(pk=idle.pk).status == Status.SUSPENDED
    assert lifecycle.session_end(session=active, reason="user")
    assert not lifecycle.session_end(session=active, reason="user")  # terminated is final
    depart = active.events.get(kind=SessionEvent.Kind.DEPART)
    assert depart.detail == {"reason": "user", "held_by": [], "was_active": True}


def test_events_are_announced_only_after_commit(django_capture_on_commit_callbacks):
    worker = GpuWorkerFactory()
    session = SessionFactory()
    heard = []

    def listener(*, session_id, kind, detail, **_):
        heard.append((session_id, kind))

    session_event_committed.connect(listener)
    try:
        with django_capture_on_commit_callbacks(execute=False) as callbacks:
            lifecycle.session_place(session=session, worker=worker)
        assert heard == []  # nothing announced inside the transaction
        with django_capture_on_commit_callbacks(execute=True):
            for callback in callbacks:
                callback()
    finally:
        session_event_committed.disconnect(listener)
    assert (str(session.pk), SessionEvent.Kind.PLACE) in heard


def test_the_publish_lease_rises_after_commit_when_a_publisher_loses_the_session(
    django_capture_on_commit_callbacks,
):
    """Issue 17, defect 1: once a lost worker's session is recovered, that worker (frozen, then
    woken) may not publish under its old epoch; a suspend leaves the suspending worker's last
    chunk publishable."""
    client = redis.Redis.from_url(settings.REDIS_URL)
    fence = PublishFence(client)
    source, target = GpuWorkerFactory(), GpuWorkerFactory()
    session = SessionFactory(activity="active")
    sid = str(session.pk)
    try:
        with django_capture_on_commit_callbacks(execute=True):
            lifecycle.session_place(session=session, worker=source)
        assert client.get(epoch_key(sid)) is None  # the new owner takes it with its first chunk
        fence.admit(sid, 1, 0)
        with django_capture_on_commit_callbacks(execute=False) as callbacks:
            assert lifecycle.session_recover(session=session, lost=source, has_checkpoint=False)
        assert fence.holds(sid, 1)  # not before commit: a rollback must not fence the real owner
        for callback in callbacks:
            callback()
        assert not fence.holds(sid, 1) and fence.holds(sid, 2)
        with django_capture_on_commit_callbacks(execute=True):
            lifecycle.session_place(session=session, worker=target)
            lifecycle.session_suspend(session=session)
        assert int(client.get(epoch_key(sid))) == 2
        with django_capture_on_commit_callbacks(execute=True):
            lifecycle.session_place(session=session, worker=target)
            lifecycle.session_migration_start(session=session, source=target, target=source, reason="test")
            lifecycle.session_migration_finish(session=session, target=source, epoch=5, new_epoch=6)
        assert not fence.holds(sid, 5) and fence.holds(sid, 6)
        with django_capture_on_commit_callbacks(execute=True):
            lifecycle.session_end(session=session, reason="user")
        assert not fence.holds(sid, 6) and not fence.holds(sid, 10**6)
    finally:
        client.delete(epoch_key(sid), delivered_key(sid))
