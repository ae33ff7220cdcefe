"""The runtime's CUDA paths, checked byte for byte (issue 28).

``pytest -m cuda`` selects the CUDA cases; they skip without a CUDA device. The GPU check
(``make gpu-check``) runs them on the GPU machine with ``--noconftest`` (the suite's root conftest
imports Django, which that machine does not have), so nothing here may use a conftest fixture or
Django. The same tests run on the CPU in the normal suite, so their logic cannot rot between the
rare runs on a GPU.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import pytest
import torch

from workers.runtime.accel import GpuPaths
from workers.runtime.engine import ChunkEngine
from workers.runtime.models import build_model
from workers.runtime.transport import MigrationListener, send_state

HAS_CUDA = torch.cuda.is_available()
DEVICES = [
    pytest.param("cpu", id="cpu"),
    pytest.param(
        "cuda", id="cuda", marks=[pytest.mark.cuda, pytest.mark.skipif(not HAS_CUDA, reason="no CUDA device")]
    ),
]
PROMPTS = ("a red fox running through snow", "waves at dusk", "a robot in the city at night")
TIMEOUT_S = 60.0

_models: dict[tuple[str, str | None], torch.nn.Module] = {}


def tiny(device: str, dtype: str | None = None):
    """One `tiny` model per (device, dtype) for the module (no conftest fixture: see the docstring)."""
    key = (device, dtype)
    if key not in _models:
        _models[key] = build_model("tiny", device=device, dtype=dtype)
    return _models[key]


@contextlib.contextmanager
def engines(model, count: int, **kwargs) -> Iterator[list[ChunkEngine]]:
    made = [ChunkEngine(model, encode_workers=1, **kwargs) for _ in range(count)]
    try:
        yield made
    finally:
        for engine in made:
            engine.close()


def region_bytes(engine: ChunkEngine, session_id: str) -> dict[str, bytes]:
    """The session's state tensors as raw bytes (bit-exact: NaN payloads and signed zeros count)."""
    _, tensors = engine.export_state(session_id)
    engine.thaw(session_id)
    return {
        name: t.detach().contiguous().reshape(-1).view(torch.uint8).cpu().numpy().tobytes()
        for name, t in tensors.items()
    }


OFFLOAD_PATHS = [
    pytest.param(GpuPaths(), id="side-stream-pinned"),
    pytest.param(GpuPaths(offload_side_stream=False), id="default-stream-pinned"),
    pytest.param(GpuPaths(offload_pinned=False), id="side-stream-pageable"),
]


@pytest.mark.parametrize("paths", OFFLOAD_PATHS)
@pytest.mark.parametrize("device", DEVICES)
def test_offload_and_resume_are_byte_exact(device, paths):
    # given a session two chunks in, and a twin that is never suspended
    model = tiny(device)
    with engines(model, 1, gpu_paths=paths) as (engine,), engines(model, 1) as (twin,):
        for e in (engine, twin):
            e.add_session("s", PROMPTS[0], seed=7)
            e.step(due=["s"])
            e.step(due=["s"])
        before = region_bytes(engine, "s")
        # when it is suspended to host memory and resumed
        record = engine.suspend("s")
        assert record.pinned == (device == "cuda" and paths.offload_pinned)
        if record.pinned:
            assert record.region is not None and record.region.is_pinned()
        engine.resume("s", record)
        # then the state is the same bytes, and the next chunk is the twin's
        assert region_bytes(engine, "s") == before
        (resumed,) = engine.step(due=["s"])
        (uninterrupted,) = twin.step(due=["s"])
        assert torch.equal(resumed.rgb, uninterrupted.rgb)
        assert region_bytes(engine, "s") == region_bytes(twin, "s")


@pytest.mark.parametrize("device", DEVICES)
def test_batched_step_matches_the_sessions_stepped_one_at_a_time(device):
    # given three sessions at different stream positions (young ring next to full and wrapped ones)
    model = tiny(device)
    ids = ["s0", "s1", "s2"]
    with engines(model, 2, max_batch=4) as (batched, single):
        for i, sid in enumerate(ids):
            for e in (batched, single):
                e.add_session(sid, PROMPTS[i], seed=i)
            for _ in range(3 * (len(ids) - i)):
                batched.step(due=ids[: i + 1])
                for present in ids[: i + 1]:
                    single.step(due=[present])
        # when both run one more chunk: all three in one batch, or each alone
        together = {r.session_id: r for r in batched.step(due=ids)}
        alone = {sid: single.step(due=[sid])[0] for sid in ids}
        # then the chunks and states agree up to the rounding of a different summation order
        tolerance = 1e-3 if device == "cuda" else 1e-4
        for sid in ids:
            assert together[sid].chunk_index == alone[sid].chunk_index
            diff = (together[sid].rgb.int() - alone[sid].rgb.int()).abs().max().item()
            assert diff <= 2, f"{sid}: frames differ by {diff}"
            _, a = batched.export_state(sid)
            _, b = single.export_state(sid)
            for name in a:
                torch.testing.assert_close(a[name], b[name], rtol=tolerance, atol=tolerance, msg=name)


@pytest.mark.parametrize("device", DEVICES)
def test_state_moved_through_host_memory_over_gloo_is_byte_exact(device):
    # given a session on the device, frozen for migration at a chunk boundary
    model = tiny(device)
    with engines(model, 2) as (source, target):
        source.add_session("s", PROMPTS[1], seed=11)
        source.step(due=["s"])
        source.step(due=["s"])
        manifest, tensors = source.export_state("s")
        # when its region is staged to host memory (Gloo moves CPU tensors), sent over Gloo and
        # installed on the device of another engine
        staged = {name: t.to("cpu") for name, t in tensors.items()}
        arrived: dict[str, object] = {}
        listener = MigrationListener("cpu")
        try:
            receiving = listener.receive_in_background(
                TIMEOUT_S, lambda m, t: arrived.update(manifest=m, tensors=t), session_id="s", epoch=1
            )
            send_state(
                listener.address, manifest, staged, device="cpu", timeout_s=TIMEOUT_S, session_id="s", epoch=1
            )
            receiving.result(TIMEOUT_S)
        finally:
            listener.close()
        target.import_state("s", arrived["manifest"], arrived["tensors"], copy=True)
        # then the target holds the same bytes on the device, and both continue identically
        assert all(t.device == model.device for t in target.export_state("s")[1].values())
        target.thaw("s")
        assert region_bytes(target, "s") == region_bytes(source, "s")
        source.thaw("s")
        (there,) = target.step(due=["s"])
        (here,) = source.step(due=["s"])
        assert torch.equal(there.rgb, here.rgb)


@pytest.mark.cuda
@pytest.mark.skipif(not HAS_CUDA, reason="no CUDA device")
def test_nvml_telemetry_reads_memory_utilisation_and_power():
    from gpu import telemetry

    # when a sample is taken on a machine with an NVIDIA GPU
    sample = telemetry.sample()
    # then NVML answered with the device's figures
    assert sample["nvml"] is True, sample.get("reason")
    device = sample["devices"][0]
    assert device["memory_total_bytes"] and device["memory_total_bytes"] > 0
    assert device["memory_used_bytes"] is not None
    assert device["utilization_pct"] is not None
    assert device["power_w"] is not None and device["power_w"] > 0


GPU_PATHS = [
    pytest.param(GpuPaths(cuda_graphs=True), id="cuda-graphs"),
    pytest.param(GpuPaths(flash_attention=True), id="flash-attention"),
]


@pytest.mark.parametrize("paths", GPU_PATHS)
@pytest.mark.parametrize("device", DEVICES)
def test_a_gpu_path_gives_the_chunks_of_the_default_path(device, paths):
    from workers.runtime.accel import Accelerator

    # given one session twice on a half-precision model (flash attention takes fp16/bf16 only),
    # one copy stepped with the path on, the other with the defaults
    model = tiny(device, "bfloat16")
    default, chosen = Accelerator(device, GpuPaths()), Accelerator(device, paths)
    with engines(model, 2) as (plain, accelerated):
        for e in (plain, accelerated):
            e.add_session("s", PROMPTS[2], seed=5)
        try:
            # when both run past the point where the KV window is full (the fixed-shape steady state)
            for _ in range(7):
                model.accel = default
                (a,) = plain.step(due=["s"])
                model.accel = chosen
                (b,) = accelerated.step(due=["s"])
                # then every chunk agrees up to bf16 rounding of another kernel's summation order
                diff = (a.rgb.int() - b.rgb.int()).abs().max().item()
                assert diff <= 4, f"chunk {a.chunk_index}: frames differ by {diff}"
        finally:
            model.accel = Accelerator(device)
        if device == "cuda" and paths.cuda_graphs:
            # the steady-state blocks were captured once and replayed since
            assert chosen.graphs is not None and chosen.graphs.captures > 0
            assert chosen.graphs.replays > chosen.graphs.captures
        if device == "cpu":
            assert chosen.active == dict.fromkeys(paths.as_dict(), False)
