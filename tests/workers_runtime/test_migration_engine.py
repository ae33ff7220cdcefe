"""Migration of a real engine session between two worker processes (tiny preset, Gloo on CPU).

The chunk sequence must be bit-identical to an uninterrupted run on one engine (§6.1 + the issue's
determinism rule), and a region the target's model refuses must leave the session running on its
source.
"""

from __future__ import annotations

import hashlib
import multiprocessing as mp
import queue
from typing import Any

import pytest
import torch

from workers.runtime.engine import ChunkEngine
from workers.runtime.transport import MigrationError, MigrationListener, send_state

TIMEOUT_S = 30.0
PROMPT, SEED = "a red fox running through snow", 7
CONTEXT = mp.get_context("forkserver")
# Children fork from a server that has already imported torch: seconds saved per worker process.
CONTEXT.set_forkserver_preload(["torch", "workers.runtime.transport", "workers.runtime.engine"])


def chunk_digests(engine: ChunkEngine, session_id: str, count: int) -> list[str]:
    digests = []
    for _ in range(count):
        (result,) = engine.step(due=[session_id])
        digests.append(hashlib.sha256(result.rgb.contiguous().numpy().tobytes()).hexdigest())
    return digests


def _engine_worker(preset: str, commands: Any, replies: Any) -> None:
    torch.set_num_threads(1)
    engine = ChunkEngine.from_preset(preset, encode_workers=1)
    listener = MigrationListener(engine.device)
    replies.put(("address", listener.address))
    try:
        while True:
            command, args = commands.get()
            if command == "stop":
                return
            if command == "add":
                engine.add_session("s", PROMPT, SEED)
                replies.put(("added", True))
            elif command == "step":
                replies.put(("stepped", chunk_digests(engine, "s", args["count"])))
            elif command == "sessions":
                replies.put(("sessions", engine.sessions()))
            elif command == "receive":

                def install(manifest: dict, tensors: dict) -> None:
                    engine.import_state(manifest["meta"]["session_id"], manifest, tensors, copy=False)

                try:
                    report = listener.receive(TIMEOUT_S, install)
                    replies.put(("received", {"ok": True, "epoch": report.epoch}))
                except MigrationError as exc:
                    replies.put(("received", {"ok": False, "error": type(exc).__name__, "message": str(exc)}))
            elif command == "migrate":
                manifest, tensors = engine.export_state("s")  # §6.1 (i): frozen at a chunk boundary
                try:
                    send_state(
                        args["address"],
                        manifest,
                        tensors,
                        device=engine.device,
                        timeout_s=TIMEOUT_S,
                        session_id="s",
                        epoch=args["epoch"],
                    )
                except MigrationError as exc:
                    engine.thaw("s")  # the flip never happened: the session continues here
                    replies.put(("migrated", {"ok": False, "error": type(exc).__name__}))
                else:
                    engine.remove("s")  # (iii) ownership flipped to the target
                    replies.put(("migrated", {"ok": True}))
    finally:
        engine.close()


class EngineWorker:
    def __init__(self, preset: str = "tiny") -> None:
        self.commands, self.replies = CONTEXT.Queue(), CONTEXT.Queue()
        self.process = CONTEXT.Process(
            target=_engine_worker, args=(preset, self.commands, self.replies), daemon=True
        )
        self.process.start()
        self.address = self.expect("address")

    def do(self, command: str, **args: Any) -> None:
        self.commands.put((command, args))

    def expect(self, tag: str) -> Any:
        try:
            got, value = self.replies.get(timeout=TIMEOUT_S + 30)
        except queue.Empty:
            raise AssertionError(f"no {tag!r} from worker") from None
        assert got == tag, (got, value)
        return value

    def call(self, command: str, tag: str, **args: Any) -> Any:
        self.do(command, **args)
        return self.expect(tag)

    def stop(self) -> None:
        self.do("stop")
        self.process.join(20)
        if self.process.is_alive():
            self.process.kill()


@pytest.fixture(scope="module")
def reference_chunks() -> list[str]:
    engine = ChunkEngine.from_preset("tiny", encode_workers=1)
    try:
        engine.add_session("s", PROMPT, SEED)
        return chunk_digests(engine, "s", 4)
    finally:
        engine.close()


def test_migrated_session_continues_bit_identically_on_the_target(reference_chunks):
    source, target = EngineWorker(), EngineWorker()
    try:
        source.call("add", "added")
        before = source.call("step", "stepped", count=2)
        target.do("receive")

        migrated = source.call("migrate", "migrated", address=target.address, epoch=1)
        received = target.expect("received")
        after = target.call("step", "stepped", count=2)

        assert migrated == {"ok": True} and received == {"ok": True, "epoch": 1}
        assert source.call("sessions", "sessions") == {}
        assert before + after == reference_chunks
    finally:
        source.stop()
        target.stop()


def test_region_refused_by_the_target_model_leaves_the_session_running_on_its_source(reference_chunks):
    source, other_model = EngineWorker("tiny"), EngineWorker("small")
    try:
        source.call("add", "added")
        before = source.call("step", "stepped", count=2)
        other_model.do("receive")

        migrated = source.call("migrate", "migrated", address=other_model.address, epoch=1)
        received = other_model.expect("received")

        assert migrated == {"ok": False, "error": "MigrationRejected"}
        assert not received["ok"] and "this worker runs 'small'" in received["message"]
        assert other_model.call("sessions", "sessions") == {}
        after = source.call("step", "stepped", count=2)
        assert before + after == reference_chunks
    finally:
        source.stop()
        other_model.stop()
