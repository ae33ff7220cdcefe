"""The decoders of D and ED workers on the live control plane (docs/stages.md, "Live placement"):
one-shot jobs go to a D or ED worker only while a decoder (and for D an encoder) is ready, their
``job_run`` names the least-loaded C worker, same region first, and sessions never go to a D, ED or
C worker — against the real database, through the real job dispatcher and scheduler run."""

from __future__ import annotations

from datetime import timedelta

import pytest
from django.utils import timezone

from gpu.models import GpuWorker, Region
from scheduling.console import cluster_snapshot
from scheduling.live.jobs import jobs_dispatch
from scheduling.live.run import scheduler_run
from scheduling.models import WorkerCommand
from sessions.models import GenerationSession, Job
from tests.factories import JobFactory, SessionFactory
from tests.scheduling.test_stages_live import worker

pytestmark = pytest.mark.django_db


def test_a_job_runs_on_a_d_worker_with_an_encoder_and_the_nearest_least_loaded_decoder():
    # given only a D worker, an encoder, and three decoders: a free one far away, a busy and a
    # less busy one in the D worker's region
    far = Region.objects.create(name="far")
    d = worker("d", "D")
    worker("enc", "E")
    worker("dec-far", "C", region=far, telemetry={"decoder": {"queue": 0}})
    worker("dec-busy", "C", telemetry={"decoder": {"queue": 4}})
    worker("dec-near", "C", telemetry={"decoder": {"queue": 1}})
    job = JobFactory(deadline=timezone.now() + timedelta(minutes=5))
    # when the job dispatcher runs
    result = jobs_dispatch()
    # then the job runs on the D worker, whose job_run names the encoder and the near free decoder
    assert result.assigned == 1 and not result.waiting_for_encoder
    command = WorkerCommand.objects.get(kind="job_run")
    assert command.worker == d and command.payload["job"] == str(job.pk)
    assert command.payload["encoder"] == {"worker": "enc", "address": "enc:29500"}
    assert command.payload["decoder"] == {"worker": "dec-near", "address": "dec-near:29500"}
    # and the console shows each decoder's load
    rows = {w["name"]: w for w in cluster_snapshot()["workers"]}
    assert rows["dec-busy"]["decoder"] == {"queue": 4} and rows["d"]["decoder"] is None


def test_a_job_waits_with_the_reason_while_no_decoder_is_ready_for_an_ed_worker():
    # given an ED worker whose only decoder is still starting
    worker("ed", "ED")
    worker("dec", "C", status=GpuWorker.Status.PROVISIONING)
    job = JobFactory(deadline=timezone.now() + timedelta(minutes=5))
    # when the job dispatcher runs
    result = jobs_dispatch()
    # then nothing is sent, the job waits, and the round says why
    assert not WorkerCommand.objects.filter(kind="job_run").exists()
    job.refresh_from_db()
    assert job.state == Job.State.QUEUED
    assert result.waiting_for_encoder == {
        "ed": "waiting for a decoder: no ready C worker serves tiny to ed (role ED)"
    }
    # and once the decoder is ready the job goes, naming it and no encoder (ED encodes itself)
    GpuWorker.objects.filter(name="dec").update(status=GpuWorker.Status.READY)
    assert jobs_dispatch().assigned == 1
    payload = WorkerCommand.objects.get(kind="job_run").payload
    assert payload["decoder"]["worker"] == "dec" and "encoder" not in payload


def test_sessions_never_go_to_d_ed_or_c_workers():
    # given a ready worker of every role but DC and EDC, and a queued stream
    for role in ("D", "ED", "C", "E"):
        worker(role.lower(), role)
    session = SessionFactory(activity=GenerationSession.Activity.ACTIVE)
    # when the scheduler runs, the stream is not started anywhere
    scheduler_run(trigger="tick")
    assert not WorkerCommand.objects.filter(kind="start").exists()
    # and once a DC worker is ready it starts there, with the encoder
    dc = worker("dc", "DC")
    scheduler_run(trigger="tick")
    start = WorkerCommand.objects.get(kind="start")
    assert start.worker == dc and start.payload["session"] == str(session.pk)
    assert start.payload["encoder"]["worker"] == "e"
