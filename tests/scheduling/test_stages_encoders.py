"""The encoders of workers without E on the live control plane (docs/stages.md, "Live placement"):
jobs on DC workers, encoder failover, refused prompts sent again, and the encoder pool's size —
against the real database, through the real scheduler run, job dispatcher and answer path."""

from __future__ import annotations

from datetime import timedelta

import pytest
from django.utils import timezone

from gpu.models import GpuWorker, Region
from gpu.provisioners.kubernetes import worker_pod_manifest
from gpu.provisioners.local import gpuworker_command
from gpu.services import worker_heartbeat
from scheduling.console import cluster_snapshot
from scheduling.live.answers import command_answered
from scheduling.live.jobs import jobs_dispatch
from scheduling.live.outbox import Outbox
from scheduling.live.reactions import prompt_forward
from scheduling.live.run import scheduler_run
from scheduling.live.stages.auxiliary import new_worker_role
from scheduling.models import SchedulerDecision, SchedulerState, StagePlacement, WorkerCommand
from sessions.models import Job, Prompt
from tests.factories import JobFactory
from tests.scheduling.test_stages_live import executing, worker

pytestmark = pytest.mark.django_db


@pytest.fixture
def stages_on(settings):
    settings.STREAMSERVE = {
        **settings.STREAMSERVE,
        "STAGE_PLACEMENT": "tridentserve",
        "STAGE_MAX_CHANGING": 1,
    }
    return settings


def told(dc: GpuWorker, encoder: GpuWorker, kind: str = "start") -> None:
    """``dc`` was told (and acknowledged) to take its prompt embeddings from ``encoder``."""
    outbox = Outbox()
    body = outbox.command(dc, kind, encoder={"worker": encoder.name, "address": encoder.migration_address})
    WorkerCommand.objects.filter(pk=body["id"]).update(status="acked", answered_at=timezone.now())


def set_encoders(dc: GpuWorker) -> list[dict]:
    return list(
        WorkerCommand.objects.filter(worker=dc, kind="set_encoder")
        .order_by("created_at")
        .values_list("payload", flat=True)
    )


def test_a_job_runs_on_a_dc_worker_with_the_least_loaded_encoder():
    # given only a DC worker and two encoders, one with a longer queue, and a queued job
    dc = worker("dc", "DC")
    worker("enc-busy", "E", telemetry={"encoder": {"queue": 5}})
    worker("enc-free", "E", telemetry={"encoder": {"queue": 0}})
    job = JobFactory(deadline=timezone.now() + timedelta(minutes=5))
    # when the job dispatcher runs
    result = jobs_dispatch()
    # then the job runs on the DC worker, whose job_run names the free encoder
    assert result.assigned == 1 and not result.waiting_for_encoder
    payload = WorkerCommand.objects.get(kind="job_run").payload
    assert (payload["job"], payload["encoder"]) == (
        str(job.pk),
        {"worker": "enc-free", "address": "enc-free:29500"},
    )
    assert WorkerCommand.objects.get(kind="job_run").worker == dc


def test_a_job_stays_queued_with_the_reason_while_no_encoder_is_ready():
    # given a DC worker whose only encoder is still starting
    worker("dc", "DC")
    worker("enc", "E", status=GpuWorker.Status.PROVISIONING)
    job = JobFactory(deadline=timezone.now() + timedelta(minutes=5))
    # when the job dispatcher runs
    result = jobs_dispatch()
    # then nothing is sent, the job waits, and the round says why
    assert not WorkerCommand.objects.filter(kind="job_run").exists()
    job.refresh_from_db()
    assert job.state == Job.State.QUEUED
    assert result.waiting_for_encoder == {
        "dc": "waiting for an encoder: no ready E worker serves tiny to dc (role DC)"
    }
    # and once the encoder is ready the job goes
    GpuWorker.objects.filter(name="enc").update(status=GpuWorker.Status.READY)
    assert jobs_dispatch().assigned == 1
    assert WorkerCommand.objects.get(kind="job_run").payload["encoder"]["worker"] == "enc"


def test_a_lost_encoder_is_replaced_by_a_ready_one_of_the_same_region_first():
    # given a DC worker holding a session, told to use enc-a, and two other encoders, one far away
    far = Region.objects.create(name="far")
    dc = worker("dc", "DC")
    executing(dc)
    lost = worker("enc-a", "E")
    worker("enc-far", "E", region=far, telemetry={"encoder": {"queue": 0}})
    worker("enc-near", "E", telemetry={"encoder": {"queue": 3}})
    told(dc, lost)
    # when the encoder fails and the scheduler runs
    GpuWorker.objects.filter(pk=lost.pk).update(status=GpuWorker.Status.FAILED)
    scheduler_run(trigger="tick")
    # then the DC worker is told to use the near encoder, with what was lost and why
    (payload,) = set_encoders(dc)
    assert payload["encoder"] == {"worker": "enc-near", "address": "enc-near:29500"}
    assert (payload["lost"], payload["why"]) == ("enc-a", "encoder enc-a is no longer ready")
    record = SchedulerDecision.objects.order_by("-pk").first()
    assert record is not None and record.inputs["encoder_failover"] == {
        "dc": {"from": "enc-a", "to": "enc-near", "reason": "encoder enc-a is no longer ready"}
    }
    # and a second run while that command is in flight sends nothing more
    scheduler_run(trigger="tick")
    assert len(set_encoders(dc)) == 1
    # and once acknowledged the console's card shows the encoder in use and the failover
    command = WorkerCommand.objects.get(kind="set_encoder")
    command_answered(command=command.payload, status="acked", reason="", result={"encoder": "enc-near"})
    card = next(w for w in cluster_snapshot()["workers"] if w["name"] == "dc")
    assert card["encoder_source"]["worker"] == "enc-near"
    assert card["encoder_source"]["failover"] | {"at": None} == {
        "from": "enc-a", "to": "enc-near", "why": "encoder enc-a is no longer ready", "status": "acked", "at": None,
    }  # fmt: skip


def test_a_heartbeat_waiting_for_a_lost_encoder_gets_another_one():
    # given a DC worker using enc-a, whose row is still ready but whose process the worker lost
    dc = worker("dc", "DC")
    executing(dc)
    enc_a = worker("enc-a", "E")
    worker("enc-b", "E")
    told(dc, enc_a)
    # when its heartbeat reports an encode in flight: nothing to do
    wait = {"sessions": ["s"], "reason": "waiting for encoder enc-a's answer"}
    worker_heartbeat(worker_id=dc.pk, telemetry={"stage_role": "DC", "encoder_wait": wait})
    scheduler_run(trigger="tick")
    assert set_encoders(dc) == []
    # when it reports the encoder lost
    wait = {"sessions": ["s"], "reason": "encoder enc-a lost: connection reset"}
    worker_heartbeat(worker_id=dc.pk, telemetry={"stage_role": "DC", "encoder_wait": wait})
    scheduler_run(trigger="tick")
    # then it is told to use the other one (never the one it lost), and the card shows the wait
    (payload,) = set_encoders(dc)
    assert payload["encoder"]["worker"] == "enc-b" and payload["lost"] == "enc-a"
    assert payload["why"] == "heartbeat: encoder enc-a lost: connection reset"
    card = next(w for w in cluster_snapshot()["workers"] if w["name"] == "dc")
    assert card["encoder_source"]["wait"] == "encoder enc-a lost: connection reset"


def test_a_failover_with_no_encoder_left_is_recorded_as_waiting():
    dc = worker("dc", "DC")
    executing(dc)
    lost = worker("enc-a", "E")
    told(dc, lost)
    GpuWorker.objects.filter(pk=lost.pk).update(status=GpuWorker.Status.FAILED)
    scheduler_run(trigger="tick")
    assert set_encoders(dc) == []  # nobody to name: the worker keeps waiting (its heartbeat says so)


def test_a_prompt_refused_for_lack_of_an_encoder_is_sent_again_once_one_is_ready():
    # given a DC worker's session and no encoder: its prompt goes without one and is refused
    dc = worker("dc", "DC")
    session = executing(dc)
    prompt = Prompt.objects.create(session=session, text="a heron at dawn", from_chunk=4)
    prompt_forward(session_id=str(session.pk), prompt_id=prompt.pk)
    refused = WorkerCommand.objects.get(kind="prompt")
    assert "encoder" not in refused.payload
    command_answered(
        command=refused.payload, status="refused", reason="encoder: required for role DC", result={}
    )
    scheduler_run(trigger="tick")
    assert WorkerCommand.objects.filter(kind="prompt").count() == 1  # still no encoder: nothing to send
    # when an encoder is ready and the scheduler runs
    worker("enc", "E")
    scheduler_run(trigger="tick")
    # then the same prompt goes again, with the encoder, naming the refused command
    again = WorkerCommand.objects.filter(kind="prompt").exclude(pk=refused.pk).get()
    assert again.worker == dc and again.session_id == session.pk
    assert {k: again.payload[k] for k in ("text", "from_chunk", "prompt_id", "resent")} == {
        "text": "a heron at dawn", "from_chunk": 4, "prompt_id": prompt.pk, "resent": str(refused.pk),
    }  # fmt: skip
    assert again.payload["encoder"] == {"worker": "enc", "address": "enc:29500"}
    assert SchedulerDecision.objects.order_by("-pk").first().inputs["prompts_resent"] == [prompt.pk]
    # and only once
    scheduler_run(trigger="tick")
    assert WorkerCommand.objects.filter(kind="prompt").count() == 2


def test_the_planner_keeps_an_encoder_while_dc_workers_serve(stages_on):
    # given two DC workers (one holding a session) and no encoder
    busy, idle = worker("dc-a", "DC"), worker("dc-b", "DC")
    executing(busy)
    SchedulerState.objects.create(policy="stages@tiny", state={"bootstrapped": True, "trigger": {}})
    # when the scheduler runs
    scheduler_run(trigger="tick")
    # then the idle one is turned into an encoder
    placement = StagePlacement.objects.get()
    assert placement.reason == "encoder_pool" and placement.roles_after == {"dc-a": "DC", "dc-b": "E"}
    change = placement.changes.get()
    assert WorkerCommand.objects.get(pk=change.command_id).payload["role"] == "E"
    assert placement.trigger["why"] == "no ready E worker while workers without E serve"
    assert idle.pk == change.worker_id


def test_the_planner_adds_an_encoder_when_the_encoders_queue_is_long(stages_on):
    # given one encoder reporting a long queue, a busy DC worker and an idle whole pipeline
    stages_on.STREAMSERVE = {**stages_on.STREAMSERVE, "STAGE_ENCODER_QUEUE_MAX": 4}
    busy = worker("dc-a", "DC")
    executing(busy)
    worker("edc-b")
    worker("enc", "E", telemetry={"encoder": {"queue": 6}})
    SchedulerState.objects.create(policy="stages@tiny", state={"bootstrapped": True, "trigger": {}})
    # when the scheduler runs twice
    scheduler_run(trigger="tick")
    scheduler_run(trigger="tick")
    # then one placement turns the idle worker into a second encoder (once per window)
    placement = StagePlacement.objects.get()
    assert placement.reason == "encoder_pool" and placement.roles_after["edc-b"] == "E"
    assert placement.trigger["encoders"] == {"enc": 6}
    # and a short queue changes nothing
    StagePlacement.objects.all().delete()
    SchedulerState.objects.filter(policy="stages@tiny").update(state={"bootstrapped": True, "trigger": {}})
    GpuWorker.objects.filter(name="enc").update(telemetry={"encoder": {"queue": 1}})
    GpuWorker.objects.filter(name="edc-b").update(stage_role="EDC")
    scheduler_run(trigger="tick")
    assert not StagePlacement.objects.filter(reason="encoder_pool").exists()


def test_a_new_worker_is_started_as_an_encoder_while_dc_workers_have_none():
    worker("dc", "DC")
    assert new_worker_role("tiny") == "E"
    row = worker("new", "E", status=GpuWorker.Status.PROVISIONING)
    argv = gpuworker_command(row)
    assert argv[argv.index("--stages") + 1] == "E"
    # once an encoder is live the next one serves the whole pipeline, started without --stages
    assert new_worker_role("tiny") == "EDC"
    assert "--stages" not in gpuworker_command(worker("edc"))
    # and a Pod started for an encoder runs it as one
    pod = worker_pod_manifest(
        {"spec": {"containers": [{}]}}, name="p", namespace="n", preset="tiny", gpu_type="h100",
        secret_name="s", stage_role="E",
    )  # fmt: skip
    command = pod["spec"]["containers"][0]["command"]
    assert command[command.index("--stages") + 1] == "E"


def test_a_prompt_refused_because_its_encoder_was_unusable_goes_to_another_one():
    # given a DC worker's prompt naming enc-a, refused because enc-a could not be reached
    dc = worker("dc", "DC")
    session = executing(dc)
    worker("enc-a", "E")
    prompt = Prompt.objects.create(session=session, text="a fox", from_chunk=2)
    prompt_forward(session_id=str(session.pk), prompt_id=prompt.pk)
    refused = WorkerCommand.objects.get(kind="prompt")
    assert refused.payload["encoder"]["worker"] == "enc-a"
    reason = "encoder enc-a at enc-a:29500 unreachable: connection refused"
    command_answered(command=refused.payload, status="refused", reason=reason, result={})
    # when another encoder is ready and the scheduler runs
    worker("enc-b", "E", telemetry={"encoder": {"queue": 9}})
    scheduler_run(trigger="tick")
    # then the prompt goes again, to the other encoder even though it is busier
    again = WorkerCommand.objects.filter(kind="prompt").exclude(pk=refused.pk).get()
    assert (again.payload["encoder"]["worker"], again.payload["resent"]) == ("enc-b", str(refused.pk))
    # and a refusal for another reason is not retried
    other = Prompt.objects.create(session=session, text="an owl", from_chunk=5)
    prompt_forward(session_id=str(session.pk), prompt_id=other.pk)
    late = WorkerCommand.objects.get(kind="prompt", payload__prompt_id=other.pk)
    command_answered(command=late.payload, status="refused", reason="stale epoch 0 < 1", result={})
    scheduler_run(trigger="tick")
    assert WorkerCommand.objects.filter(kind="prompt", payload__prompt_id=other.pk).count() == 1
