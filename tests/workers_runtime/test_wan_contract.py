"""The model-contract tests of the built-in model, run on the Wan2.1-family adapter.

The engine tests of test_engine.py are collected here again with `tiny_model` bound to a tiny
random Wan checkpoint in the diffusers layout (the conftest's `make_engine` builds engines around
it), and the cross-process migration over the real transport (test_migration_engine.py) runs on a
preset registered from that directory, as `MODEL_PATHS` registers it. The tests that spell the
built-in model's own tensor names (`latent_history`) or preset name stay with it.
"""

from __future__ import annotations

import pytest

from contracts.catalog.local_paths import register_model_path
from contracts.catalog.presets import PRESETS
from tests.workers_runtime import test_engine as contract
from tests.workers_runtime.test_migration_engine import CONTEXT, EngineWorker, _engine_worker, chunk_digests
from tests.workers_runtime.wan_layouts import write_diffusers_layout
from workers.runtime.engine import ChunkEngine

pytestmark = pytest.mark.filterwarnings("ignore::FutureWarning")

PRESET = "wan-contract"
PROMPT, SEED = "a red fox running through snow", 7

test_suspend_resume_is_bit_identical = contract.test_suspend_resume_is_bit_identical
test_export_import_into_fresh_engine_is_bit_identical = (
    contract.test_export_import_into_fresh_engine_is_bit_identical
)
test_batched_with_other_sessions_is_close_to_alone = (
    contract.test_batched_with_other_sessions_is_close_to_alone
)
test_step_respects_max_batch_and_serves_least_recent_first = (
    contract.test_step_respects_max_batch_and_serves_least_recent_first
)
test_prompt_change_applies_from_the_given_chunk = contract.test_prompt_change_applies_from_the_given_chunk
test_state_bytes_round_trip_through_safetensors = contract.test_state_bytes_round_trip_through_safetensors
test_lifecycle_errors = contract.test_lifecycle_errors
test_start_chunk_sets_the_first_chunk_index = contract.test_start_chunk_sets_the_first_chunk_index
test_a_suspended_record_resumes_on_another_engine = contract.test_a_suspended_record_resumes_on_another_engine
test_a_bad_record_leaves_the_session_suspended = contract.test_a_bad_record_leaves_the_session_suspended
test_no_session_starves_when_more_are_due_than_k = contract.test_no_session_starves_when_more_are_due_than_k
test_adopted_tensors_without_a_flat_region_offload_and_continue_identically = (
    contract.test_adopted_tensors_without_a_flat_region_offload_and_continue_identically
)
test_same_batch_composition_is_bit_identical_across_suspend_and_import = (
    contract.test_same_batch_composition_is_bit_identical_across_suspend_and_import
)


@pytest.fixture(scope="module")
def wan_dir(tmp_path_factory):
    return write_diffusers_layout(tmp_path_factory.mktemp("wan-contract") / "Wan2.1-T2V-tiny-Diffusers")


@pytest.fixture(scope="module")
def wan_preset(wan_dir):
    register_model_path(PRESET, wan_dir)
    yield PRESET
    PRESETS.pop(PRESET, None)


@pytest.fixture(scope="module")
def tiny_model(wan_preset):
    """Overrides the conftest's built-in model for the contract tests collected in this module."""
    return ChunkEngine.from_preset(wan_preset, encode_workers=1).model


def test_the_contract_runs_on_the_wan_adapter(tiny_model):
    from workers.runtime.models.wan_causal import WanCausalModel

    assert isinstance(tiny_model, WanCausalModel) and tiny_model.preset == PRESET


def test_manifest_mismatch_is_rejected_and_leaves_session_intact(make_engine):
    source, target = make_engine(), make_engine()
    source.add_session("s", "mountains", seed=1)
    contract.run_chunks(source, "s", 2)
    manifest, tensors = source.export_state("s")
    corrupted = dict(tensors, **{"vae_cache.00": tensors["vae_cache.00"] + 1.0})
    for bad_manifest, bad_tensors, needle in [
        (dict(manifest, model="tiny"), tensors, "tiny"),
        (dict(manifest, tensors=manifest["tensors"][:-1]), tensors, "do not match"),
        (manifest, corrupted, "checksum"),
    ]:
        with pytest.raises(contract.StateManifestError, match=needle):
            target.import_state("s", bad_manifest, bad_tensors)
        assert target.sessions() == {}
    source.thaw("s")
    assert source.status("s") == "resident" and source.next_chunk("s") == 2
    assert len(source.step()) == 1


# -- migration between worker processes over the real transport ------------------------------------


def _wan_engine_worker(path: str, commands, replies) -> None:
    register_model_path(PRESET, path)  # as the worker's settings would (MODEL_PATHS)
    _engine_worker(PRESET, commands, replies)


class WanEngineWorker(EngineWorker):
    def __init__(self, path: str) -> None:
        self.commands, self.replies = CONTEXT.Queue(), CONTEXT.Queue()
        self.process = CONTEXT.Process(
            target=_wan_engine_worker, args=(path, self.commands, self.replies), daemon=True
        )
        self.process.start()
        self.address = self.expect("address")


@pytest.mark.timeout(300)
def test_migrated_wan_session_continues_bit_identically_on_the_target(wan_dir, wan_preset):
    engine = ChunkEngine.from_preset(wan_preset, encode_workers=1)
    try:
        engine.add_session("s", PROMPT, SEED)
        reference = chunk_digests(engine, "s", 4)
    finally:
        engine.close()
    source, target = WanEngineWorker(str(wan_dir)), WanEngineWorker(str(wan_dir))
    try:
        source.call("add", "added")
        before = source.call("step", "stepped", count=2)
        target.do("receive")
        migrated = source.call("migrate", "migrated", address=target.address, epoch=1)
        received = target.expect("received")
        after = target.call("step", "stepped", count=2)
        assert migrated == {"ok": True} and received == {"ok": True, "epoch": 1}
        assert source.call("sessions", "sessions") == {}
        assert before + after == reference
    finally:
        source.stop()
        target.stop()


def test_profile_and_bench_run_on_the_registered_preset(wan_preset, tiny_model):
    from scheduling.core.gpu_profiles import profile_from_json
    from workers.benchmarks import runtime

    profile, _ = runtime.profile_model(wan_preset, max_batch=2, steps=1)
    assert profile_from_json(profile).state_bytes == tiny_model.state_bytes_for()
    report = runtime.run_bench(wan_preset, batches=(1, 2), steps=1, offload_repeats=1, migration=False)
    assert [row["batch"] for row in report["coalescing"]] == [1, 2]
    assert report["model"]["preset"] == wan_preset and report["offload"][wan_preset]["state_bytes"] > 0
