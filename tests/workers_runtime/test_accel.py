"""The GPU paths' settings and selection logic (workers.runtime.accel), on the CPU: each path is
taken only on CUDA, and what decides it — settings, eligibility, graph keys — runs anywhere. Their
effect on a GPU is checked by tests/workers_runtime/test_cuda.py and measured by `make gpu-check`."""

from __future__ import annotations

import types

import pytest
import torch
import torch.nn.functional as F

from workers.runtime import accel
from workers.runtime.accel import Accelerator, GpuPaths


def test_settings_default_to_the_new_paths_off_and_the_offload_pair_on():
    assert GpuPaths.from_env({}) == GpuPaths(
        flash_attention=False,
        cuda_graphs=False,
        compile_blocks=False,
        offload_side_stream=True,
        offload_pinned=True,
    )


def test_settings_are_read_from_the_environment():
    paths = GpuPaths.from_env(
        {
            accel.ENV_SDPA_FLASH: "1",
            accel.ENV_CUDA_GRAPHS: "true",
            accel.ENV_COMPILE_BLOCKS: "on",
            accel.ENV_OFFLOAD_SIDE_STREAM: "0",
            accel.ENV_OFFLOAD_PINNED: "no",
        }
    )
    assert paths == GpuPaths(True, True, True, False, False)


def test_a_malformed_setting_fails_loudly_naming_the_variable():
    with pytest.raises(ValueError, match=accel.ENV_CUDA_GRAPHS):
        GpuPaths.from_env({accel.ENV_CUDA_GRAPHS: "maybe"})


def test_on_a_cpu_no_gpu_path_is_taken_whatever_the_settings_say():
    everything = GpuPaths(True, True, True, True, True)
    acc = Accelerator("cpu", everything)
    assert acc.active == dict.fromkeys(everything.as_dict(), False)
    assert acc.graphs is None
    assert accel.copy_stream(torch.device("cpu"), everything) is None
    assert accel.pin_host_buffers(torch.device("cpu"), everything) is False


def test_attention_on_a_cpu_is_plain_sdpa_with_or_without_a_mask():
    acc = Accelerator("cpu", GpuPaths(flash_attention=True))
    generator = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 3, 5, 8, generator=generator) for _ in range(3))
    mask = torch.rand(2, 1, 1, 5, generator=generator) > 0.3
    mask[..., 0] = True
    assert torch.equal(acc.attention(q, k, v), F.scaled_dot_product_attention(q, k, v))
    assert torch.equal(acc.attention(q, k, v, mask), F.scaled_dot_product_attention(q, k, v, attn_mask=mask))


def test_block_calls_run_eagerly_on_a_cpu_even_at_a_fixed_shape():
    acc = Accelerator("cpu", GpuPaths(cuda_graphs=True, compile_blocks=True))
    calls = []

    def block(module, x):
        calls.append(module)
        return (x + 1,)

    (out,) = acc.block(0, block, ("m", torch.zeros(2)), fixed_shape=True)
    assert torch.equal(out, torch.ones(2)) and calls == ["m"]


@pytest.mark.parametrize(
    ("device", "dtype", "mask", "head_dim", "eligible"),
    [
        ("cuda", torch.bfloat16, None, 128, True),
        ("cuda", torch.float16, None, 64, True),
        ("cuda", torch.float32, None, 128, False),  # flash takes half precision only
        ("cuda", torch.bfloat16, "mask", 128, False),  # a key mask (sessions at different fill levels)
        ("cuda", torch.bfloat16, None, 12, False),  # not a multiple of 8
        ("cuda", torch.bfloat16, None, 512, False),
        ("cpu", torch.bfloat16, None, 128, False),
    ],
)
def test_flash_is_chosen_only_where_its_kernel_takes_the_shapes(device, dtype, mask, head_dim, eligible):
    q = types.SimpleNamespace(is_cuda=device == "cuda", dtype=dtype, shape=(1, 12, 4680, head_dim))
    assert accel.flash_eligible(q, mask) is eligible


def block_fn(module, x, e, rope, cache):
    return (x,)


def test_graph_keys_share_a_slot_per_batch_shape_and_a_graph_per_block():
    def args(batch, module="block0"):
        x = torch.zeros(batch, 10, 4)
        return (
            module,
            x,
            torch.zeros(batch, 6, 4),
            (torch.zeros(batch, 10, 1, 2), torch.zeros(batch, 10, 1, 2)),
            None,
        )

    slot_b1, graph_b1_block0 = accel.graph_keys(0, block_fn, args(1))
    slot_b1_again, graph_b1_block1 = accel.graph_keys(1, block_fn, args(1, module="block1"))
    slot_b4, _ = accel.graph_keys(0, block_fn, args(4))
    # the same shapes (batch 1) share static buffers; each block has its own graph in them
    assert slot_b1 == slot_b1_again
    assert graph_b1_block0 != graph_b1_block1
    # another batch size is another slot: captured once per batch shape
    assert slot_b4 != slot_b1
    # RoPE's (cos, sin) pair counts as two tensor inputs
    assert len(slot_b1[2]) == 4


def test_an_engine_on_a_cpu_keeps_host_buffers_unpinned(tmp_path):
    from workers.runtime.engine import ChunkEngine
    from workers.runtime.models import build_model

    engine = ChunkEngine(build_model("tiny"), encode_workers=1, gpu_paths=GpuPaths(offload_pinned=True))
    try:
        engine.add_session("s", "waves", seed=0)
        record = engine.suspend("s")
        assert record.pinned is False
        engine.resume("s", record)
        assert engine.gpu_paths == GpuPaths(offload_pinned=True)
    finally:
        engine.close()


def test_a_graph_is_captured_with_its_own_block_and_the_slots_static_tensors():
    # given a slot first made by block 0's call, and block 5's call with other tensors
    block0, block5 = object(), object()
    first = (block0, torch.zeros(2, 3), (torch.zeros(2, 1), torch.zeros(2, 1)), None)
    statics, widths = accel._flatten(first)
    statics = [torch.empty_like(leaf) if isinstance(leaf, torch.Tensor) else leaf for leaf in statics]
    call = (block5, torch.ones(2, 3), (torch.ones(2, 1), torch.ones(2, 1)), None)
    leaves, _ = accel._flatten(call)
    # when block 5's graph is captured
    module, x, (cos, sin), mask = accel.capture_args(statics, leaves, widths)
    # then it runs block 5 (not the slot's first block) on the static tensors replays will read
    assert module is block5 and mask is None
    assert x is statics[1] and cos is statics[2] and sin is statics[3]
