"""The daemon's streams (``workers.daemon.streams``) on the tiny engine and a fake clock, without
Redis or threads: pacing and coalescing, silent catch-up, checkpoints under the publish lease, and a
session superseded by a newer owner."""

from __future__ import annotations

import queue
from pathlib import Path

import pytest
import torch

from contracts.wire.checkpoints import checkpoint_path
from workers.daemon.answers import CommandRefused
from workers.daemon.streams import Streams
from workers.runtime.engine import ChunkEngine, ChunkResult
from workers.runtime.models import build_model

torch.set_num_threads(1)


class Fence:
    def __init__(self) -> None:
        self.lost: set[str] = set()

    def holds(self, sid: str, epoch: int) -> bool:
        return sid not in self.lost


class Publisher:
    """What the streams hand the publisher thread: the chunks, in order."""

    def __init__(self) -> None:
        self.fence = Fence()
        self.submitted: list[tuple[str, int, int]] = []
        self.superseded: queue.Queue[tuple[str, int]] = queue.Queue()
        self.codecs: dict[str, frozenset[str]] = {}  # what the viewers of each session read
        self.forgotten: list[str] = []

    def submit(self, result: ChunkResult, epoch: int) -> None:
        self.submitted.append((result.session_id, result.chunk_index, epoch))

    def codecs_of(self, session_ids: list[str]) -> dict[str, frozenset[str]]:
        return {sid: self.codecs[sid] for sid in session_ids if sid in self.codecs}

    def forget(self, session_id: str) -> None:
        self.forgotten.append(session_id)

    def after(self, callback) -> None:
        callback()  # every chunk submitted before is "published" already


class Clock:
    def __init__(self, now: float) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


@pytest.fixture(scope="module")
def model():
    return build_model("tiny", device="cpu")


@pytest.fixture
def make_streams(model, tmp_path):
    engines: list[ChunkEngine] = []

    def factory(**kwargs) -> Streams:
        engine = ChunkEngine(model, encode_workers=1)
        engines.append(engine)
        kwargs.setdefault("capacity", 2)
        kwargs.setdefault("leaving", set())
        return Streams(name="w1", engine=engine, publisher=Publisher(), clock=Clock(100.0), **kwargs)  # type: ignore[arg-type]

    yield factory
    for engine in engines:
        engine.close()


def start(streams: Streams, sid: str, *, epoch: int = 1, **fields) -> dict:
    return streams.start({"session": sid, "epoch": epoch, "seed": 7, "prompts": [[0, "a heron"]], **fields})


def step(streams: Streams) -> list[ChunkResult]:
    """One turn of the hot loop's chunk side, when the next chunk is due (the clock moves there)."""
    runnable = [o.next_due for o in streams.sessions.values() if streams.runnable(o)]
    streams.clock.now = max(streams.clock.now, min(runnable))
    due = streams.due(streams.clock.now)
    assert due
    results = streams.generate(due)
    streams.deliver(results)
    return results


def test_a_new_session_is_due_at_once_and_then_one_chunk_period_after_the_last(make_streams):
    streams = make_streams()
    chunk_s = streams.chunk_s
    assert chunk_s == pytest.approx(0.5)  # 4 frames at 8 fps
    start(streams, "s")
    # Due now, with one chunk of look-ahead before the loop must be back for it
    assert streams.due(100.0) == ["s"]
    assert streams.earliest_due() == pytest.approx(100.0 - chunk_s)
    # What its next chunk needs of the device beside jobs: done half a chunk before it plays
    (demand,) = streams.demands()
    assert demand.finish_by == pytest.approx(100.0 - 0.5 * chunk_s)
    # When its first chunk is generated and delivered
    assert [r.chunk_index for r in step(streams)] == [0]
    # Then the next one is due one period later, and published with the session's epoch
    assert streams.sessions["s"].next_due == pytest.approx(100.0 + chunk_s)
    assert streams.publisher.submitted == [("s", 0, 1)]
    assert streams.chunk_generation_s > 0


def test_at_most_k_sessions_coalesce_earliest_first_and_none_that_is_parked_leaving_or_frozen(make_streams):
    leaving: set[str] = set()
    streams = make_streams(capacity=2, leaving=leaving)
    for i, sid in enumerate(["a", "b", "c", "d", "e"]):
        start(streams, sid)
        streams.sessions[sid].next_due = 100.0 + 0.01 * (5 - i)
    streams.suspend({"session": "a", "epoch": 1})
    leaving.add("b")
    streams.sessions["c"].active = False
    assert streams.due(100.0) == ["e", "d"]
    assert not streams.runnable(streams.sessions["a"]) and not streams.runnable(streams.sessions["b"])


def test_a_restarted_session_catches_up_silently_below_deliver_from(make_streams):
    streams = make_streams()
    start(streams, "s", deliver_from=2)
    # Chunk 0 runs unpaced (due again at once) and neither it nor chunk 1 is published again
    step(streams)
    assert streams.sessions["s"].next_due == streams.clock()
    step(streams)
    step(streams)
    assert streams.publisher.submitted == [("s", 2, 1)]


def test_checkpoints_are_written_every_n_chunks_only_while_this_worker_holds_the_lease(
    make_streams, tmp_path
):
    streams = make_streams(checkpoint_dir=tmp_path, checkpoint_every=2)
    start(streams, "s")
    target = checkpoint_path(Path(tmp_path), "s")
    step(streams)  # chunk 0: 0 - (-1) < 2
    assert not target.exists()
    step(streams)  # chunk 1: the checkpoint holds chunks 0 and 1
    assert target.exists() and streams.sessions["s"].last_checkpoint == 1
    written = target.read_bytes()
    # When another owner took the lease, a stale state never replaces its checkpoint
    streams.publisher.fence.lost.add("s")
    step(streams)
    step(streams)
    assert target.read_bytes() == written and streams.sessions["s"].last_checkpoint == 1
    assert not list(Path(tmp_path).glob("*.tmp"))


def test_a_session_restarts_from_its_checkpoint_where_it_left_off(make_streams, tmp_path):
    first = make_streams(checkpoint_dir=tmp_path, checkpoint_every=1)
    start(first, "s")
    for _ in range(3):
        step(first)
    second = make_streams()
    answer = start(second, "s", epoch=2, checkpoint=str(checkpoint_path(Path(tmp_path), "s")), deliver_from=3)
    assert answer == {"restored_from_chunk": 3, "next_chunk": 3}
    assert [r.chunk_index for r in step(second)] == [3]
    assert second.publisher.submitted == [("s", 3, 2)]


def test_a_session_superseded_by_a_newer_owner_is_forgotten_and_an_older_lease_changes_nothing(make_streams):
    streams = make_streams()
    start(streams, "s", epoch=3)
    start(streams, "t", epoch=3)
    streams.pending_activation["s"] = {"kind": "activate"}
    streams.publisher.superseded.put(("t", 2))  # older than ours: a later command gave it back
    streams.publisher.superseded.put(("s", 4))
    assert streams.collect_superseded()
    assert list(streams.sessions) == ["t"]
    assert "s" not in streams.engine.sessions() and "s" not in streams.pending_activation
    assert not streams.collect_superseded()


def test_session_commands_check_ownership_and_epochs(make_streams):
    streams = make_streams()
    with pytest.raises(CommandRefused, match="start needs the prompt history"):
        streams.start({"session": "s", "epoch": 1, "seed": 1, "prompts": []})
    start(streams, "s", epoch=2)
    assert start(streams, "s", epoch=3) == {"already": True} and streams.sessions["s"].epoch == 3
    with pytest.raises(CommandRefused, match="stale start"):
        start(streams, "s", epoch=1)
    with pytest.raises(CommandRefused, match="stale epoch 2 < 3 for session s"):
        streams.suspend({"session": "s", "epoch": 2})
    with pytest.raises(CommandRefused, match="session x is not on worker w1"):
        streams.owned({"session": "x"})
    # A prompt switch never lands on a chunk already generated
    step(streams)
    owned = streams.owned({"session": "s"}, epoch_check=False)
    assert streams.prompt(owned, {"from_chunk": 0, "text": "a crane"}) == {"from_chunk": 1}
    assert streams.stop({"session": "s"}) == {} and streams.stop({"session": "s"}) == {"already": True}


def test_suspend_parks_the_state_and_resume_brings_it_back_due_at_once(make_streams):
    streams = make_streams()
    start(streams, "s")
    step(streams)
    parked = streams.suspend({"session": "s", "epoch": 1})
    assert parked["bytes"] > 0 and streams.parked() == ["s"] and streams.resident() == []
    assert streams.due(1e9) == []
    streams.clock.now = 200.0
    assert streams.resume({"session": "s", "epoch": 2})["bytes"] > 0
    assert streams.due(200.0) == ["s"] and streams.sessions["s"].epoch == 2
    assert [r.chunk_index for r in step(streams)] == [1]


def test_each_chunk_is_encoded_once_in_the_codecs_its_viewers_read(make_streams):
    # Given three sessions: one watched as H.264, one as both, one whose viewers said nothing
    streams = make_streams(capacity=3)
    for sid in ("h", "both", "quiet"):
        start(streams, sid)
    streams.publisher.codecs = {"h": frozenset({"h264"}), "both": frozenset({"h264", "jpeg"})}
    # When a batch is generated
    results = {r.session_id: r.encoding(timeout=30) for r in step(streams)}
    # Then each carries exactly what its viewers read (JPEG when nobody said)
    assert (results["h"].frames, results["h"].fragment is not None) == ([], True)
    assert len(results["both"].frames) == 4 and results["both"].fragment is not None
    assert len(results["quiet"].frames) == 4 and results["quiet"].fragment is None
    assert results["h"].fragment.mime.startswith('video/mp4; codecs="avc1.')
    # And a session that leaves is forgotten by the publisher too
    streams.forget("h")
    assert streams.publisher.forgotten == ["h"]
