"""The daemon's migration endpoint (``workers.daemon.migration``) on the tiny engine, with the
transfers' futures settled by the test instead of a peer: answers and reports of a transfer that
ended, arrivals installed frozen (or parked), and an ``activate`` that raced ahead of its arrival."""

from __future__ import annotations

import queue
from concurrent.futures import Future
from typing import Any

import pytest
import torch

from workers.daemon.answers import DEFERRED, Answers, CommandRefused
from workers.daemon.jobs import JobRunner
from workers.daemon.migration import MigrationEndpoint
from workers.daemon.stages import StageRole
from workers.daemon.streams import Streams
from workers.ports import Reporter
from workers.runtime.engine import ChunkEngine
from workers.runtime.models import build_model
from workers.runtime.stages.host import StageHost

torch.set_num_threads(1)


class Reports(Reporter):
    def __init__(self) -> None:
        self.seen: list[tuple[str, Any]] = []

    def answer(self, command: dict, status: str, reason: str = "", result: dict | None = None) -> None:
        self.seen.append(("answer", (command["id"], status, reason, result)))

    def migration_sent(self, command: dict, report: dict) -> None:
        self.seen.append(("migration_sent", command["id"]))

    def migration_failed(self, command: dict, error: str) -> None:
        self.seen.append(("migration_failed", (command["id"], error)))


class Publisher:
    def __init__(self) -> None:
        self.superseded: queue.Queue = queue.Queue()
        self.unsent: dict[str, int] = {}

    def submit(self, *args: Any) -> None: ...

    def codecs_of(self, session_ids) -> dict:
        return {}

    def forget(self, session_id) -> None: ...

    def queued(self, sid: str) -> int:
        return self.unsent.get(sid, 0)


class Listener:
    address = "127.0.0.1:29999"

    def __init__(self) -> None:
        self.futures: list[Future] = []

    def receive_in_background(self, timeout_s: float, install, *, session_id: str, epoch: int) -> Future:
        future: Future = Future()
        future.install = install  # type: ignore[attr-defined]
        self.futures.append(future)
        return future


class Report:
    nbytes, seconds = 1024, 0.01


@pytest.fixture(scope="module")
def model():
    return build_model("tiny", device="cpu")


@pytest.fixture
def make_endpoint(model):
    made: list[tuple[ChunkEngine, JobRunner]] = []

    def factory(listener: Any = None) -> MigrationEndpoint:
        engine = ChunkEngine(model, encode_workers=1)
        reporter = Reports()
        jobs = JobRunner(engine=engine, reporter=reporter, worker_name="w1", capacity=2, clock=lambda: 0.0)
        outgoing: dict[str, Future] = {}
        streams = Streams(
            name="w1",
            engine=engine,
            publisher=Publisher(),
            capacity=2,
            clock=lambda: 0.0,
            leaving=outgoing,  # type: ignore[arg-type]
        )
        role = StageRole(name="w1", host=StageHost(engine), streams=streams, jobs=jobs)
        made.append((engine, jobs))
        return MigrationEndpoint(
            name="w1",
            streams=streams,
            jobs=jobs,
            stage_role=role,
            answers=Answers(reporter),
            reporter=reporter,
            outgoing=outgoing,
            listener=listener,
        )

    yield factory
    for engine, jobs in made:
        jobs.close()
        engine.close()


def start(endpoint: MigrationEndpoint, sid: str) -> None:
    endpoint.streams.start({"session": sid, "epoch": 1, "seed": 5, "prompts": [[0, "a heron"]]})


def leaving(endpoint: MigrationEndpoint, sid: str, command_id: str) -> Future:
    """A session frozen for a transfer in flight, as ``migrate_out`` leaves it."""
    endpoint.engine.export_state(sid)
    future: Future = Future()
    future.command = {"id": command_id, "kind": "migrate_out", "session": sid, "new_epoch": 2}  # type: ignore[attr-defined]
    endpoint.outgoing[sid] = future
    return future


def test_a_verified_transfer_is_answered_once_every_chunk_before_it_was_sent_and_the_source_forgets(
    make_endpoint,
):
    endpoint = make_endpoint()
    start(endpoint, "s")
    future = leaving(endpoint, "s", "m1")
    assert not endpoint.streams.runnable(endpoint.streams.sessions["s"])
    future.set_result(Report())
    # While a chunk generated before the freeze is still unsent, nothing is answered
    endpoint.streams.publisher.unsent["s"] = 1
    assert not endpoint.collect_outgoing()
    endpoint.streams.publisher.unsent.clear()
    assert endpoint.collect_outgoing()
    assert endpoint.reporter.seen == [
        ("answer", ("m1", "acked", "", {"bytes": 1024, "seconds": 0.01})),
        ("migration_sent", "m1"),
    ]
    assert "s" not in endpoint.streams.sessions and "s" not in endpoint.engine.sessions()
    assert endpoint.in_flight() == 0


def test_a_failed_transfer_thaws_the_session_here_and_says_why(make_endpoint):
    endpoint = make_endpoint()
    start(endpoint, "s")
    future = leaving(endpoint, "s", "m1")
    future.set_exception(TimeoutError("target silent"))
    assert endpoint.collect_outgoing()
    assert endpoint.reporter.seen == [
        ("answer", ("m1", "failed", "TimeoutError: target silent", None)),
        ("migration_failed", ("m1", "TimeoutError: target silent")),
    ]
    assert endpoint.streams.runnable(endpoint.streams.sessions["s"])
    assert not endpoint.engine.is_frozen("s")


def test_migrate_out_refuses_a_session_already_leaving_and_defers_its_answer(make_endpoint, monkeypatch):
    endpoint = make_endpoint()
    start(endpoint, "s")
    monkeypatch.setattr("workers.daemon.migration.send_state", lambda *args, **kwargs: Report())
    command = {
        "id": "m1",
        "kind": "migrate_out",
        "session": "s",
        "epoch": 1,
        "new_epoch": 2,
        "target_address": "t",
    }
    assert endpoint.migrate_out(command) is DEFERRED
    with pytest.raises(CommandRefused, match="session s is already migrating"):
        endpoint.migrate_out(command | {"id": "m2"})
    endpoint.outgoing["s"].result(timeout=10)
    assert endpoint.collect_outgoing() and endpoint.reporter.seen[0][1][:2] == ("m1", "acked")


def test_migrate_in_needs_a_listener_and_a_session_not_here_yet(make_endpoint):
    command = {"id": "i", "kind": "migrate_in", "session": "s", "epoch": 2}
    with pytest.raises(CommandRefused, match="worker w1 has no migration listener"):
        make_endpoint().migrate_in(command)
    endpoint = make_endpoint(Listener())
    start(endpoint, "s")
    with pytest.raises(CommandRefused, match="session s is already on w1"):
        endpoint.migrate_in(command)


def test_an_arrival_is_installed_frozen_and_an_activate_that_came_first_applies_on_arrival(make_endpoint):
    source, target = make_endpoint(), make_endpoint(Listener())
    start(source, "s")
    source.engine.step(due=["s"])
    manifest, tensors = source.engine.export_state("s")
    manifest.setdefault("meta", {})["prompts"] = [[0, "a heron"]]
    # Given a migrate_in listening for the region
    assert target.migrate_in({"id": "i", "kind": "migrate_in", "session": "s", "epoch": 2}) == {
        "listening": Listener.address
    }
    assert target.in_flight() == 1
    # When the control plane's activate arrives before the region is installed
    assert target.activate({"id": "a", "kind": "activate", "session": "s", "epoch": 2}) == {"pending": True}
    # and the region arrives (verified against the model by the listener's install)
    (future,) = target.listener.futures
    future.install(manifest, tensors)
    future.set_result(None)
    assert target.collect_arrivals()
    # Then the session is here, active from its next chunk, with its prompt history
    owned = target.streams.sessions["s"]
    assert owned.active and owned.epoch == 2 and owned.prompts == [(0, "a heron")]
    assert target.engine.next_chunk("s") == 1 and target.in_flight() == 0
    assert target.streams.pending_activation == {}


def test_an_activate_for_a_session_neither_here_nor_arriving_is_refused(make_endpoint):
    endpoint = make_endpoint(Listener())
    with pytest.raises(CommandRefused, match="session s has not arrived on w1"):
        endpoint.activate({"id": "a", "kind": "activate", "session": "s", "epoch": 2})
