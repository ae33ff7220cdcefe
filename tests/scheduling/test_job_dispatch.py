"""The job dispatcher on real rows: EDF within priority onto the room the streams leave,
preemption when streams arrive, resume and move of paused jobs, re-queue on a worker's death or a
refused command (with a raised epoch, so the old holder's reports are ignored)."""

from __future__ import annotations

import json
from datetime import timedelta

import pytest
import redis
from django.conf import settings
from django.utils import timezone

from controlplane.celery import app
from gpu.models import GpuWorker
from scheduling.core.jobs.policy import EdfJobPolicy, JobRound, JobView, WorkerView, load_job_policy
from scheduling.live.answers import command_answered
from scheduling.live.enqueue import JOBS_DISPATCH
from scheduling.live.jobs import jobs_dispatch, jobs_recover
from scheduling.models import WorkerCommand
from scheduling.tasks import jobs_dispatch as jobs_dispatch_task
from sessions import jobs
from sessions.models import Job
from tests.factories import GpuWorkerFactory, JobFactory, SessionFactory

pytestmark = pytest.mark.django_db


def streams_on(worker, n: int) -> None:
    for _ in range(n):
        SessionFactory(worker=worker, status="executing", state_location="worker")


def job_due_in(seconds: float, **fields) -> Job:
    now = timezone.now()
    return JobFactory(submitted_at=now, deadline=now + timedelta(seconds=seconds), **fields)


def commands(kind: str) -> list[WorkerCommand]:
    return list(
        WorkerCommand.objects.filter(kind=kind).select_related("worker", "job").order_by("created_at")
    )


def refresh(*rows):
    for row in rows:
        row.refresh_from_db()


def test_queued_jobs_go_earliest_deadline_first_onto_the_room_streams_leave():
    worker = GpuWorkerFactory(model_preset="tiny", capacity=4)
    streams_on(worker, 2)
    late, later, soon = job_due_in(60), job_due_in(90), job_due_in(30)
    result = jobs_dispatch()
    assert result.assigned == 2
    refresh(late, later, soon)
    assert (soon.state, late.state, later.state) == ("running", "running", "queued")
    assert (soon.worker, soon.epoch, soon.started_at is not None) == (worker, 1, True)
    run = {c.job_id: c for c in commands("job_run")}
    assert set(run) == {soon.pk, late.pk}
    payload = run[soon.pk].payload
    assert (payload["job"], payload["epoch"], payload["job_kind"], payload["model"]) == (
        str(soon.pk),
        1,
        "image",
        "tiny",
    )
    assert (payload["width"], payload["height"], payload["frames"], payload["steps"]) == (64, 64, 1, 4)
    assert payload["deadline"] == pytest.approx(soon.deadline.timestamp())
    assert "session" not in payload
    assert jobs_dispatch().assigned == 0  # no room left: the third waits


def test_priority_outranks_deadline_and_full_or_foreign_workers_get_nothing():
    full = GpuWorkerFactory(model_preset="tiny", capacity=2)
    streams_on(full, 2)
    roomy = GpuWorkerFactory(model_preset="tiny", capacity=1)
    GpuWorkerFactory(model_preset="small", capacity=4)  # serves another model
    GpuWorkerFactory(model_preset="tiny", capacity=4, status=GpuWorker.Status.DRAINING)
    urgent, important = job_due_in(10), job_due_in(100, priority=3)
    jobs_dispatch()
    refresh(urgent, important)
    assert (important.state, important.worker) == ("running", roomy)
    assert (urgent.state, urgent.worker) == ("queued", None)


def test_streams_waiting_for_a_gpu_hold_new_jobs_back():
    GpuWorkerFactory(model_preset="tiny", capacity=4)
    SessionFactory(status="queued", activity="active")
    job = job_due_in(30)
    assert jobs_dispatch().assigned == 0
    refresh(job)
    assert job.state == "queued"


def test_arriving_streams_preempt_the_job_with_most_slack_and_it_resumes_when_room_frees():
    worker = GpuWorkerFactory(model_preset="tiny", capacity=3)
    tight, slack = job_due_in(20), job_due_in(200)
    jobs_dispatch()
    streams_on(worker, 2)  # 2 streams + 2 jobs on K=3: one job must give way
    result = jobs_dispatch()
    assert result.paused == 1
    refresh(tight, slack)
    assert (tight.state, slack.state, slack.worker) == ("running", "paused", worker)
    (pause,) = commands("job_pause")
    assert (pause.job, pause.worker, pause.payload["epoch"]) == (slack, worker, slack.epoch)
    worker.sessions.all().update(
        status="terminated", worker=None, state_location="none", terminated_at=timezone.now()
    )
    assert jobs_dispatch().resumed == 1
    refresh(slack)
    assert slack.state == "running"
    assert [c.job for c in commands("job_resume")] == [slack]


def test_a_paused_job_moves_to_a_worker_with_room_and_resumes_once_its_state_landed():
    source = GpuWorkerFactory(model_preset="tiny", capacity=1)
    job = job_due_in(60)
    jobs_dispatch()
    streams_on(source, 1)
    jobs_dispatch()  # paused on the source
    target = GpuWorkerFactory(model_preset="tiny", capacity=1, migration_address="10.0.0.2:7000")
    assert jobs_dispatch().moved == 1
    refresh(job)
    assert (job.state, job.worker, job.epoch) == ("paused", target, 2)
    (into,), (out,) = commands("migrate_in"), commands("migrate_out")
    assert (into.worker, into.payload["job"], into.payload["epoch"], into.payload["source"]) == (
        target,
        str(job.pk),
        2,
        source.name,
    )
    assert (out.worker, out.payload["epoch"], out.payload["new_epoch"], out.payload["target_address"]) == (
        source,
        1,
        2,
        "10.0.0.2:7000",
    )
    later = job_due_in(120)
    # The state is on its way: the job is not resumed yet, and the slot it moved for is kept for it.
    assert jobs_dispatch().as_dict() == {"assigned": 0, "paused": 0, "resumed": 0, "moved": 0, "requeued": 0}
    command_answered(command=into.payload, status="acked", reason="", result={"listening": "10.0.0.2:7000"})
    assert jobs_dispatch().resumed == 0  # the target listens; the source has not sent the region yet
    command_answered(command=out.payload, status="acked", reason="", result={"bytes": 4096})
    assert jobs_dispatch().resumed == 1
    refresh(later)
    assert later.state == "queued"
    (resume,) = commands("job_resume")
    assert (resume.worker, resume.payload["epoch"]) == (target, 2)
    # The source's late progress under the old epoch cannot touch the job any more.
    jobs.job_progress(str(job.pk), 1, source.name, state="running", step=3, steps=4)
    refresh(job)
    assert (job.steps_done, job.worker) == (0, target)


def test_a_lost_worker_requeues_its_jobs_with_a_raised_epoch_and_ignores_its_reports():
    worker = GpuWorkerFactory(model_preset="tiny", capacity=2)
    job = job_due_in(60)
    jobs_dispatch()
    jobs.job_progress(str(job.pk), 1, worker.name, state="running", step=2, steps=4)
    GpuWorker.objects.filter(pk=worker.pk).update(status=GpuWorker.Status.FAILED)
    assert jobs_recover(worker=worker) == 1
    refresh(job)
    assert (job.state, job.worker, job.epoch, job.steps_done) == ("queued", None, 2, 0)
    jobs.job_completed(
        str(job.pk), 1, worker.name, content=b"x", content_type="image/png", extension="png", run_s=1
    )
    refresh(job)
    assert job.state == "queued" and not job.result
    survivor = GpuWorkerFactory(model_preset="tiny", capacity=2)
    jobs_dispatch()
    refresh(job)
    assert (job.state, job.worker, job.epoch) == ("running", survivor, 3)


def test_the_dispatcher_requeues_jobs_of_workers_that_ended_elsewhere():
    worker = GpuWorkerFactory(model_preset="tiny", capacity=2)
    job = job_due_in(60)
    jobs_dispatch()
    GpuWorker.objects.filter(pk=worker.pk).update(
        status=GpuWorker.Status.RELEASED, released_at=timezone.now()
    )
    assert jobs_dispatch().requeued == 1
    refresh(job)
    assert (job.state, job.epoch) == ("queued", 2)


def test_a_refused_run_puts_the_job_back_in_the_queue_unless_superseded():
    GpuWorkerFactory(model_preset="tiny", capacity=1)
    job = job_due_in(60)
    jobs_dispatch()
    (run,) = commands("job_run")
    command_answered(command=run.payload, status="refused", reason="model not loaded", result={})
    refresh(job)
    assert (job.state, job.epoch) == ("queued", 2)
    run.refresh_from_db()
    assert (run.status, run.reason) == ("refused", "model not loaded")


def test_cancelling_a_running_job_keeps_it_cancelled_whatever_its_worker_reports():
    worker = GpuWorkerFactory(model_preset="tiny", capacity=1)
    job = job_due_in(60)
    jobs_dispatch()
    refresh(job)
    jobs.job_cancel(job=job)
    jobs.job_completed(
        str(job.pk), job.epoch, worker.name, content=b"x", content_type="image/png", extension="png", run_s=1
    )
    refresh(job)
    assert job.state == "cancelled" and not job.result


def test_the_edf_policy_never_plans_more_running_jobs_than_a_worker_has_room():
    policy = EdfJobPolicy()
    queued = [
        JobView(id=f"j{i}", model="m", state="queued", priority=0, deadline=float(i), steps=4, steps_done=0)
        for i in range(6)
    ]
    plan = policy.plan(
        JobRound(now=0.0, jobs=queued, workers=[WorkerView("a", "m", 2), WorkerView("b", "m", 1)])
    )
    assert plan.assign == [("j0", "a"), ("j1", "a"), ("j2", "b")]
    assert isinstance(load_job_policy("edf"), EdfJobPolicy)
    assert (
        load_job_policy("scheduling.core.jobs.policy:EdfJobPolicy").plan(JobRound(0.0, [], [])).assign == []
    )
    for bad, reason in [
        ("fifo", "use one of edf"),
        ("scheduling.core.jobs.policy:JobView", "not a JobPolicy"),
    ]:
        with pytest.raises(ValueError, match=f"JOB_POLICY='{bad}'.*{reason}"):
            load_job_policy(bad)


@pytest.mark.django_db(transaction=True)
def test_a_submission_enqueues_a_dispatch_on_the_scheduler_queue_and_the_task_runs_it(user_api):
    broker = redis.Redis.from_url(settings.CELERY_BROKER_URL)
    broker.delete("scheduler")
    assert app.amqp.router.route({}, JOBS_DISPATCH)["queue"].name == "scheduler"
    worker = GpuWorkerFactory(model_preset="tiny", capacity=1)
    response = user_api.post(
        "/api/jobs/", {"kind": "image", "prompt": "a kite", "model": "tiny"}, format="json"
    )
    assert response.status_code == 201
    queued = [json.loads(raw)["headers"]["task"] for raw in broker.lrange("scheduler", 0, -1)]
    assert JOBS_DISPATCH in queued
    broker.delete("scheduler")
    assert jobs_dispatch_task() == {"assigned": 1, "paused": 0, "resumed": 0, "moved": 0, "requeued": 0}
    assert Job.objects.get().worker == worker
