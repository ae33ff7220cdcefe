"""The daemon's command door (``workers.daemon.commands``) without Redis or an engine: dispatch by
kind, one answer per command id, the checks several parts share, a claim's cost in its answer."""

from __future__ import annotations

import threading
from typing import Any

import pytest

from contracts.wire.channel import ReceivedCommand
from workers.daemon.answers import DEFERRED, Answers, CommandRefused
from workers.daemon.commands import CommandDispatcher
from workers.daemon.jobs import AbandonedStep, JobRefused
from workers.ports import Reporter
from workers.runtime.stages.clients import EncoderUnavailable


class Answered(Reporter):
    def __init__(self) -> None:
        self.answers: list[tuple[str, str, str, dict | None]] = []

    def answer(self, command: dict, status: str, reason: str = "", result: dict | None = None) -> None:
        self.answers.append((command.get("id", ""), status, reason, result))


class Reader:
    """The command stream: what `read` returns next, and the entries acknowledged."""

    def __init__(self) -> None:
        self.pending: list[ReceivedCommand] = []
        self.acked: list[str] = []
        self.last_id = "0-0"

    def send(self, **command: Any) -> None:
        self.pending.append(ReceivedCommand(f"{len(self.acked) + len(self.pending)}-0", command))

    def read(self, block_ms: int | None) -> list[ReceivedCommand]:
        out, self.pending = self.pending, []
        return out

    def ack(self, entry_id: str) -> None:
        self.acked.append(entry_id)


class Part:
    """A part of the daemon: records the calls it gets and answers with ``returns``."""

    def __init__(self, **attributes: Any) -> None:
        self.calls: list[tuple[str, tuple]] = []
        self.returns: dict[str, Any] = {}
        self.raises: dict[str, BaseException] = {}
        self.__dict__.update(attributes)

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)

        def call(*args: Any, **kwargs: Any) -> Any:
            self.calls.append((name, args + tuple(kwargs.values())))
            if name in self.raises:
                raise self.raises[name]
            return self.returns.get(name, {"part": name})

        return call


@pytest.fixture
def door():
    reporter, reader = Answered(), Reader()
    streams = Part(sessions={})
    jobs = Part(jobs={}, abandoned=None)
    stage_role = Part()
    migration = Part(outgoing={})
    dispatcher = CommandDispatcher(
        name="w1",
        reader=reader,  # type: ignore[arg-type]
        answers=Answers(reporter),
        streams=streams,  # type: ignore[arg-type]
        jobs=jobs,  # type: ignore[arg-type]
        stage_role=stage_role,  # type: ignore[arg-type]
        migration=migration,  # type: ignore[arg-type]
        stopping=threading.Event(),
    )
    return dispatcher, reader, reporter


def test_each_kind_goes_to_its_part_and_is_acked_with_its_result(door):
    dispatcher, reader, reporter = door
    # Given one command of each part's kinds
    reader.send(id="a", kind="suspend", session="s")
    reader.send(id="b", kind="job_pause", job="j", epoch=1)
    reader.send(id="c", kind="set_encoder", encoder={"worker": "e", "address": "x"})
    reader.send(id="d", kind="activate", session="s", epoch=2)
    # When the door applies them
    assert dispatcher.apply_pending(block_ms=None)
    # Then each part did its work and each command got its result as the acked answer
    assert dispatcher.streams.calls[0][0] == "suspend"
    assert dispatcher.jobs.calls[0][0] == "pause"
    assert dispatcher.stage_role.calls[0][0] == "set_encoder"
    assert dispatcher.migration.calls[0][0] == "activate"
    assert reporter.answers == [
        ("a", "acked", "", {"part": "suspend"}),
        ("b", "acked", "", {"part": "pause"}),
        ("c", "acked", "", {"part": "set_encoder"}),
        ("d", "acked", "", {"part": "activate"}),
    ]
    assert reader.acked == ["0-0", "1-0", "2-0", "3-0"]


def test_an_unknown_kind_is_refused_and_acknowledged(door):
    dispatcher, reader, reporter = door
    reader.send(id="x", kind="reboot")
    reader.send(id="y", kind=["start"])
    dispatcher.apply_pending(block_ms=None)
    assert reporter.answers == [
        ("x", "refused", "unknown command kind 'reboot'", None),
        ("y", "refused", "unknown command kind ['start']", None),
    ]
    assert len(reader.acked) == 2


def test_a_command_read_again_is_acknowledged_without_being_applied_twice(door):
    dispatcher, reader, reporter = door
    reader.send(id="a", kind="stop", session="s")
    dispatcher.apply_pending(block_ms=None)
    # When the backlog brings the same command id again (a restart re-reads it)
    reader.send(id="a", kind="stop", session="s")
    dispatcher.apply_pending(block_ms=None)
    # Then it was applied and answered once, and acknowledged both times
    assert [c[0] for c in dispatcher.streams.calls] == ["stop"]
    assert len(reporter.answers) == 1 and len(reader.acked) == 2


def test_a_refusal_and_a_failure_are_answered_with_their_reason(door):
    dispatcher, reader, reporter = door
    dispatcher.streams.raises["resume"] = CommandRefused("stale epoch 1 < 2 for session s")
    dispatcher.jobs.raises["cancel"] = JobRefused("job j is not on worker w1")
    dispatcher.streams.raises["suspend"] = RuntimeError("device lost")
    reader.send(id="a", kind="resume", session="s", epoch=1)
    reader.send(id="b", kind="job_cancel", job="j", epoch=1)
    reader.send(id="c", kind="suspend", session="s")
    dispatcher.apply_pending(block_ms=None)
    assert reporter.answers == [
        ("a", "refused", "stale epoch 1 < 2 for session s", None),
        ("b", "refused", "job j is not on worker w1", None),
        ("c", "failed", "RuntimeError: device lost", None),
    ]


def test_a_deferred_command_is_acknowledged_but_answered_later(door):
    dispatcher, reader, reporter = door
    dispatcher.migration.returns["migrate_out"] = DEFERRED
    reader.send(id="m", kind="migrate_out", session="s", new_epoch=3, target_address="t")
    dispatcher.apply_pending(block_ms=None)
    assert reporter.answers == [] and reader.acked == ["0-0"]


def test_a_draining_worker_refuses_new_sessions_and_jobs_but_serves_the_rest(door):
    dispatcher, reader, reporter = door
    dispatcher.streams.sessions["s"] = object()
    reader.send(id="d", kind="drain")
    reader.send(id="a", kind="start", session="t", epoch=1, prompts=[[0, "x"]], seed=1)
    reader.send(id="b", kind="job_run", job="j", epoch=1)
    reader.send(id="c", kind="prompt", session="s", from_chunk=3, text="y")
    dispatcher.apply_pending(block_ms=None)
    assert reporter.answers[:3] == [
        ("d", "acked", "", {"resident": 1}),
        ("a", "refused", "worker w1 is draining", None),
        ("b", "refused", "worker w1 is draining", None),
    ]
    assert reporter.answers[3][:2] == ("c", "acked")
    # The refused start never reached the stage role nor the streams
    assert [c[0] for c in dispatcher.stage_role.calls] == ["for_sessions"]


def test_an_undrained_worker_admits_sessions_again(door):
    # The scheduler keeps a draining worker after all (scale-out undrains before it asks for GPUs):
    # the start it then sends must not be refused by a flag the control plane has already lifted.
    dispatcher, reader, reporter = door
    reader.send(id="d", kind="drain")
    reader.send(id="a", kind="start", session="t", epoch=1, prompts=[[0, "x"]], seed=1)
    reader.send(id="u", kind="undrain")
    reader.send(id="b", kind="start", session="t", epoch=2, prompts=[[0, "x"]], seed=1)
    dispatcher.apply_pending(block_ms=None)
    assert [(a[0], a[1]) for a in reporter.answers] == [
        ("d", "acked"),
        ("a", "refused"),
        ("u", "acked"),
        ("b", "acked"),
    ]
    assert [c[0] for c in dispatcher.stage_role.calls] == ["for_sessions"]


def test_a_prompt_is_checked_against_the_session_before_the_stage_role(door):
    dispatcher, reader, reporter = door
    dispatcher.streams.raises["owned"] = CommandRefused("session s is not on worker w1")
    reader.send(id="p", kind="prompt", session="s", from_chunk=1, text="y")
    dispatcher.apply_pending(block_ms=None)
    # No encoder is dialled for a session that is not here
    assert dispatcher.stage_role.calls == []
    assert reporter.answers == [("p", "refused", "session s is not on worker w1", None)]


def test_a_job_command_is_refused_while_the_job_migrates(door):
    dispatcher, reader, reporter = door
    dispatcher.migration.outgoing["j"] = object()
    for kind in ("job_pause", "job_resume", "job_cancel"):
        reader.send(id=kind, kind=kind, job="j", epoch=1)
    dispatcher.apply_pending(block_ms=None)
    assert [a[1:3] for a in reporter.answers] == [("refused", "job j is migrating")] * 3
    assert dispatcher.jobs.calls == []


def test_a_job_run_whose_stage_worker_is_unreachable_is_refused(door):
    dispatcher, reader, reporter = door
    dispatcher.jobs.raises["run"] = EncoderUnavailable("encoder e1 did not answer within 5.0s")
    reader.send(id="r", kind="job_run", job="j", epoch=1)
    dispatcher.apply_pending(block_ms=None)
    assert reporter.answers == [("r", "refused", "encoder e1 did not answer within 5.0s", None)]


def test_set_role_is_told_how_many_migrations_are_in_flight(door):
    dispatcher, reader, _ = door
    dispatcher.migration.returns["in_flight"] = 2
    reader.send(id="r", kind="set_role", role="DC")
    dispatcher.apply_pending(block_ms=None)
    assert dispatcher.stage_role.calls == [("set_role", ({"id": "r", "kind": "set_role", "role": "DC"}, 2))]


def test_the_stream_whose_claim_abandoned_a_job_step_is_told_what_it_cost(door):
    dispatcher, reader, reporter = door
    # Given a job step abandoned part-way for a stream's claim
    dispatcher.jobs.abandoned = AbandonedStep(jobs=["j"], lost_ms=12.3456)
    # When a command that does not claim the device, then the claiming start, are applied
    reader.send(id="p", kind="suspend", session="s")
    reader.send(id="s", kind="start", session="t", epoch=1)
    dispatcher.apply_pending(block_ms=None)
    # Then only the start's answer carries the cost, once
    assert reporter.answers[0] == ("p", "acked", "", {"part": "suspend"})
    assert reporter.answers[1][3] == {
        "part": "start",
        "job_step_abandoned": {"jobs": ["j"], "lost_ms": 12.346},
    }
    assert dispatcher.jobs.abandoned is None


def test_shutdown_is_refused_while_sessions_or_jobs_are_here_and_stops_the_loop_otherwise(door):
    dispatcher, reader, reporter = door
    dispatcher.jobs.jobs["j"] = object()
    reader.send(id="a", kind="shutdown")
    dispatcher.apply_pending(block_ms=None)
    assert reporter.answers[-1] == ("a", "refused", "1 job(s) still on w1", None)
    assert not dispatcher.stopping.is_set()
    dispatcher.jobs.jobs.clear()
    reader.send(id="b", kind="shutdown")
    dispatcher.apply_pending(block_ms=None)
    assert reporter.answers[-1] == ("b", "acked", "", {})
    assert dispatcher.stopping.is_set()
