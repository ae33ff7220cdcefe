"""In-process tests of the migration transport: wire plan, local validation, and the protocol run
between two threads of one process (each side still builds its own Gloo pair group over TCP)."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from workers.runtime.transport import (
    ChecksumMismatch,
    ManifestError,
    MigrationListener,
    MigrationRejected,
    MigrationSender,
    MigrationTimeout,
    send_state,
    wire,
)

torch.set_num_threads(1)


def make_region(seed: int = 0) -> tuple[dict, dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    tensors = {
        "kv": torch.randn(64, 1000, generator=g),
        "prompt": torch.randn(3, 77, generator=g).to(torch.bfloat16),
        "positions": torch.arange(5, dtype=torch.int64) + seed,
        "rng": torch.randint(0, 256, (816,), dtype=torch.uint8, generator=g),
        "empty": torch.empty(0, 16),
        "step": torch.tensor(seed, dtype=torch.int64),
    }
    manifest = {
        "model": "tiny",
        "version": 1,
        "tensors": [{"name": k, "shape": list(v.shape), "dtype": str(v.dtype)} for k, v in tensors.items()],
        "meta": {"chunk_index": 7},
    }
    return manifest, tensors


def run_pair(send_kwargs: dict, receive_kwargs: dict, install=None):
    """Run send_state and receive in two threads; return (send outcome, receive outcome, installed)."""
    installed: dict = {}

    def default_install(manifest, tensors):
        installed.update(manifest=manifest, tensors=tensors)

    outcomes: dict = {}
    with MigrationListener("cpu") as listener:

        def target() -> None:
            try:
                outcomes["receive"] = listener.receive(10, install or default_install, **receive_kwargs)
            except Exception as exc:
                outcomes["receive"] = exc

        thread = threading.Thread(target=target, name="target")
        thread.start()
        try:
            outcomes["send"] = send_state(listener.address, device="cpu", timeout_s=10, **send_kwargs)
        except Exception as exc:
            outcomes["send"] = exc
        thread.join(15)
        assert not thread.is_alive()
    return outcomes["send"], outcomes["receive"], installed


def test_plan_covers_every_byte_once_and_packs_small_tensors():
    manifest, _ = make_region()
    specs = wire.tensor_specs(manifest)
    segments = wire.plan_segments(specs, pack_below=4096, segment_bytes=100_000)

    covered = {i: 0 for i in range(len(specs))}
    for segment in segments:
        assert segment.nbytes == sum(p.stop - p.start for p in segment.pieces)
        assert segment.nbytes <= 100_000
        for piece in segment.pieces:
            covered[piece.index] += piece.stop - piece.start
    assert covered == {i: spec.nbytes for i, spec in enumerate(specs)}
    # kv (256,000 B) is split in place; the four small non-empty tensors share one packed bucket.
    assert [s.packed for s in segments] == [False, False, False, True]
    assert len(segments[-1].pieces) == 4


def test_region_that_disagrees_with_its_manifest_is_refused_before_connecting():
    manifest, tensors = make_region()
    tensors["kv"] = tensors["kv"].double()

    with pytest.raises(ManifestError, match="kv"):
        send_state("127.0.0.1:1", manifest, tensors, device="cpu", timeout_s=1, session_id="s", epoch=1)


def test_unknown_dtype_in_manifest_is_a_manifest_error():
    manifest, _ = make_region()
    manifest["tensors"][0]["dtype"] = "float7"

    with pytest.raises(ManifestError, match="float7"):
        wire.tensor_specs(manifest)


def test_threads_round_trip_is_byte_exact_and_carries_epoch():
    manifest, tensors = make_region(seed=3)

    sent, received, installed = run_pair(
        dict(
            manifest=manifest,
            tensors=tensors,
            session_id="s-3",
            epoch=9,
            pack_below=4096,
            segment_bytes=65536,
        ),
        {},
    )

    assert not isinstance(sent, Exception), sent
    assert received.session_id == "s-3" and received.epoch == 9
    assert installed["manifest"]["meta"] == {"chunk_index": 7, "session_id": "s-3", "epoch": 9}
    for name, tensor in tensors.items():
        assert installed["tensors"][name].dtype == tensor.dtype
        assert torch.equal(installed["tensors"][name], tensor), name
    assert sent.nbytes == received.nbytes == sum(t.numel() * t.element_size() for t in tensors.values())
    assert "meta" not in manifest or "epoch" not in manifest["meta"]  # the caller's manifest is not mutated


def test_corrupted_bytes_fail_verification_on_both_sides(monkeypatch):
    manifest, tensors = make_region()
    original = wire.RunningChecksum.update

    def corrupting_update(self, index, data, start):
        # Simulate a bit flipped on the wire: the target checksums bytes that differ from the source's.
        if threading.current_thread().name == "target" and index == 0 and start == 0:
            data = data.clone()
            data[0] ^= 1
        original(self, index, data, start)

    monkeypatch.setattr(wire.RunningChecksum, "update", corrupting_update)
    installs = []

    sent, received, _ = run_pair(
        dict(manifest=manifest, tensors=tensors, session_id="s", epoch=1),
        {},
        install=lambda m, t: installs.append(m),
    )

    assert isinstance(sent, ChecksumMismatch) and isinstance(received, ChecksumMismatch)
    assert "kv" in str(received)
    assert installs == []


def test_a_receive_keyed_by_session_and_epoch_takes_only_its_own_source():
    manifest, tensors = make_region()
    installed: list = []
    with MigrationListener("cpu") as listener:
        future = listener.receive_in_background(
            10, lambda m, t: installed.append(m["meta"]), session_id="expected", epoch=2
        )
        for session_id, epoch in (("intruder", 2), ("expected", 1)):  # another session, a stale epoch
            with pytest.raises(MigrationTimeout) as caught:
                send_state(
                    listener.address,
                    manifest,
                    tensors,
                    device="cpu",
                    timeout_s=0.5,
                    session_id=session_id,
                    epoch=epoch,
                )
            assert caught.value.stage == "rendezvous"

        report = send_state(
            listener.address, manifest, tensors, device="cpu", timeout_s=10, session_id="expected", epoch=2
        )

        received = future.result(10)
    assert (report.session_id, report.epoch) == (received.session_id, received.epoch) == ("expected", 2)
    assert [(meta["session_id"], meta["epoch"]) for meta in installed] == [("expected", 2)]


def test_an_unkeyed_receive_leaves_alone_the_hello_a_keyed_receive_waits_for():
    manifest, tensors = make_region()
    with MigrationListener("cpu") as listener:
        keyed = listener.receive_in_background(10, lambda m, t: None, session_id="mine", epoch=1)
        deadline = time.monotonic() + 5
        while not listener._awaited and time.monotonic() < deadline:
            time.sleep(0.005)
        anyone = listener.receive_in_background(10, lambda m, t: None)
        reports = {}

        def send(session_id: str) -> None:
            reports[session_id] = send_state(
                listener.address,
                manifest,
                tensors,
                device="cpu",
                timeout_s=10,
                session_id=session_id,
                epoch=1,
            )

        mine = threading.Thread(target=send, args=("mine",))
        mine.start()  # its hello is queued first: the unkeyed receive must not take it
        time.sleep(0.2)
        send("other")
        mine.join(15)

        assert keyed.result(10).session_id == "mine"
        assert anyone.result(10).session_id == "other"
    assert sorted(reports) == ["mine", "other"]


def test_send_to_a_listener_nobody_serves_times_out():
    manifest, tensors = make_region()
    with MigrationListener("cpu") as listener, pytest.raises(MigrationTimeout) as caught:
        send_state(listener.address, manifest, tensors, device="cpu", timeout_s=0.5, session_id="s", epoch=1)
    assert caught.value.stage == "rendezvous"


def test_receive_without_a_source_times_out():
    with MigrationListener("cpu") as listener, pytest.raises(MigrationTimeout, match="no source"):
        listener.receive(0.3, lambda m, t: None)


def test_stale_hello_of_a_timed_out_source_is_skipped():
    manifest, tensors = make_region()
    with MigrationListener("cpu") as listener:
        with pytest.raises(MigrationTimeout):
            send_state(
                listener.address, manifest, tensors, device="cpu", timeout_s=0.3, session_id="old", epoch=1
            )

        future = listener.receive_in_background(10, lambda m, t: None)
        report = send_state(
            listener.address, manifest, tensors, device="cpu", timeout_s=10, session_id="new", epoch=2
        )

        assert report.session_id == "new"
        assert future.result(10).session_id == "new"


def migrate_with(sender: MigrationSender, listener: MigrationListener, session_id: str, install=None):
    manifest, tensors = make_region(seed=len(session_id))
    installed: dict = {}
    future = listener.receive_in_background(10, install or (lambda m, t: installed.update(t)))
    try:
        report = sender.send(
            listener.address, manifest, tensors, timeout_s=10, session_id=session_id, epoch=1
        )
    except Exception as exc:
        report = exc
    try:
        received = future.result(15)
    except Exception as exc:
        received = exc
    if not isinstance(report, Exception):
        assert all(torch.equal(installed[k], v) for k, v in tensors.items())
    return report, received


def test_sender_reuses_its_pair_group_for_the_next_migration_to_the_same_target():
    with MigrationListener("cpu") as listener, MigrationSender("cpu") as sender:
        first, _ = migrate_with(sender, listener, "one")
        second, received = migrate_with(sender, listener, "two")
        third, _ = migrate_with(sender, listener, "three")

    assert (first.reused_link, second.reused_link, third.reused_link) == (False, True, True)
    assert received.session_id == "two"


def test_link_the_target_already_dropped_is_replaced_transparently():
    with MigrationListener("cpu", link_idle_timeout_s=0) as listener, MigrationSender("cpu") as sender:
        migrate_with(sender, listener, "one")
        time.sleep(0.01)  # past the target's idle timeout: it closes the link at its next receive

        second, received = migrate_with(sender, listener, "two")

    assert second.reused_link is False and received.session_id == "two"


def test_failed_migration_discards_the_link_and_the_next_one_starts_clean():
    def refuse(manifest, tensors):
        raise ValueError("wrong model")

    with MigrationListener("cpu") as listener, MigrationSender("cpu") as sender:
        migrate_with(sender, listener, "one")
        refused, refused_there = migrate_with(sender, listener, "two", install=refuse)
        after, _ = migrate_with(sender, listener, "three")

    assert isinstance(refused, MigrationRejected) and isinstance(refused_there, MigrationRejected)
    assert after.reused_link is False


def test_two_sources_into_one_listener_at_once_each_land_intact():
    regions = {name: make_region(seed) for name, seed in (("left", 21), ("right", 22))}
    installed: dict = {}
    with MigrationListener("cpu") as listener:
        futures = [
            listener.receive_in_background(10, lambda m, t: installed.__setitem__(m["meta"]["session_id"], t))
            for _ in regions
        ]
        reports: dict = {}

        def source(name: str) -> None:
            manifest, tensors = regions[name]
            reports[name] = send_state(
                listener.address, manifest, tensors, device="cpu", timeout_s=10, session_id=name, epoch=1
            )

        threads = [threading.Thread(target=source, args=(name,)) for name in regions]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(15)
        received = sorted(future.result(15).session_id for future in futures)

    assert received == ["left", "right"] and sorted(reports) == ["left", "right"]
    for name, (_, tensors) in regions.items():
        assert all(torch.equal(installed[name][k], v) for k, v in tensors.items()), name


def test_sender_closes_links_idle_longer_than_its_timeout():
    with MigrationListener("cpu") as listener, MigrationSender("cpu", idle_timeout_s=1.0) as sender:
        migrate_with(sender, listener, "one")
        quick, _ = migrate_with(sender, listener, "two")
        time.sleep(1.2)
        late, received = migrate_with(sender, listener, "three")

    assert quick.reused_link is True
    assert late.reused_link is False and received.session_id == "three"


def test_one_shot_send_leaves_no_link_cached_on_the_target():
    manifest, tensors = make_region()
    with MigrationListener("cpu") as listener:
        future = listener.receive_in_background(10, lambda m, t: None)
        send_state(listener.address, manifest, tensors, device="cpu", timeout_s=10, session_id="s", epoch=1)
        future.result(10)

        assert listener._links == {}


def test_device_checksum_used_with_nccl_is_split_invariant_and_sees_swapped_bytes():
    # The CUDA path's position-weighted sum runs on any device; check its algebra here on CPU.
    data = torch.randint(0, 256, (100_003,), dtype=torch.uint8, generator=torch.Generator().manual_seed(5))
    whole = wire._weighted_sum(data, 0)
    pieces = wire._weighted_sum(data[:40_000], 0) + wire._weighted_sum(data[40_000:], 40_000)
    swapped = data.clone()
    swapped[[10, 11]] = swapped[[11, 10]]
    assert data[10] != data[11]

    assert torch.equal(whole, pieces)
    assert not torch.equal(wire._weighted_sum(swapped, 0), whole)


def test_a_source_that_stops_sending_is_cut_off_by_the_stall_timeout(monkeypatch):
    from workers.runtime.transport import migration

    def header_then_silence(group, job, deadline):
        header = migration._header(
            job.manifest_bytes.numel(), job.pack_below, job.segment_bytes, group.device
        )
        group.wait(group.isend(header), 5)
        group.wait(group.isend(job.manifest_bytes), 5)
        time.sleep(2)  # a peer that hangs with its connection open: Gloo cannot tell it from slow
        raise RuntimeError("simulated hang is over")

    monkeypatch.setattr(migration, "_send_region", header_then_silence)
    manifest, tensors = make_region()

    sent, received, installed = run_pair(
        dict(manifest=manifest, tensors=tensors, session_id="s", epoch=1), {"stall_timeout_s": 0.5}
    )

    assert isinstance(received, MigrationTimeout) and received.stage == "transfer"
    assert "receive of segment 0" in str(received) and "stall timeout" in str(received)
    assert isinstance(sent, Exception) and installed == {}
