"""The Wan adapter through the stage registry (issue 15): a Wan preset (a checkpoint directory,
``MODEL_PATHS``) reaches `build_staged`, `stage_weight_bytes` and the stage worker processes."""

from __future__ import annotations

import pytest
import torch

from contracts.catalog.local_paths import register_model_path
from contracts.catalog.presets import PRESETS
from tests.workers_runtime.test_stages import STEPS, monolithic_frames, script_messages
from tests.workers_runtime.wan_layouts import write_diffusers_layout
from workers.runtime.models import build_model
from workers.runtime.stages.chain import StageChain
from workers.runtime.stages.contract import ROLES, build_staged, stage_weight_bytes
from workers.runtime.stages.pipeline import StageMessage
from workers.runtime.stages.wan_causal import WanCausalStages

pytestmark = pytest.mark.filterwarnings("ignore::FutureWarning")

PRESET = "wan-stages-test"


@pytest.fixture(scope="module")
def wan_preset(tmp_path_factory):
    root = write_diffusers_layout(tmp_path_factory.mktemp("wan") / "Wan2.1-T2V-tiny-Diffusers")
    register_model_path(PRESET, root)
    yield PRESET
    PRESETS.pop(PRESET, None)


def test_stage_weight_bytes_of_a_wan_preset_are_what_each_role_loads(wan_preset):
    # Given the analytic bytes per stage in the CPU dtype and in the GPU's (from the configs only),
    per_stage = WanCausalStages.stage_weight_bytes(wan_preset, dtype="float32")
    assert stage_weight_bytes(wan_preset) == WanCausalStages.stage_weight_bytes(wan_preset, dtype="bfloat16")
    assert sum(stage_weight_bytes(wan_preset).values()) < sum(per_stage.values())
    # when every role is built through the registry, then it holds exactly its stages' weights,
    for role in ROLES:
        staged = build_staged(wan_preset, role)
        assert isinstance(staged, WanCausalStages)
        assert staged.loaded_weight_bytes() == sum(per_stage[letter] for letter in role), role
    # and the three stages together are the monolithic model's weights.
    net = build_model(wan_preset, device="cpu").net
    full = [net.text_encoder, net.transformer, net.vae]
    assert sum(per_stage.values()) == sum(
        t.numel() * t.element_size() for part in full for t in (*part.parameters(), *part.buffers())
    )


def test_wan_worker_processes_stream_frames_bit_identical_to_generate(wan_preset):
    # Given E → D → C as three processes over Gloo, each registering the preset's directory itself,
    chain = StageChain(wan_preset, ["E", "D", "C"], timeout_s=60)
    sessions: list[str] = []
    try:
        # when the stream script (a late joiner, prompt switches with re-cache) runs through them,
        for step in range(STEPS):
            for message in script_messages(step, sessions):
                chain.send(message)
        received = [chain.recv() for _ in range(STEPS)]
        chain.send(StageMessage("close", {"session": "b"}))
        closed = chain.recv()
    finally:
        codes = chain.close()
    # then every chunk equals the monolithic model's bit for bit and every worker exits cleanly.
    want = monolithic_frames(build_model(wan_preset, device="cpu"))
    for step, (got, expected) in enumerate(zip(received, want, strict=True)):
        assert got.kind == "frames" and got.meta["chunks"][0] == step
        assert torch.equal(got.tensor, expected)
    assert closed.kind == "close"
    assert codes == [0, 0, 0]


@pytest.mark.django_db
def test_the_daemon_stage_roles_refuse_a_wan_preset_by_name(wan_preset):
    from django.core.management import CommandError, call_command  # Django only for this command test

    with pytest.raises(
        CommandError, match=r"--stages DC: preset 'wan-stages-test' loads from its checkpoint"
    ):
        call_command("gpuworker", name="wan-dc", preset=wan_preset, device="cpu", stages="DC")
