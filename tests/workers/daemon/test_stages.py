"""The daemon's stage role (``workers.daemon.stages``) on the tiny model's real `StageHost`, without
Redis, processes or a stage service: which sessions and jobs a role takes, and ``set_role``'s and
``set_encoder``'s refusals and answers."""

from __future__ import annotations

import queue

import pytest
import torch

from workers.daemon.answers import CommandRefused
from workers.daemon.jobs import JobRunner
from workers.daemon.stages import StageRole
from workers.daemon.streams import Streams
from workers.ports import Reporter
from workers.runtime.engine import ChunkEngine
from workers.runtime.models import build_model
from workers.runtime.stages.host import StageHost
from workers.runtime.stages.staged_model import staged_engine_model

torch.set_num_threads(1)


class Publisher:
    superseded: queue.Queue = queue.Queue()

    def submit(self, *args) -> None: ...

    def codecs_of(self, session_ids) -> dict:
        return {}

    def forget(self, session_id) -> None: ...


@pytest.fixture
def make_role():
    made: list[tuple[ChunkEngine, JobRunner, StageHost]] = []

    def factory(role: str = "EDC") -> StageRole:
        model = build_model("tiny", device="cpu") if role == "EDC" else staged_engine_model("tiny", role)
        engine = ChunkEngine(model, encode_workers=1)
        host = StageHost(engine)
        jobs = JobRunner(engine=engine, reporter=Reporter(), worker_name="w1", capacity=2, clock=lambda: 0.0)
        streams = Streams(
            name="w1",
            engine=engine,
            publisher=Publisher(),
            capacity=2,
            clock=lambda: 0.0,
            leaving=set(),  # type: ignore[arg-type]
        )
        made.append((engine, jobs, host))
        return StageRole(name="w1", host=host, streams=streams, jobs=jobs)

    yield factory
    for engine, jobs, host in made:
        jobs.close()
        host.close()
        engine.close()


def test_a_monolithic_worker_takes_sessions_and_jobs_and_encodes_its_own_prompts(make_role):
    role = make_role("EDC")
    role.for_sessions({"kind": "start", "session": "s"})
    role.for_job({"kind": "job_run", "job": "j"})
    with pytest.raises(CommandRefused, match="role EDC encodes its own prompts"):
        role.set_encoder({"kind": "set_encoder", "encoder": {"worker": "e1", "address": "127.0.0.1:1"}})


def test_a_diffusion_worker_needs_an_encoder_named_for_its_sessions_and_jobs(make_role):
    role = make_role("DC")
    with pytest.raises(CommandRefused, match=r"encoder: required for role DC"):
        role.for_sessions({"kind": "start", "session": "s"})
    with pytest.raises(CommandRefused, match=r"encoder: required for role DC"):
        role.for_job({"kind": "job_run", "job": "j"})


def test_a_job_worker_refuses_sessions_and_a_d_worker_needs_its_stage_workers(make_role):
    role = make_role("D")
    with pytest.raises(CommandRefused, match="role D runs one-shot jobs only"):
        role.for_sessions({"kind": "start", "session": "s"})
    with pytest.raises(CommandRefused, match=r"encoder: required for role D"):
        role.for_job({"kind": "job_run", "job": "j"})
    with pytest.raises(CommandRefused, match=r"decoder: required for role D"):
        role.use_decoder({"kind": "job_run", "job": "j"})


def test_set_role_is_refused_while_migrations_are_in_flight_or_jobs_need_the_dropped_stages(make_role):
    role = make_role("EDC")
    with pytest.raises(CommandRefused, match=r"^2 migration\(s\) in flight$"):
        role.set_role({"kind": "set_role", "role": "DC"}, in_flight=2)
    role.jobs.jobs["j"] = object()  # type: ignore[assignment]
    with pytest.raises(CommandRefused, match=r"1 job\(s\) on w1 need diffuse and decode, which role E drops"):
        role.set_role({"kind": "set_role", "role": "E"}, in_flight=0)
    role.jobs.jobs.clear()
    with pytest.raises(CommandRefused, match="XYZ"):
        role.set_role({"kind": "set_role", "role": "XYZ"}, in_flight=0)
    with pytest.raises(CommandRefused, match=r"encoder: required"):
        role.set_role({"kind": "set_role", "role": "DC", "encoder": {"worker": "e1"}}, in_flight=0)
    assert role.host.role == "EDC"


def test_set_role_refuses_a_role_that_drops_a_held_sessions_stages_and_changes_role_otherwise(make_role):
    role = make_role("EDC")
    role.streams.start({"session": "s", "epoch": 1, "seed": 3, "prompts": [[0, "a heron"]]})
    with pytest.raises(CommandRefused, match=r"session s .*role ED drops"):
        role.set_role({"kind": "set_role", "role": "ED"}, in_flight=0)
    role.streams.forget("s")
    # Without sessions the worker drops its encoder, and the answer says so
    answer = role.set_role({"kind": "set_role", "role": "DC"}, in_flight=0)
    assert answer["ok"] and answer["role"] == "DC" and answer["dropped"] == "E" and answer["loaded"] == ""
    assert role.host.role == "DC" and role.host.needs_encoder
