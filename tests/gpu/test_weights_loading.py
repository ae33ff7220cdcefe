"""A starting worker's weights: disk, the plan's peer chain, the pool; recorded in the registry."""

from __future__ import annotations

import threading

import pytest
import torch

from gpu.models import GpuWorker, WeightHolding
from tests.factories import GpuWorkerFactory
from workers.adapters.pool import DjangoPoolLink
from workers.runtime.weights import WeightsUnavailable
from workers.weights_loading import DISK, INIT, PEER, WeightsLoader, weights_file

PRESET = "tiny"


def loader_for(worker: GpuWorker, weights_dir, weights_from: str) -> WeightsLoader:
    return WeightsLoader(
        preset=PRESET,
        device="cpu",
        host="127.0.0.1",
        weights_from=weights_from,
        weights_dir=weights_dir,
        pool=DjangoPoolLink(worker.pk, PRESET),
        timeout_s=60.0,
        upstream_wait_s=30.0,
    )


def block_checksums(packed) -> list[str]:
    """Each block's checksum recomputed from the bytes actually held (not read from the manifest)."""
    from workers.runtime.weights.manifest import checksum

    return [checksum(buffer) for buffer in packed.buffers]


@pytest.fixture
def closers():
    opened: list = []
    yield opened
    for loaded in opened:
        loaded.close()


@pytest.mark.django_db(transaction=True)
def test_disk_writes_the_seeded_file_once_then_reads_it(tmp_path, closers):
    # given no weights file yet
    first, second = GpuWorkerFactory(model_preset=PRESET), GpuWorkerFactory(model_preset=PRESET)
    # when two workers load from disk one after the other
    a = loader_for(first, tmp_path, "disk").load()
    b = loader_for(second, tmp_path, "disk").load()
    closers.extend([a, b])
    # then the first wrote the file from the seeded weights, the second read it, same bytes
    assert (a.source, b.source) == (INIT, DISK)
    assert weights_file(tmp_path, PRESET).exists()
    assert block_checksums(a.packed) == block_checksums(b.packed)
    # and both are complete sources in the pool, with the weights' digest
    holdings = WeightHolding.objects.filter(model_preset=PRESET, state="complete")
    assert {h.worker_id for h in holdings} == {first.pk, second.pk}
    assert {h.digest for h in holdings} == {a.packed.manifest.weights_id}
    assert all(h.address for h in holdings)


@pytest.mark.django_db(transaction=True)
def test_a_chain_of_two_receivers_gets_bit_identical_weights_from_the_peer(tmp_path, closers):
    # given a serving worker holding the weights (loaded from disk)
    source = GpuWorkerFactory(model_preset=PRESET)
    served = loader_for(source, tmp_path, "disk").load()
    closers.append(served)
    # and two new workers whose plan is the chain source → t1 → t2
    t1, t2 = (GpuWorkerFactory(model_preset=PRESET, status="provisioning", ready_at=None) for _ in range(2))
    chain = [source.name, t1.name, t2.name]
    for position, worker in ((1, t1), (2, t2)):
        worker.weights_plan = {
            "chain": chain,
            "position": position,
            "source_kind": "gpu",
            "source_address": served.address,
            "digest": served.packed.manifest.weights_id,
        }
        worker.save(update_fields=["weights_plan"])
    # when both load at once under "pool" (peers only: disk is not a fallback)
    results: dict[str, object] = {}

    def load(worker):
        from django.db import connection

        try:
            results[worker.name] = loader_for(worker, tmp_path, "pool").load()
        except Exception as exc:  # reported below
            results[worker.name] = exc
        finally:
            connection.close()

    threads = [threading.Thread(target=load, args=(w,)) for w in (t2, t1)]  # downstream starts first
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    loaded = [results[t1.name], results[t2.name]]
    assert all(not isinstance(r, Exception) for r in loaded), loaded
    closers.extend(loaded)
    # then both record a peer source, t2's bytes came from t1 (the chain), and every block's bytes
    # are identical to the source's
    assert [r.source for r in loaded] == [PEER, PEER]
    assert t1.name in loaded[1].bytes_by_source
    for r in loaded:
        assert block_checksums(r.packed) == block_checksums(served.packed)
        assert all(
            torch.equal(a, b)
            for a, b in zip(r.packed.state_dict().values(), served.packed.state_dict().values(), strict=True)
        )
    assert WeightHolding.objects.filter(model_preset=PRESET, state="complete").count() == 3


@pytest.mark.django_db(transaction=True)
def test_pool_without_any_source_fails_instead_of_serving_nothing(tmp_path):
    worker = GpuWorkerFactory(model_preset=PRESET, status="provisioning", ready_at=None)
    with pytest.raises(WeightsUnavailable):
        loader_for(worker, tmp_path, "pool").load()
    assert not WeightHolding.objects.filter(state="complete").exists()


@pytest.mark.django_db(transaction=True)
def test_auto_falls_back_to_disk_when_the_plan_source_is_gone(tmp_path, closers):
    # given a plan naming a source whose address no longer answers
    worker = GpuWorkerFactory(model_preset=PRESET, status="provisioning", ready_at=None)
    worker.weights_plan = {
        "chain": ["gone", worker.name],
        "position": 1,
        "source_kind": "gpu",
        "source_address": "127.0.0.1:1",
    }
    worker.save(update_fields=["weights_plan"])
    # when it loads under auto
    loaded = loader_for(worker, tmp_path, "auto").load()
    closers.append(loaded)
    # then it read its own storage, and the attempt on the dead source did not count as its source
    assert loaded.source in (DISK, INIT)
    assert WeightHolding.objects.get(worker=worker).state == "complete"


def test_unknown_weights_from_is_refused(tmp_path):
    with pytest.raises(ValueError, match="--weights-from"):
        WeightsLoader(
            preset=PRESET,
            device="cpu",
            host="127.0.0.1",
            weights_from="nvme",
            weights_dir=tmp_path,
            pool=None,  # type: ignore[arg-type]
        )


@pytest.mark.django_db(transaction=True)
def test_gpuworker_without_weights_fails_and_never_registers_ready(settings, tmp_path):
    from django.core.management import CommandError, call_command

    # given no copy anywhere in the pool and a worker told to take its weights from peers only
    settings.STREAMSERVE = {**settings.STREAMSERVE, "WEIGHTS_DIR": str(tmp_path)}
    # when it starts
    with pytest.raises(CommandError, match="weights unavailable"):
        call_command(
            "gpuworker", name="no-weights", preset=PRESET, device="cpu", weights_from="pool", heartbeat=0.5
        )
    # then its row records the process coming up, then failed, and it holds nothing in the pool
    worker = GpuWorker.objects.get(name="no-weights")
    assert worker.status == GpuWorker.Status.FAILED and worker.ready_at is None
    assert worker.process_up_at is not None and worker.weights_complete_at is None
    assert not WeightHolding.objects.filter(worker=worker).exists()


@pytest.mark.django_db(transaction=True)
def test_gpuworker_refuses_a_corrupt_weights_file(settings, tmp_path):
    from django.core.management import CommandError, call_command

    settings.STREAMSERVE = {**settings.STREAMSERVE, "WEIGHTS_DIR": str(tmp_path)}
    path = weights_file(tmp_path, PRESET)
    from workers.weights_loading import weights_file_ensure

    weights_file_ensure(path, PRESET)
    data = bytearray(path.read_bytes())
    data[-100] ^= 0xFF  # one flipped byte inside the last tensor
    path.write_bytes(bytes(data))
    with pytest.raises(CommandError, match="weights failed"):
        call_command(
            "gpuworker", name="corrupt", preset=PRESET, device="cpu", weights_from="disk", heartbeat=0.5
        )
    assert GpuWorker.objects.get(name="corrupt").status == GpuWorker.Status.FAILED
