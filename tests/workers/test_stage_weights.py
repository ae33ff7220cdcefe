"""Stage roles and the parameter pool (issue 15): dropping a stage frees its weights and takes the
worker out of the pool; a stage added at run time loads from a host cache or a peer that holds the
preset (real block transfers over Gloo), else from the local file."""

from __future__ import annotations

import gc
import io
import json
import weakref

import pytest
import torch
from django.core.management import call_command

from gpu.models import WeightHolding
from tests.factories import GpuWorkerFactory
from workers.adapters.pool import DjangoHostCacheLink, DjangoPoolLink
from workers.hostcache import HostCacheDaemon
from workers.runtime.engine import ChunkEngine
from workers.runtime.models import build_model
from workers.runtime.stages.contract import stage_weight_bytes
from workers.runtime.stages.host import StageHost
from workers.runtime.stages.staged_model import staged_engine_model
from workers.runtime.transport import MigrationListener
from workers.weights_loading import PooledCopy, StageWeightsFetcher, WeightsLoader, weights_file

pytestmark = pytest.mark.django_db(transaction=True)

PRESET = "tiny"


def loaded_worker(tmp_path):
    """A worker row whose EDC weights came from disk, served as a complete copy in the pool."""
    row = GpuWorkerFactory(model_preset=PRESET)
    link = DjangoPoolLink(row.pk, PRESET)
    weights = WeightsLoader(
        preset=PRESET, device="cpu", host="127.0.0.1", weights_from="disk", weights_dir=tmp_path, pool=link
    ).load()
    return row, link, weights


def fetcher(tmp_path, link):
    return StageWeightsFetcher(
        preset=PRESET, device="cpu", host="127.0.0.1", weights_dir=tmp_path, pool=link
    ).fetch


def test_dropping_a_stage_frees_its_weights_and_leaves_the_pool(tmp_path):
    # Given an EDC worker whose model views the packed copy it serves to the pool
    row, link, weights = loaded_worker(tmp_path)
    sizes = stage_weight_bytes(PRESET)
    text_blocks = [i for i, b in enumerate(weights.packed.manifest.blocks) if b.name.startswith("text.")]
    text_buffer = weakref.ref(weights.packed.buffers[text_blocks[0]])
    listener = MigrationListener()  # an E worker serves encodings at its store
    host = StageHost(
        ChunkEngine(weights.model, max_batch=1),
        store_address=listener.address,
        pool_copy=PooledCopy(weights, link),
        loader=fetcher(tmp_path, link),
    )
    assert WeightHolding.objects.filter(worker=row, state="complete").exists()
    try:
        # When it becomes DC
        result = host.set_role("DC", {})
        # then the encoder's bytes are gone from the resident weights, its buffers are freed,
        assert result["weights_bytes_before"] == sizes["E"] + sizes["D"] + sizes["C"]
        assert result["weights_bytes"] == sizes["D"] + sizes["C"]
        gc.collect()
        assert text_buffer() is None
        # and the partial copy is no longer offered to the pool.
        assert not WeightHolding.objects.filter(worker=row).exists()
        # When it becomes E, only the encoder's weights stay (loaded from the local file).
        result = host.set_role("E", {})
        assert result["weights_bytes"] == sizes["E"] and result["source"] == "local"
    finally:
        host.close()
        weights.close()
        listener.close()


def test_a_stage_added_at_run_time_comes_from_the_host_cache_or_a_peer(tmp_path):
    # Given a host cache holding the preset (filled from disk), and a DC worker
    cache = HostCacheDaemon(
        name="c1",
        host="127.0.0.1",
        models=[PRESET],
        capacity_bytes=64 << 20,
        weights_dir=str(tmp_path),
        pool=DjangoHostCacheLink(),
    )
    cache.start()
    reference = build_model(PRESET, device="cpu")
    try:
        assert cache.step() and cache.held[PRESET].source == "disk"
        row = GpuWorkerFactory(model_preset=PRESET)
        link = DjangoPoolLink(row.pk, PRESET)
        model = staged_engine_model(PRESET, "DC", weights_path=str(weights_file(tmp_path, PRESET)))
        host = StageHost(ChunkEngine(model, max_batch=1), loader=fetcher(tmp_path, link))
        # When it becomes EDC, the encoder's blocks come from the cache, byte for byte the preset's
        result = host.set_role("EDC", {})
        assert result["loaded"] == "E" and result["source"] == "host-cache", result
        assert f"c1: {sizes_e()} B" in result["source_detail"]
        for name, tensor in host.engine.model.net.text.state_dict().items():
            assert torch.equal(tensor, reference.net.text.state_dict()[name]), name
        host.set_role("DC", {})
        # and with a GPU peer listed first (the cache gone), from the peer.
        cache.shutdown()
        _peer, _link, peer_weights = loaded_worker(tmp_path)
        try:
            result = host.set_role("EDC", {})
            assert result["source"] == "peer", result
            for name, tensor in host.engine.model.net.text.state_dict().items():
                assert torch.equal(tensor, reference.net.text.state_dict()[name]), name
        finally:
            peer_weights.close()
        host.close()
    finally:
        cache.shutdown()


def sizes_e() -> int:
    return stage_weight_bytes(PRESET)["E"]


def test_bench_stage_reload_reports_the_freed_bytes_and_both_sources():
    out = io.StringIO()
    call_command("bench_stage_reload", "--repeats", "1", "--warmup", "0", "--json", stdout=out)
    report = json.loads(out.getvalue())
    sizes = stage_weight_bytes(PRESET)
    for label in ("local", "peer"):
        assert report[label]["edc_to_dc_weights_bytes"] == [sum(sizes.values()), sizes["D"] + sizes["C"]]
        assert report[label]["sources"] == [label] and report[label]["dc_to_edc_load_ms"]["count"] == 1
