"""Weights chains between real processes over real Gloo: forwarding, and every fallback.

Holders and forwarding receivers run in their own processes (killed, stopped or fed corrupt bytes
for real); the receiver under test runs in the test process. Links are paced (``link_mbps``) only
so that "mid-transfer" lasts long enough to act in; nothing here asserts a duration.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import time
from typing import Any

import pytest
import torch

from workers.runtime.models import build_model
from workers.runtime.weights import (
    PackedWeights,
    WeightsManifest,
    WeightsReceiver,
    WeightsUnavailable,
    chain_sources,
    pack_model,
    save_weights,
    weights_receive,
    weights_serve,
)

CONTEXT = mp.get_context("forkserver")
CONTEXT.set_forkserver_preload(["torch", "workers.runtime.weights", "workers.runtime.models.causal_dit"])
PIECE_BYTES = 64 << 10
SLOW_MBPS = 40.0  # tiny's 5.6 MB take about a second: time to kill or stop a holder mid-way
REPLY_TIMEOUT_S = 60.0


def reference_weights(seed: int = 0) -> PackedWeights:
    return PackedWeights.from_state_dict(
        "tiny", build_model("tiny", weights_seed=seed).net.state_dict(), piece_bytes=PIECE_BYTES
    )


def _process_main(role: str, options: dict[str, Any], replies: Any, commands: Any) -> None:
    torch.set_num_threads(1)
    if role == "holder":
        model = build_model("tiny", weights_seed=options.get("seed", 0))
        packed = pack_model(model, piece_bytes=PIECE_BYTES)
        corrupt = options.get("corrupt_block")
        if corrupt is not None:
            # Flip bytes the manifest was computed over: this holder serves corrupt weights.
            packed.buffers[corrupt][:16].bitwise_not_()
        server = weights_serve(packed, link_mbps=options.get("link_mbps"))
        replies.put(("address", server.address))
    else:  # a forwarding receiver in the middle of a chain
        manifest = WeightsManifest.from_json(options["manifest"])
        receiver = WeightsReceiver(manifest, link_mbps=options.get("link_mbps"))
        replies.put(("address", receiver.address))
        result = receiver.receive(options["sources"], timeout_s=60)
        replies.put(("done", {"source": result.source, "done_at": time.monotonic()}))
    commands.get()


class Process:
    def __init__(self, role: str, **options: Any) -> None:
        self.replies, self.commands = CONTEXT.Queue(), CONTEXT.Queue()
        self.process = CONTEXT.Process(
            target=_process_main, args=(role, options, self.replies, self.commands), daemon=True
        )
        self.process.start()
        kind, self.address = self.replies.get(timeout=REPLY_TIMEOUT_S)
        assert kind == "address"

    def signal(self, signum: int) -> None:
        os.kill(self.process.pid, signum)

    def stop(self) -> None:
        if self.process.is_alive():
            os.kill(self.process.pid, signal.SIGCONT)  # a stopped holder must run to exit
            self.commands.put("stop")
            self.process.join(timeout=5)
        if self.process.is_alive():
            self.process.kill()
            self.process.join(timeout=5)


@pytest.fixture
def spawn():
    started: list[Process] = []

    def start(role: str, **options: Any) -> Process:
        process = Process(role, **options)
        started.append(process)
        return process

    yield start
    for process in started:
        process.stop()


def when_past(fraction: float, action):
    """A progress callback that runs ``action`` once, when ``fraction`` of the bytes have arrived."""
    fired = []

    def progress(done: int, total: int) -> None:
        if not fired and done >= fraction * total:
            fired.append(done)
            action()

    return progress


def assert_identical(result, expected: PackedWeights) -> None:
    assert result.packed.manifest.weights_id == expected.manifest.weights_id
    for got, want in zip(result.packed.buffers, expected.buffers, strict=True):
        assert torch.equal(got, want)
    result.packed.verify()


def test_chain_forwards_while_receiving(spawn):
    # given a holder and a chain S → T1 → T2 on paced links (T1 in its own process)
    expected = reference_weights()
    source = spawn("holder", link_mbps=SLOW_MBPS)
    middle = spawn(
        "receiver", manifest=expected.manifest.dumps(), sources=[source.address], link_mbps=SLOW_MBPS
    )
    first_piece_at: list[float] = []
    # when T2 pulls along the chain
    with WeightsReceiver(expected.manifest, link_mbps=SLOW_MBPS) as receiver:
        result = receiver.receive(
            chain_sources([source.address, middle.address, receiver.address], 2),
            timeout_s=60,
            progress=lambda done, total: first_piece_at.append(time.monotonic()),
        )
        kind, middle_report = middle.replies.get(timeout=REPLY_TIMEOUT_S)
    # then every byte came from T1, bit-identical to the source's weights
    assert_identical(result, expected)
    assert result.source == middle.address
    assert result.bytes_by_source == {middle.address: expected.manifest.total_bytes}
    assert not result.fell_back
    assert kind == "done" and middle_report["source"] == source.address
    # and T2 had its first verified piece before T1 had its last: T1 forwarded while receiving
    assert first_piece_at[0] < middle_report["done_at"]


def test_killed_source_falls_back_and_resumes(spawn):
    # given a slow source that is killed a third of the way, and a second holder
    expected = reference_weights()
    doomed = spawn("holder", link_mbps=SLOW_MBPS)
    spare = spawn("holder")
    # when a receiver pulls from the doomed source first
    result = weights_receive(
        expected.manifest,
        sources=[doomed.address, spare.address],
        timeout_s=60,
        stall_timeout_s=5,
        progress=when_past(0.33, lambda: doomed.signal(signal.SIGKILL)),
    )
    # then it noticed, took only the missing pieces from the spare, and holds exact weights
    assert_identical(result, expected)
    failed, succeeded = result.attempts
    assert not failed["ok"] and failed["kind"] in {"WeightsSourceLost", "WeightsTimeout"}
    assert succeeded["ok"] and succeeded["source"] == spare.address
    assert 0 < result.bytes_by_source[doomed.address] < expected.manifest.total_bytes
    assert sum(result.bytes_by_source.values()) == expected.manifest.total_bytes
    assert result.fell_back


def test_killed_forwarder_sends_downstream_to_the_source(spawn):
    # given S → T1 → T2 where T1 dies while T2 is receiving from it
    expected = reference_weights()
    source = spawn("holder", link_mbps=SLOW_MBPS)
    middle = spawn(
        "receiver", manifest=expected.manifest.dumps(), sources=[source.address], link_mbps=SLOW_MBPS
    )
    result = weights_receive(
        expected.manifest,
        sources=chain_sources([source.address, middle.address, "unused"], 2),
        timeout_s=60,
        stall_timeout_s=5,
        progress=when_past(0.25, lambda: middle.signal(signal.SIGKILL)),
    )
    # then T2 completed from the chain's source with exact weights
    assert_identical(result, expected)
    assert [a["source"] for a in result.attempts] == [middle.address, source.address]
    assert not result.attempts[0]["ok"] and result.attempts[1]["ok"]


def test_corrupt_block_is_refused_and_fetched_elsewhere(spawn):
    # given a holder whose block 5 is corrupt in memory and a good holder
    expected = reference_weights()
    corrupt = spawn("holder", corrupt_block=5)
    good = spawn("holder")
    # when a receiver tries the corrupt one first
    result = weights_receive(expected.manifest, sources=[corrupt.address, good.address], timeout_s=60)
    # then the bad piece failed its checksum, the rest came from the good holder, nothing corrupt kept
    assert_identical(result, expected)
    assert result.attempts[0]["kind"] == "WeightsChecksumMismatch"
    assert result.attempts[0]["stage"] == "verify"
    before_block_5 = sum(b.nbytes for b in expected.manifest.blocks[:5])
    assert result.bytes_by_source[corrupt.address] == before_block_5


def test_stalled_source_times_out_and_disk_completes(spawn, tmp_path):
    # given a source that stops (SIGSTOP) mid-transfer, and the weights on local disk
    expected = reference_weights()
    path = tmp_path / "tiny.safetensors"
    save_weights(path, expected)
    stalled = spawn("holder", link_mbps=SLOW_MBPS)
    # when a receiver with a short stall timeout pulls from it
    result = weights_receive(
        expected.manifest,
        sources=[stalled.address],
        disk_path=path,
        timeout_s=60,
        stall_timeout_s=1.5,
        progress=when_past(0.4, lambda: stalled.signal(signal.SIGSTOP)),
    )
    # then the stall ended that source and the rest came from disk
    assert_identical(result, expected)
    assert result.attempts[0]["kind"] == "WeightsTimeout"
    assert result.attempts[1] == {"source": "disk", "ok": True, "bytes": result.bytes_by_source["disk"]}
    assert result.bytes_by_source["disk"] < expected.manifest.total_bytes


def test_source_with_other_weights_is_refused(spawn):
    expected = reference_weights()
    other = spawn("holder", seed=3)
    good = spawn("holder")
    result = weights_receive(expected.manifest, sources=[other.address, good.address], timeout_s=60)
    assert_identical(result, expected)
    assert result.attempts[0]["kind"] == "WeightsRefused"
    assert result.bytes_by_source == {good.address: expected.manifest.total_bytes}


def test_when_everything_fails_nothing_is_returned_and_downstream_fails_over(tmp_path):
    # given no live source and a corrupt disk file
    expected = reference_weights()
    path = tmp_path / "tiny.safetensors"
    save_weights(path, expected)
    raw = bytearray(path.read_bytes())
    raw[-5000] ^= 0xFF
    path.write_bytes(bytes(raw))
    dead = weights_serve(expected)
    dead_address = dead.address
    dead.close()
    # when a receiver (which also serves downstream) tries them all
    receiver = WeightsReceiver(expected.manifest)
    try:
        with pytest.raises(WeightsUnavailable) as failure:
            receiver.receive([dead_address], disk_path=path, timeout_s=30, connect_timeout_s=2)
        # then every attempt is recorded as failed, and its server will not hand out missing pieces
        assert [a["ok"] for a in failure.value.attempts] == [False, False]
        with pytest.raises(WeightsUnavailable):
            weights_receive(expected.manifest, sources=[receiver.address], timeout_s=30, stall_timeout_s=2)
    finally:
        receiver.close()


def served_records(server, count: int, timeout_s: float = 30.0) -> list[dict]:
    """The server's records once it has written ``count`` of them (or what it has at the timeout)."""
    deadline = time.monotonic() + timeout_s
    while len(server.served) < count and time.monotonic() < deadline:
        time.sleep(0.01)
    return list(server.served)


def test_disk_alone_and_concurrent_receivers_from_one_holder(tmp_path):
    expected = reference_weights()
    path = tmp_path / "tiny.safetensors"
    save_weights(path, expected)
    from_disk = weights_receive(expected.manifest, disk_path=path)
    assert_identical(from_disk, expected)
    assert from_disk.source == "disk"
    with weights_serve(expected) as server:
        results = [weights_receive(expected.manifest, sources=[server.address]) for _ in range(2)]
        for result in results:
            assert_identical(result, expected)
        # the server records a request once it has read the receiver's "done", after the receiver returned
        assert [record.get("ok") for record in served_records(server, 2)] == [True, True]
        # a receiver whose manifest cuts other pieces is refused (the cuts must agree on both sides)
        other_cut = PackedWeights.from_state_dict("tiny", expected.state_dict(), piece_bytes=PIECE_BYTES * 2)
        assert other_cut.manifest.weights_id == expected.manifest.weights_id
        with pytest.raises(WeightsUnavailable) as refused:
            weights_receive(other_cut.manifest, sources=[server.address])
        assert refused.value.attempts[0]["kind"] == "WeightsRefused"


def test_backends_are_negotiated_so_a_gpu_receiver_can_pull_from_a_cpu_host_cache():
    from workers.runtime.weights.transfer import negotiate_backend, wire_backends

    cpu, gpu = torch.device("cpu"), torch.device("cuda", 0)
    # a GPU side prefers NCCL and can fall back to Gloo through host staging; a CPU side has Gloo only
    assert wire_backends(gpu) == ["nccl", "gloo"]
    assert wire_backends(cpu) == ["gloo"]
    # GPU receiver ↔ GPU holder: NCCL; GPU receiver ↔ CPU host cache: Gloo (the receiver stages)
    assert negotiate_backend(wire_backends(gpu), gpu) == "nccl"
    assert negotiate_backend(wire_backends(gpu), cpu) == "gloo"
    # CPU receiver ↔ GPU holder: Gloo (the holder stages); nothing in common: refused
    assert negotiate_backend(wire_backends(cpu), gpu) == "gloo"
    assert negotiate_backend(["ucc"], cpu) is None
