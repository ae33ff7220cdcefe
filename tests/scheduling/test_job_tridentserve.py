"""``JOB_POLICY=tridentserve`` on real rows (the live dispatcher, PostgreSQL, the command outbox):
TridentServe's per-tick integer program (HiGHS) over the queued jobs × the workers' stage roles. It
starts the job that can still finish on time where ``edf`` starts the earliest deadline, and puts a
job on the role with the fewest inter-stage hand-offs; a job on a D worker goes out through the usual
path, naming its encoder and decoder. Steps are costed from a one-shot profile JSON (``JOB_PROFILES``)."""

from __future__ import annotations

import pytest

from scheduling.core.jobs.policy import JobRound, JobView, WorkerView, load_job_policy
from scheduling.core.jobs.tridentserve import TridentServeJobPolicy, handoff_bytes
from scheduling.live.jobs import jobs_dispatch
from scheduling.models import WorkerCommand
from tests.scheduling.test_job_genserve import policy, video_due_in  # noqa: F401 (the fixture)
from tests.scheduling.test_stages_live import worker

pytestmark = pytest.mark.django_db


@pytest.mark.parametrize(("name", "started"), [("edf", "hopeless"), ("tridentserve", "feasible")])
def test_one_slot_goes_to_the_job_that_can_still_make_its_deadline(policy, name, started):  # noqa: F811
    policy(name)
    w = worker("w", capacity=1)
    # 100 steps of 2 s: 200 s of work. Due in 60 s it cannot make it; due in 300 s it can.
    jobs = {"hopeless": video_due_in(60), "feasible": video_due_in(300)}
    assert jobs_dispatch().assigned == 1
    command = WorkerCommand.objects.get(kind="job_run")
    assert command.worker == w and command.payload["job"] == str(jobs[started].pk)


def test_jobs_fill_the_roles_with_fewest_handoffs_first_and_a_d_worker_names_its_services(policy):  # noqa: F811
    policy("tridentserve")
    worker("edc", capacity=1)
    d = worker("d", "D", capacity=1)
    worker("enc", "E")
    worker("dec", "C")
    first = video_due_in(300)
    # with one job, it runs on the EDC worker (no hand-off), though the D worker is free too
    assert jobs_dispatch().assigned == 1
    assert WorkerCommand.objects.get(kind="job_run").worker.name == "edc"
    # the next one takes the D worker, whose job_run names the encoder and the decoder
    second = video_due_in(400)
    assert jobs_dispatch().assigned == 1
    command = WorkerCommand.objects.get(kind="job_run", worker=d)
    assert command.payload["job"] == str(second.pk) and first.pk != second.pk
    assert command.payload["encoder"]["worker"] == "enc" and command.payload["decoder"]["worker"] == "dec"


def test_the_program_picks_the_role_per_job_and_never_exceeds_a_workers_room():
    policy_ = load_job_policy("tridentserve")
    assert isinstance(policy_, TridentServeJobPolicy)
    jobs = [
        JobView(id=f"j{i}", model="tiny", state="queued", priority=0, deadline=1000.0 + i, steps=4,
                steps_done=0, kind="video", width=64, height=64, frames=16)
        for i in range(5)
    ]  # fmt: skip
    workers = [
        WorkerView("a", "tiny", 2, "EDC"),
        WorkerView("b", "tiny", 1, "ED"),
        WorkerView("c", "tiny", 0, "DC"),
    ]
    plan = policy_.plan(JobRound(now=0.0, jobs=jobs, workers=workers))
    # every job can finish on time: the program fills the room (2 on a, 1 on b, none on c), which
    # on-time jobs it takes is a tie it settles (deterministically: same round, same plan)
    targets = sorted(target for _, target in plan.assign)
    assert targets == ["a", "a", "b"] and len({job for job, _ in plan.assign}) == 3
    assert policy_.plan(JobRound(now=0.0, jobs=jobs, workers=workers)).assign == plan.assign
    assert handoff_bytes(jobs[0], "EDC") == 0 < handoff_bytes(jobs[0], "ED") < handoff_bytes(jobs[0], "D")
    # streams waiting for the pool: no job starts
    waiting = policy_.plan(JobRound(now=0.0, jobs=jobs, workers=workers, streams_waiting={"tiny": 1}))
    assert waiting.assign == []
