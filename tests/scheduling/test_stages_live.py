"""Live stage placement (docs/stages.md, "Live placement") against the real database: worker rows are
the state, the scheduler run is the real one, the worker's answers go through the real answer path."""

from __future__ import annotations

import csv
import io
import uuid
from datetime import timedelta

import pytest
from django.utils import timezone

from gpu.models import GpuWorker, Region
from gpu.services import worker_heartbeat, worker_register
from scheduling.console import cluster_snapshot
from scheduling.live.answers import command_answered
from scheduling.live.jobs import jobs_dispatch
from scheduling.live.reactions import prompt_forward
from scheduling.live.run import scheduler_run
from scheduling.models import (
    SchedulerDecision,
    SchedulerState,
    StagePlacement,
    StageRoleChange,
    WorkerCommand,
)
from sessions.models import ChunkRecord, GenerationSession, Prompt
from tests.factories import GpuWorkerFactory, JobFactory, SessionFactory

pytestmark = pytest.mark.django_db

Status = GenerationSession.Status
Change = StageRoleChange.Status


@pytest.fixture
def stages_on(settings):
    settings.STREAMSERVE = {
        **settings.STREAMSERVE,
        "STAGE_PLACEMENT": "tridentserve",
        "STAGE_MAX_CHANGING": 1,
    }
    return settings


def worker(name: str, role: str = "EDC", **kwargs) -> GpuWorker:
    kwargs.setdefault("last_heartbeat", timezone.now())
    return GpuWorkerFactory(name=name, stage_role=role, migration_address=f"{name}:29500", **kwargs)


def executing(on: GpuWorker, **kwargs) -> GenerationSession:
    return SessionFactory(
        status=Status.EXECUTING, worker=on, state_location="worker", epoch=1, activity="active", **kwargs
    )


def stream_mix(session: GenerationSession, *, chunks: int, prompts: int) -> None:
    """What the streams did in the last window: chunks generated and prompt switches (the session's
    first prompt comes with it)."""
    now = timezone.now()
    ChunkRecord.objects.bulk_create(
        ChunkRecord(
            session=session,
            chunk_index=i,
            worker=session.worker,
            batch_size=1,
            generation_ms=90.0,
            created_at=now,
        )
        for i in range(chunks)
    )
    for i in range(prompts):
        Prompt.objects.create(session=session, text=f"prompt {i}", from_chunk=i)


def answer(change: StageRoleChange, status: str, reason: str = "", **result) -> None:
    command = WorkerCommand.objects.get(pk=change.command_id)
    command_answered(command=command.payload, status=status, reason=reason, result=result)


def test_a_heartbeat_stores_the_reported_role_and_the_encoders_load():
    # given an EDC worker that restarted as an encoder
    encoder = worker("enc")
    # when its heartbeat reports the role and its encode queue
    worker_heartbeat(
        worker_id=encoder.pk,
        telemetry={"stage_role": "E", "encoder": {"queue": 3, "served": 40, "encode_ms_p50": 12.5}},
    )
    encoder.refresh_from_db()
    # then the row says so, and the encoder's load is readable for the encoder choice
    assert (encoder.stage_role, encoder.encoder_load, encoder.holds_sessions) == ("E", 3, False)
    # and an unknown role is not stored
    worker_heartbeat(worker_id=encoder.pk, telemetry={"stage_role": "XYZ"})
    encoder.refresh_from_db()
    assert encoder.stage_role == "E"


def test_with_stage_placement_off_no_role_changes(settings):
    assert settings.STREAMSERVE["STAGE_PLACEMENT"] == "off"  # today's behaviour by default
    busy = worker("a")
    worker("b")
    stream_mix(executing(busy), chunks=40, prompts=3)
    scheduler_run(trigger="tick")
    assert not StagePlacement.objects.exists()
    assert not WorkerCommand.objects.filter(kind="set_role").exists()
    assert set(GpuWorker.objects.values_list("stage_role", flat=True)) == {"EDC"}


def test_the_bootstrap_plan_is_applied_one_worker_at_a_time_through_the_answers(stages_on):
    # given a busy EDC worker and two idle D workers, and a stream mix with prompts to encode
    busy, b, c = worker("w-a"), worker("w-b", "D"), worker("w-c", "D")
    stream_mix(executing(busy), chunks=40, prompts=2)
    # when the scheduler runs
    scheduler_run(trigger="tick")
    # then Alg. 2 planned one encoder and two whole pipelines: the busy worker keeps its role
    placement = StagePlacement.objects.get()
    assert placement.reason == "bootstrap" and placement.status == "applying"
    assert placement.roles_after == {"w-a": "EDC", "w-b": "E", "w-c": "EDC"}
    assert placement.trigger["plan_roles"] == {"E": 1, "EDC": 2}
    assert placement.trigger["mix"]["stream_chunks"] == 40 and placement.trigger["mix"]["stream_encodes"] == 3
    first, second = placement.changes.order_by("order")
    assert (first.worker_id, first.from_role, first.to_role, first.status) == (b.pk, "D", "E", Change.SENT)
    assert second.status == Change.PLANNED
    assert WorkerCommand.objects.get(pk=first.command_id).payload["role"] == "E"
    # and a second run sends nothing more while that change is unanswered (one at a time)
    scheduler_run(trigger="tick")
    assert WorkerCommand.objects.filter(kind="set_role").count() == 1
    # when the worker acknowledges, the role is recorded and the next change goes out on the next run
    answer(first, "acked", role="E", load_ms=950.0)
    first.refresh_from_db()
    b.refresh_from_db()
    assert (first.status, first.load_ms, b.stage_role) == (Change.APPLIED, 950.0, "E")
    scheduler_run(trigger="tick")
    second.refresh_from_db()
    assert second.status == Change.SENT and second.worker_id == c.pk
    # when that worker refuses, the placement ends partial with the worker's reason
    answer(second, "refused", reason="a resident session needs D")
    second.refresh_from_db()
    placement.refresh_from_db()
    c.refresh_from_db()
    assert (second.status, second.reason) == (Change.REFUSED, "a resident session needs D")
    assert placement.status == "partial" and placement.finished_at is not None
    assert c.stage_role == "D"
    # and with nothing new in the mix, later runs plan nothing (the trigger sees no backlog)
    scheduler_run(trigger="tick")
    assert StagePlacement.objects.count() == 1


def test_a_change_left_unanswered_past_the_timeout_fails_and_the_next_one_is_sent(stages_on):
    busy = worker("w-a")
    worker("w-b", "D"), worker("w-c", "D")
    stream_mix(executing(busy), chunks=40, prompts=2)
    scheduler_run(trigger="tick")
    first, second = StagePlacement.objects.get().changes.order_by("order")
    # the liveness check times the command out (no answer within COMMAND_TIMEOUT_S)
    WorkerCommand.objects.filter(pk=first.command_id).update(status=WorkerCommand.Status.TIMED_OUT)
    scheduler_run(trigger="tick")
    first.refresh_from_db()
    second.refresh_from_db()
    assert first.status == Change.FAILED and "timeout" in first.reason
    assert second.status == Change.SENT


def test_the_trigger_replaces_on_a_stage_skew_with_a_backlog_only(stages_on):
    # given a pool already placed (bootstrap done) as two whole pipelines
    a, b = worker("w-a"), worker("w-b")
    SchedulerState.objects.create(policy="stages@tiny", state={"bootstrapped": True, "trigger": {}})
    now = timezone.now()
    session = executing(a)
    stream_mix(session, chunks=10, prompts=30)
    for _ in range(30):  # 30 prompt encodes completed in the window, no diffuse or decode op
        WorkerCommand.objects.create(
            id=uuid.uuid4(), worker=a, kind="prompt", status="acked", created_at=now, answered_at=now
        )
    # when there is no backlog, the skew alone does not re-place
    scheduler_run(trigger="tick")
    assert not StagePlacement.objects.exists()
    # when a job waits, the skew (E fast, D and C idle) fires and Alg. 2 re-plans from the mix
    JobFactory(deadline=now + timedelta(minutes=5))
    scheduler_run(trigger="tick")
    placement = StagePlacement.objects.get()
    assert placement.reason == "skew"
    assert placement.trigger["throughputs_per_s"]["E"] == pytest.approx(30 / 60.0)
    assert placement.trigger["throughputs_per_s"]["D"] == 0.0 and placement.trigger["backlog"] >= 1
    # the idle worker becomes the encoder, the busy one keeps its sessions' stages
    assert placement.roles_after == {"w-a": "EDC", "w-b": "E"}
    assert placement.changes.get().worker_id == b.pk


def test_sessions_are_never_placed_on_an_encoder_and_get_the_least_loaded_one():
    # given a DC worker and three encoders: one in another region, two local with different queues
    # (roles as the workers reported them; the planner need not be on)
    east = Region.objects.create(name="east")
    dc = worker("dc", "DC")
    worker("e-east", "E", region=east, telemetry={"encoder": {"queue": 0}})
    worker("e-busy", "E", telemetry={"encoder": {"queue": 5}})
    worker("e-idle", "E", telemetry={"encoder": {"queue": 1}})
    sessions = [SessionFactory(activity="active", last_active_at=timezone.now()) for _ in range(3)]
    # when they become active
    for session in sessions:
        scheduler_run(trigger="active", session_id=str(session.pk))
    # then no session runs on an encoder: all went to the only worker with the diffusion model
    encoders = GpuWorker.objects.filter(stage_role="E")
    assert not WorkerCommand.objects.filter(worker__in=encoders).exists()
    assert set(GenerationSession.objects.values_list("worker__name", flat=True)) == {"dc"}
    # and each start names the least-loaded encoder of the worker's own region
    starts = WorkerCommand.objects.filter(worker=dc, kind="start")
    assert [s.payload["encoder"] for s in starts] == [{"worker": "e-idle", "address": "e-idle:29500"}] * 3
    # and so does a later prompt
    placed = sessions[0]
    prompt = Prompt.objects.create(session=placed, text="a storm at sea", from_chunk=3)
    prompt_forward(session_id=str(placed.pk), prompt_id=prompt.pk)
    sent = WorkerCommand.objects.get(worker=dc, kind="prompt")
    assert sent.payload["encoder"]["worker"] == "e-idle" and sent.payload["text"] == "a storm at sea"


def test_an_edc_worker_gets_no_encoder_field():
    edc = worker("edc")
    session = SessionFactory(activity="active", last_active_at=timezone.now())
    scheduler_run(trigger="active", session_id=str(session.pk))
    assert "encoder" not in WorkerCommand.objects.get(worker=edc, kind="start").payload


def test_a_session_waits_with_a_reason_when_no_encoder_is_ready():
    # given only a DC worker: nobody can encode its prompts
    dc = worker("dc", "DC")
    worker("e-loading", "E", status="provisioning", ready_at=None)
    session = SessionFactory(activity="active", last_active_at=timezone.now())
    # when it becomes active
    decisions = scheduler_run(trigger="active", session_id=str(session.pk))
    # then it is not started (no command the worker would refuse) and the decision says why
    session.refresh_from_db()
    assert session.status == Status.QUEUED and session.worker_id is None
    assert not WorkerCommand.objects.filter(worker=dc, kind="start").exists()
    reason = SchedulerDecision.objects.get(pk=decisions[0]).inputs["waiting_for_encoder"][str(session.pk)]
    assert reason.startswith("waiting for an encoder: no ready E worker serves tiny to dc")


def test_a_prompt_to_a_worker_without_encoder_is_still_sent_for_the_worker_to_refuse():
    dc = worker("dc", "DC")
    session = executing(dc)
    prompt = Prompt.objects.create(session=session, text="fog", from_chunk=1)
    prompt_forward(session_id=str(session.pk), prompt_id=prompt.pk)
    assert "encoder" not in WorkerCommand.objects.get(worker=dc, kind="prompt").payload


def _placement_with_changes() -> StagePlacement:
    now = timezone.now()
    a, b = worker("w-a"), worker("w-b")
    placement = StagePlacement.objects.create(
        created_at=now - timedelta(minutes=5),
        preset="tiny",
        reason="skew",
        status="partial",
        finished_at=now,
        roles_before={"w-a": "EDC", "w-b": "EDC"},
        roles_after={"w-a": "DC", "w-b": "E"},
        trigger={"throughputs_per_s": {"E": 0.5, "D": 0.1, "C": 0.1}, "backlog": 2},
    )
    StageRoleChange.objects.create(
        placement=placement, worker=b, from_role="EDC", to_role="E", order=0, status="applied",
        load_ms=12.0, created_at=now, sent_at=now, answered_at=now,
    )  # fmt: skip
    StageRoleChange.objects.create(
        placement=placement, worker=a, from_role="EDC", to_role="DC", order=1, status="refused",
        reason="a resident session needs E", created_at=now, sent_at=now, answered_at=now,
    )  # fmt: skip
    return placement


def test_the_placement_audit_answers_json_and_csv(staff_api, user_api):
    placement = _placement_with_changes()
    assert user_api.get("/api/audit/placements/").status_code == 403
    report = staff_api.get("/api/audit/placements/").json()
    assert report["totals"] == {
        "placements": 1,
        "by_status": {"partial": 1},
        "changes_by_status": {"applied": 1, "refused": 1},
    }
    row = report["placements"][0]
    assert row["id"] == placement.pk and row["reason"] == "skew"
    assert [(c["worker"], c["from_role"], c["to_role"], c["status"]) for c in row["changes"]] == [
        ("w-b", "EDC", "E", "applied"),
        ("w-a", "EDC", "DC", "refused"),
    ]
    response = staff_api.get("/api/audit/placements/?format=csv")
    assert response["Content-Type"].startswith("text/csv")
    rows = list(csv.DictReader(io.StringIO(response.content.decode())))
    assert [(r["worker"], r["change_status"], r["throughput_e_per_s"]) for r in rows] == [
        ("w-b", "applied", "0.5"),
        ("w-a", "refused", "0.5"),
    ]
    assert rows[1]["change_reason"] == "a resident session needs E"
    assert staff_api.get("/api/audit/placements/?status=applied").json()["placements"] == []
    assert staff_api.get("/api/audit/placements/?preset=other").json()["placements"] == []
    bad = staff_api.get("/api/audit/placements/?status=bogus")
    assert bad.status_code == 400 and "status" in bad.json()
    assert "format" in staff_api.get("/api/audit/placements/?format=xml").json()


def test_the_console_shows_roles_and_placements_on_the_timeline():
    _placement_with_changes()
    worker("enc", "E", telemetry={"encoder": {"queue": 2, "served": 9}})
    snapshot = cluster_snapshot()
    roles = {w["name"]: (w["stage_role"], w["encoder"]) for w in snapshot["workers"]}
    assert roles["enc"] == ("E", {"queue": 2, "served": 9}) and roles["w-a"] == ("EDC", None)
    item = next(i for i in snapshot["timeline"] if i["kind"] == "placement")
    assert item["title"] == "Stage re-placement of tiny: 1/2 workers changed role (partial)"
    assert (
        "w-b EDC→E (applied)" in item["detail"]
        and "w-a EDC→DC (refused: a resident session needs E)" in item["detail"]
    )


def test_jobs_never_go_to_an_encoder_and_a_dc_workers_name_its_encoder():
    # given an encoder, a DC worker and one EDC worker, and four queued jobs
    worker("enc", "E")
    worker("dc", "DC")
    worker("edc")
    now = timezone.now()
    for _ in range(4):
        JobFactory(deadline=now + timedelta(minutes=5))
    # when the job dispatcher runs
    jobs_dispatch()
    # then the jobs run on the diffusion workers only, and a DC worker's job_run names the encoder
    runs = list(WorkerCommand.objects.filter(kind="job_run").select_related("worker"))
    assert runs and {c.worker.name for c in runs} <= {"dc", "edc"}
    for command in runs:
        expected = {"worker": "enc", "address": "enc:29500"} if command.worker.name == "dc" else None
        assert command.payload.get("encoder") == expected


def test_the_workers_api_shows_and_filters_by_stage_role(staff_api):
    worker("enc", "E")
    worker("edc")
    listed = staff_api.get("/api/workers/?stage_role=E").json()["results"]
    assert [(w["name"], w["stage_role"]) for w in listed] == [("enc", "E")]


def test_a_worker_dropping_its_encoder_is_told_which_one_to_use(stages_on):
    # given a placement in progress that turns a whole-pipeline worker into DC, with an encoder ready
    dc_to_be = worker("w-a")
    worker("enc", "E")
    now = timezone.now()
    placement = StagePlacement.objects.create(
        created_at=now, preset="tiny", reason="skew", roles_before={"w-a": "EDC"}, roles_after={"w-a": "DC"}
    )
    change = StageRoleChange.objects.create(
        placement=placement, worker=dc_to_be, from_role="EDC", to_role="DC", order=0, created_at=now
    )
    # when the scheduler runs
    scheduler_run(trigger="tick")
    # then the set_role names the role and the encoder its sessions' prompts go to
    change.refresh_from_db()
    payload = WorkerCommand.objects.get(pk=change.command_id).payload
    assert (payload["kind"], payload["role"]) == ("set_role", "DC")
    assert payload["encoder"] == {"worker": "enc", "address": "enc:29500"}


def test_registration_takes_the_role_the_worker_was_started_with():
    registered = worker_register(
        name="enc-1", host="h", device="cpu", preset="tiny", gpu_type="cpu", capacity=4, memory_bytes=0,
        migration_address="h:29500", stage_role="E",
    )  # fmt: skip
    assert (registered.stage_role, registered.status) == ("E", GpuWorker.Status.READY)
    with pytest.raises(ValueError, match="stage_role"):
        worker_register(
            name="bad", host="h", device="cpu", preset="tiny", gpu_type="cpu", capacity=4, memory_bytes=0,
            migration_address="h:1", stage_role="XD",
        )  # fmt: skip


def test_a_job_no_worker_can_take_fires_the_trigger_without_a_skew(stages_on):
    # given a pool placed as one busy DC worker without an encoder, a D and a C worker: no worker
    # can take a job (and none can be spared to become an encoder)
    busy = worker("w-a", "DC")
    worker("w-b", "D")
    worker("w-c", "C")
    SchedulerState.objects.create(policy="stages@tiny", state={"bootstrapped": True, "trigger": {}})
    stream_mix(executing(busy), chunks=40, prompts=0)
    # when a job is queued (no stage op completed: no skew to see)
    JobFactory(deadline=timezone.now() + timedelta(minutes=5))
    scheduler_run(trigger="tick")
    # then the trigger fires for it and Alg. 2 brings a whole pipeline back
    placement = StagePlacement.objects.get()
    assert placement.reason == "unserved" and placement.trigger["unserved_jobs"] == 1
    assert "EDC" in placement.roles_after.values()


def test_jobs_that_prefer_a_decode_auxiliary_get_ed_and_c_workers_while_streams_keep_edc(stages_on):
    # given four EDC workers, one holding a stream of 832×480 12-frame chunks, and queued one-shot
    # jobs of the same size (Alg. 2 prefers ED + C for them: their best decode degree is 2)
    busy = worker("w-a")
    for name in ("w-b", "w-c", "w-d"):
        worker(name)
    session = executing(busy, width=832, height=480, frames_per_chunk=12)
    stream_mix(session, chunks=40, prompts=1)
    for _ in range(10):
        JobFactory(kind="video", width=832, height=480, frames=12, steps=4)
    # when the scheduler runs
    scheduler_run(trigger="tick")
    # then the jobs' share is unfolded into ED and C workers, the streams' share stays on EDC (the
    # session holder keeps its role): no D-only or ED worker for chunks no session could use
    placement = StagePlacement.objects.get()
    assert placement.trigger["mix"]["stream_chunks"] == 40 and placement.trigger["mix"]["jobs"] == 10
    plan = placement.trigger["plan_roles"]
    assert plan.get("ED", 0) >= 1 and plan.get("C", 0) >= 1 and plan.get("EDC", 0) >= 1
    assert sum(plan.values()) == 4 and placement.roles_after["w-a"] == "EDC"
    assert set(placement.changes.values_list("to_role", flat=True)) <= {"ED", "C", "E", "D"}


def test_an_idle_encoder_the_plan_does_not_need_is_re_placed_one_at_a_time(stages_on):
    # given three EDC workers (one holding a stream) and two encoders, the first still encoding
    busy = worker("w-a")
    worker("w-b")
    worker("w-c")
    worker("enc-a", "E", telemetry={"encoder": {"queue": 2}})
    worker("enc-b", "E", telemetry={"encoder": {"queue": 0}})
    stream_mix(executing(busy), chunks=40, prompts=1)
    # when the scheduler runs
    scheduler_run(trigger="tick")
    # then the plan needs one encoder: the idle one is re-placed (alone), the busy one stays
    placement = StagePlacement.objects.get(reason="aux_shrink")
    assert placement.trigger["plan_roles"].get("E", 0) == 1
    (change,) = placement.changes.all()
    assert (change.worker.name, change.from_role, change.to_role, change.status) == (
        "enc-b",
        "E",
        "EDC",
        Change.SENT,
    )
    assert WorkerCommand.objects.get(pk=change.command_id).payload["role"] == "EDC"
    # and no second shrink is planned within the window, even once it is applied
    answer(change, "acked", role="EDC")
    scheduler_run(trigger="tick")
    assert StagePlacement.objects.filter(reason="aux_shrink").count() == 1


def test_the_last_encoder_and_the_last_decoder_stay_while_workers_depend_on_them(stages_on):
    # given a DC worker holding a stream and a D worker, one encoder (idle), and two decoders: one
    # idle, one decoding
    dc = worker("dc", "DC")
    worker("d", "D")
    worker("e", "E", telemetry={"encoder": {"queue": 0}})
    worker("c1", "C", telemetry={"decoder": {"queue": 0}})
    worker("c2", "C", telemetry={"decoder": {"queue": 3}})
    stream_mix(executing(dc), chunks=40, prompts=0)
    # when the scheduler runs (no job in the mix: the plan wants no decoder)
    scheduler_run(trigger="tick")
    # then only the idle decoder is re-placed: the decoding one stays, and so does the only encoder
    placement = StagePlacement.objects.get(reason="aux_shrink")
    assert placement.trigger["plan_roles"].get("C", 0) == 0
    (change,) = placement.changes.all()
    assert (change.worker.name, change.from_role) == ("c1", "C") and "D" in change.to_role
    # and once c1 is gone, c2 is the D worker's last decoder: it stays, busy or idle
    answer(change, "acked", role=change.to_role)
    GpuWorker.objects.filter(name="c2").update(telemetry={"decoder": {"queue": 0}})
    SchedulerState.objects.filter(policy="stages@tiny").update(state={})
    StagePlacement.objects.update(status="applied")
    scheduler_run(trigger="tick")
    assert StagePlacement.objects.filter(reason="aux_shrink").count() == 1
    assert set(GpuWorker.objects.filter(name__in=["e", "c2"]).values_list("stage_role", flat=True)) == {
        "E",
        "C",
    }


def test_an_encoder_pool_grown_recently_is_not_shrunk(stages_on):
    # given the same surplus encoder, but the pool grew its encoders a window ago
    busy = worker("w-a")
    worker("w-b")
    worker("enc-a", "E")
    worker("enc-b", "E")
    stream_mix(executing(busy), chunks=40, prompts=1)
    window = stages_on.STREAMSERVE["STAGE_WINDOW_S"]
    grown = (timezone.now() - timedelta(seconds=window)).timestamp()
    SchedulerState.objects.create(policy="stages@tiny", state={"encoder_pool_at": grown})
    # when the scheduler runs, no encoder is re-placed by the shrink
    scheduler_run(trigger="tick")
    assert not StagePlacement.objects.filter(reason="aux_shrink").exists()
