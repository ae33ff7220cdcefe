"""What the GPU check measures, one function per section (``run`` decides the order and the budget).

Every section takes the shared `CheckContext` and the section's ``figures`` dict to fill, and may
raise `SectionSkipped` with the reason it cannot run here. Timings on CUDA synchronise the device
around the timed call; p50/p99 are over measured steps after warm-up steps that run the same code.
"""

from __future__ import annotations

import functools
import importlib.metadata
import json
import os
import platform
import statistics
import subprocess
import sys
import time
import types
import xml.etree.ElementTree as ET
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from workers.benchmarks.gpucheck.report import Report, SectionSkipped, summarize_ms
from workers.benchmarks.profile import scheduler_profile
from workers.runtime.accel import Accelerator, GpuPaths, flash_eligible
from workers.runtime.engine import ChunkEngine
from workers.runtime.models.base import SessionState, region_offsets

GB = 1e9

# docs/models.md, "Memory" (Wan2.1-T2V-1.3B at 832×480, bfloat16, computed from the shapes).
DOCS_MODELS_MD_STATE = {
    "kv_cache": 3.45e9,
    "vae_cache": 1.89e9,
    "prompt_embeds_and_latent_window": 6.4e6,
    "total": 5.35e9,
}
# The scheduler's built-in H100 profile for a 1.3B model (scheduling/core/gpu_profiles.py, `h100-1.3b`:
# 525 + 55·load ms, K = 8): its default SLO is ℓ(K) + one stall = 965 + 70 ms. The test suite checks
# this constant against the profile itself.
H100_1_3B_SLO_MS = 1035.0
H100_1_3B_PRICE_PER_HOUR = 2.99
H100_1_3B_PROVISIONING_DELAY_S = 30.0
NVLINK_GBPS_NOMINAL = 150.0  # as profile_model assumes for an unmeasured peer link
PCIE_GBPS_NOMINAL = 25.0
TARGET_FPS_ONE_SESSION = 16.0
TARGET_ENGINE_OVERHEAD_PCT = 5.0
TARGET_OFFLOAD_VS_PLAIN = 0.70
TARGET_WALL_S = 480.0


def size(nbytes: float) -> str:
    """Bytes in the unit that reads best (decimal, as the docs' tables)."""
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if abs(nbytes) >= scale:
            return f"{nbytes / scale:.3g} {unit}"
    return f"{int(nbytes)} B"


PROMPTS = (
    "a red fox running through snow at dusk",
    "a robot walking through a quiet city street at night in the rain",
    "waves over a beach at dawn",
    "a storm over the sea",
)


@dataclass(frozen=True)
class Plan:
    """How much of each measurement: the GPU run's sizes, or the dry run's (seconds on a CPU)."""

    batches: tuple[int, ...]
    steps: int
    warmup: int
    overhead_batch: int
    overhead_rounds: int
    paths_batches: tuple[int, ...]
    paths_steps: int
    compile_steps: int
    offload_repeats: int
    encode_repeats: int
    attention_repeats: int

    @classmethod
    def gpu(cls) -> Plan:
        return cls((1, 2, 4, 8), 5, 1, 4, 5, (1, 4), 3, 3, 3, 3, 10)

    @classmethod
    def dry(cls) -> Plan:
        return cls((1, 2, 4), 2, 1, 2, 2, (1, 2), 1, 1, 2, 1, 2)


@dataclass
class CheckContext:
    report: Report
    device: torch.device
    dry: bool
    plan: Plan
    out_dir: Path
    workdir: Path
    repo_root: Path
    extra_paths: list[str] = field(default_factory=list)  # carried wheels' folder, for subprocesses
    model: Any = None
    model_name: str = ""
    # Sessions at a full KV window, shared by the latency, overhead and GPU-path sections.
    pool_engine: ChunkEngine | None = None
    pool_states: list[SessionState] = field(default_factory=list)
    last_frames: torch.Tensor | None = None
    latency_p50_ms: dict[int, float] = field(default_factory=dict)
    host_link_gbps: float | None = None
    free_after_build: int | None = None

    @property
    def cuda(self) -> bool:
        return self.device.type == "cuda"

    def sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize(self.device)

    def timed_ms(self, call: Callable[[], Any]) -> tuple[float, Any]:
        self.sync()
        started = time.perf_counter()
        result = call()
        self.sync()
        return (time.perf_counter() - started) * 1000.0, result

    def release_pool(self) -> None:
        if self.pool_engine is not None:
            self.pool_engine.close()
        self.pool_engine, self.pool_states = None, []
        if self.cuda:
            torch.cuda.empty_cache()


# -- environment ------------------------------------------------------------------------------------

PACKAGES = ("torch", "numpy", "safetensors", "transformers", "tokenizers", "diffusers", "huggingface-hub",
            "pillow", "av", "nvidia-ml-py", "pytest", "xxhash", "psutil")  # fmt: skip


def describe_environment(device: torch.device) -> dict[str, Any]:
    """The card's name, driver, CUDA and torch versions (what every figure is measured on), the
    Python packages, and the GPU-path settings read from the environment."""
    env: dict[str, Any] = {
        "device": str(device),
        "device_name": "cpu",
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "cuda_devices": torch.cuda.device_count() if torch.cuda.is_available() else 0,
    }
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        env.update(
            device_name=props.name,
            compute_capability=f"{props.major}.{props.minor}",
            memory_total_bytes=int(props.total_memory),
            multiprocessors=props.multi_processor_count,
            cudnn=torch.backends.cudnn.version(),
            nccl_available=torch.distributed.is_available() and torch.distributed.is_nccl_available(),
        )
    env["driver"] = _driver_version()
    packages = {}
    for name in PACKAGES:
        try:
            packages[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            packages[name] = None
    env["packages"] = packages
    try:
        env["gpu_paths_settings"] = GpuPaths.from_env().as_dict()
    except ValueError as exc:
        env["gpu_paths_settings"] = {"error": str(exc)}
    return env


def _driver_version() -> str | None:
    try:
        import pynvml

        pynvml.nvmlInit()
        try:
            version = pynvml.nvmlSystemGetDriverVersion()
            return version.decode() if isinstance(version, bytes) else str(version)
        finally:
            pynvml.nvmlShutdown()
    except Exception:
        return None


# -- sections that need no model --------------------------------------------------------------------


def nccl(ctx: CheckContext, figures: dict[str, Any]) -> None:
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    figures["cuda_devices"] = count
    if count < 2:
        raise SectionSkipped(
            f"not run: this machine has {count} CUDA device(s) and NCCL migration between two GPUs "
            "needs two; the transport's NCCL path (workers/runtime/transport/nccl.py) stays unmeasured"
        )
    raise SectionSkipped(
        f"{count} GPUs present, but this kit targets the one-GPU machine and has no NCCL section; "
        "measure it with `python -m workers.benchmarks.migration --device cuda` (docs/migration.md)"
    )


def correctness(ctx: CheckContext, figures: dict[str, Any]) -> None:
    """`pytest -m cuda` on the runtime's CUDA correctness tests, in a child process (no conftest:
    the suite's root conftest imports Django, which the GPU machine does not have)."""
    junit = ctx.out_dir / "cuda-tests.xml"
    command = [
        sys.executable, "-m", "pytest", "tests/workers_runtime/test_cuda.py", "-m", "cuda",
        "--noconftest", "-p", "no:django", "-p", "no:cacheprovider", "-q", "-rfEs",
        f"--junitxml={junit}",
    ]  # fmt: skip
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(ctx.repo_root), *ctx.extra_paths, env.get("PYTHONPATH", "")])
    left = max(30.0, ctx.report.budget.left() - 60.0)
    started = time.monotonic()
    try:
        done = subprocess.run(
            command, cwd=ctx.repo_root, env=env, capture_output=True, text=True, timeout=min(300.0, left)
        )
    except subprocess.TimeoutExpired as exc:
        raise RuntimeError(f"pytest -m cuda did not finish within {exc.timeout:.0f} s") from exc
    figures["command"] = " ".join(command[1:])
    figures["exit_code"] = done.returncode
    figures["seconds"] = round(time.monotonic() - started, 2)
    figures["output_tail"] = (done.stdout + done.stderr).strip().splitlines()[-15:]
    figures["tests"] = _junit_results(junit)
    counts = {status: 0 for status in ("passed", "failed", "skipped")}
    for case in figures["tests"]:
        counts[case["status"]] = counts.get(case["status"], 0) + 1
    figures["counts"] = counts
    figures["summary"] = [
        f"pytest -m cuda: {counts['passed']} passed, {counts['failed']} failed, {counts['skipped']} skipped"
    ]
    figures["summary"] += [
        f"FAILED {c['name']}: {c.get('message', '')[:160]}"
        for c in figures["tests"]
        if c["status"] == "failed"
    ]
    if done.returncode not in (0, 5):  # 5: nothing collected
        raise RuntimeError(f"pytest -m cuda exited with {done.returncode}: {counts['failed']} failed")


def _junit_results(path: Path) -> list[dict[str, Any]]:
    if not path.is_file():
        return []
    cases = []
    for case in ET.parse(path).getroot().iter("testcase"):
        status, message = "passed", ""
        for child in case:
            if child.tag in ("failure", "error"):
                status, message = "failed", child.get("message", "")
            elif child.tag == "skipped":
                status, message = "skipped", child.get("message", "")
        cases.append(
            {
                "name": case.get("name", ""),
                "status": status,
                "seconds": float(case.get("time", 0)),
                "message": message,
            }
        )
    return cases


def telemetry(ctx: CheckContext, figures: dict[str, Any]) -> None:
    # Only this section reads NVML: a machine without nvidia-ml-py still runs the others.
    from gpu import telemetry as gpu_telemetry

    sample = gpu_telemetry.sample()
    figures.update(sample)
    if sample.get("nvml"):
        device = sample["devices"][0]
        figures["summary"] = [
            f"NVML: {device['name']}: {device['memory_used_bytes']} of {device['memory_total_bytes']} B used, "
            f"utilisation {device['utilization_pct']} %, power {device['power_w']} W"
        ]
    else:
        figures["summary"] = [f"NVML: not available ({sample.get('reason')})"]


# -- the model --------------------------------------------------------------------------------------


def build_model(ctx: CheckContext, figures: dict[str, Any]) -> None:
    """The Wan2.1-T2V-1.3B generator with random weights (dry: the same code at tiny sizes); the
    reference causal DiT's ``wan-1.3b`` preset when diffusers is not importable, saying so."""
    # The Wan builders import diffusers and transformers, which the carried wheels may only provide
    # once the check has put them on sys.path (gpucheck.wheels).
    from workers.benchmarks.gpucheck import wan

    shape = wan.WAN_TINY if ctx.dry else wan.WAN_1_3B
    if ctx.cuda:
        torch.cuda.reset_peak_memory_stats(ctx.device)
    started = time.perf_counter()
    unavailable = wan.libraries_unavailable()
    if unavailable is None:
        model = wan.build_random_wan(shape, device=ctx.device, workdir=ctx.workdir)
        name, kind = (
            shape.name,
            "wan adapter (diffusers WanTransformer3DModel + AutoencoderKLWan, transformers UMT5), random weights",
        )
        weights = wan.weights_bytes(model)
    else:
        # The fallback when the Wan libraries are missing: built only then.
        from workers.runtime.models import build_model as build_preset

        preset = "tiny" if ctx.dry else "wan-1.3b"
        figures["fallback"] = (
            f"the Wan adapter's libraries do not import here ({unavailable}); "
            f"measuring the causal DiT preset {preset!r} instead"
        )
        model = build_preset(preset, device=str(ctx.device))
        name, kind = preset, "causal_dit reference model (Wan2.1-1.3B tensor shapes, its own decoder; no VAE)"
        weights = {"net": sum(p.numel() * p.element_size() for p in model.net.parameters())}
    ctx.sync()
    build_s = time.perf_counter() - started
    ctx.model, ctx.model_name = model, name
    figures.update(
        model=name,
        kind=kind,
        build_s=round(build_s, 3),
        dtype=str(model.dtype).removeprefix("torch."),
        width=model.width,
        height=model.height,
        fps=model.fps,
        video_frames_per_chunk=model.frames_per_chunk,
        weights_bytes=weights,
        weights_bytes_total=sum(weights.values()),
        state_bytes_estimate=model.state_bytes_for(),
        gpu_paths_active=model.accel.active if hasattr(model, "accel") else None,
    )
    if ctx.cuda:
        free, total = torch.cuda.mem_get_info(ctx.device)
        ctx.free_after_build = int(free)
        figures.update(
            memory_allocated_bytes=torch.cuda.memory_allocated(ctx.device),
            peak_allocated_during_build_bytes=torch.cuda.max_memory_allocated(ctx.device),
            device_free_bytes=int(free),
            device_total_bytes=int(total),
        )
    figures["summary"] = [
        f"{name}: {model.width}x{model.height}, {model.frames_per_chunk} frames/chunk @ {model.fps:g} fps, "
        f"{figures['dtype']}, weights {size(figures['weights_bytes_total'])}, built in {build_s:.1f} s"
    ]


def _latent_frames_per_chunk(model: Any) -> int:
    arch = getattr(model, "arch", None) or model.cfg
    return int(arch.frames_per_chunk)


def _window_frames(model: Any) -> int:
    arch = getattr(model, "arch", None) or model.cfg
    return int(arch.window_frames)


def fill_window(model: Any, state: SessionState, *, chunks: int) -> None:
    """Put a session where a long stream is: its KV window full and wrapped (``chunks`` chunks
    written), its decoder cache started. The values are random: a chunk's cost depends on the
    shapes, not on what the cache holds."""
    generator = torch.Generator(device=state.tensors["prompt_embeds"].device).manual_seed(chunks)
    for name, tensor in state.tensors.items():
        if name == "prompt_embeds":
            continue
        if tensor.is_floating_point():
            tensor.normal_(0.0, 0.5, generator=generator)
    frames = chunks * _latent_frames_per_chunk(model)
    decoded = getattr(model, "DECODED", None)
    if decoded and decoded in state.tensors:
        state.tensors[decoded].fill_(frames)
    state.meta["frames_written"] = frames
    state.meta["next_chunk"] = chunks
    state.meta["prompt_schedule"] = [[chunks, state.meta["active_prompt"]]]


def _steady_chunks(model: Any) -> int:
    """Chunks after which the window is full and has wrapped once (a long stream's shapes)."""
    fpc = _latent_frames_per_chunk(model)
    return -(-2 * _window_frames(model) // fpc)


def memory(ctx: CheckContext, figures: dict[str, Any]) -> None:
    """One session's state region: measured (the CUDA allocator's live bytes around `create_state`)
    against the estimate from its layout, and for the real shapes against docs/models.md."""
    model = ctx.model
    layout = model.state_layout() if hasattr(model, "state_layout") else model.cfg.state_layout()
    _, total = region_offsets(layout)
    groups: dict[str, int] = {}
    for name, shape, dtype in layout:
        key = (
            "kv_cache"
            if name == "kv_cache"
            else "vae_cache"
            if name.startswith("vae_cache.")
            else "prompt_embeds_and_latent_window"
        )
        groups[key] = groups.get(key, 0) + int(np.prod(shape)) * dtype.itemsize
    figures["estimate_bytes"] = {"total": total, **groups}
    if ctx.cuda:
        ctx.sync()
        before = torch.cuda.memory_allocated(ctx.device)
        torch.cuda.reset_peak_memory_stats(ctx.device)
        state = model.create_state(PROMPTS[0], seed=1)
        ctx.sync()
        measured = torch.cuda.memory_allocated(ctx.device) - before
        figures["peak_during_create_bytes"] = torch.cuda.max_memory_allocated(ctx.device) - before
        figures["measured_how"] = (
            "torch.cuda.memory_allocated() after create_state minus before (the live region)"
        )
    else:
        state = model.create_state(PROMPTS[0], seed=1)
        measured = state.nbytes
        figures["measured_how"] = "cpu: the region's allocation size (no allocator statistics on a CPU)"
    figures["measured_bytes"] = int(measured)
    figures["measured_vs_estimate"] = round(measured / total, 4)
    if ctx.model_name == "wan2.1-t2v-1.3b":
        figures["docs_models_md_bytes"] = DOCS_MODELS_MD_STATE
        figures["measured_vs_docs"] = round(measured / DOCS_MODELS_MD_STATE["total"], 4)
    del state
    if ctx.free_after_build is not None:
        figures["sessions_fitting_after_weights"] = int(ctx.free_after_build // max(measured, 1))
    kv, vae = groups.get("kv_cache", 0), groups.get("vae_cache", 0)
    docs = DOCS_MODELS_MD_STATE["total"]
    figures["summary"] = [
        f"per session: measured {size(measured)} vs estimate {size(total)} (KV {size(kv)}, VAE cache {size(vae)})"
        + (f"; docs/models.md says ≈ {size(docs)}" if "docs_models_md_bytes" in figures else "")
    ]


def first_chunk(ctx: CheckContext, figures: dict[str, Any]) -> None:
    """A new session's first chunks: empty cache, the VAE's first-chunk path, the prompt encoded.
    The very first chunk of the process (cold: kernels loaded, autotuned) is reported apart."""
    model = ctx.model
    engine = ChunkEngine(model, max_batch=1, encode_workers=1)
    try:
        cold_add_ms, _ = ctx.timed_ms(lambda: engine.add_session("cold", PROMPTS[1], seed=0))
        cold_ms, results = ctx.timed_ms(lambda: engine.step(due=["cold"]))
        engine.remove("cold")
        add_ms, _ = ctx.timed_ms(lambda: engine.add_session("new", PROMPTS[2], seed=3))
        chunk_ms = []
        for _ in range(3):
            ms, results = ctx.timed_ms(lambda: engine.step(due=["new"]))
            chunk_ms.append(ms)
        ctx.last_frames = results[0].rgb
    finally:
        engine.close()
    figures.update(
        cold_add_session_ms=round(cold_add_ms, 3),
        cold_first_chunk_ms=round(cold_ms, 3),
        add_session_ms=round(add_ms, 3),
        first_chunk_ms=round(chunk_ms[0], 3),
        second_chunk_ms=round(chunk_ms[1], 3),
        third_chunk_ms=round(chunk_ms[2], 3),
    )
    figures["summary"] = [
        f"new session: add (prompt encode + region) {add_ms:.1f} ms, first chunk {chunk_ms[0]:.1f} ms, "
        f"then {chunk_ms[1]:.1f}, {chunk_ms[2]:.1f} ms; first chunk of the process {cold_ms:.1f} ms"
    ]


def prompt_switch(ctx: CheckContext, figures: dict[str, Any]) -> None:
    """A prompt switch on a long stream: the new prompt encoded and, on the Wan adapter, the KV
    window re-cached under it (LongLive) before the chunk; against the same session's plain chunk."""
    model = ctx.model
    engine = ChunkEngine(model, max_batch=1, encode_workers=1)
    try:
        state = model.create_state(PROMPTS[0], seed=5)
        fill_window(model, state, chunks=_steady_chunks(model))
        engine.import_state("s", model.state_manifest(state), state.tensors, copy=False)
        engine.step(due=["s"])  # warm
        plain, switched = [], []
        for i in range(2):
            ms, _ = ctx.timed_ms(lambda: engine.step(due=["s"]))
            plain.append(ms)
            engine.set_prompt("s", PROMPTS[(i + 2) % len(PROMPTS)], from_chunk=engine.next_chunk("s"))
            ms, _ = ctx.timed_ms(lambda: engine.step(due=["s"]))
            switched.append(ms)
    finally:
        engine.close()
    recache = bool(getattr(getattr(model, "arch", None), "kv_recache", False))
    figures.update(
        kv_recache=recache,
        plain_chunk_ms=[round(v, 3) for v in plain],
        switch_chunk_ms=[round(v, 3) for v in switched],
        switch_extra_ms=round(statistics.median(switched) - statistics.median(plain), 3),
    )
    figures["summary"] = [
        f"prompt switch{' with KV re-cache' if recache else ''}: chunk {statistics.median(switched):.1f} ms "
        f"vs {statistics.median(plain):.1f} ms without (+{figures['switch_extra_ms']:.1f} ms)"
    ]


def _ensure_pool(ctx: CheckContext, count: int) -> None:
    """``count`` sessions at a full, wrapped KV window on one engine (adopted without a copy); the
    same tensors are kept as bare `SessionState`s for the model's own batched call."""
    model = ctx.model
    if ctx.pool_engine is None:
        ctx.pool_engine = ChunkEngine(model, max_batch=max(count, 1), encode_workers=1)
    engine = ctx.pool_engine
    engine.max_batch = max(engine.max_batch, count)
    while len(ctx.pool_states) < count:
        i = len(ctx.pool_states)
        state = model.create_state(PROMPTS[i % len(PROMPTS)], seed=100 + i)
        fill_window(model, state, chunks=_steady_chunks(model))
        engine.import_state(f"p{i}", model.state_manifest(state), state.tensors, copy=False)
        ctx.pool_states.append(state)


def _oom(exc: BaseException) -> bool:
    return isinstance(exc, torch.cuda.OutOfMemoryError) or "out of memory" in str(exc).lower()


def chunk_latency(ctx: CheckContext, figures: dict[str, Any]) -> None:
    """Per batch size, with every session's KV window full: the engine step's latency (p50/p99),
    frames per second per session and in all, peak memory, and the step split into diffusion and
    VAE decode (the model's stages timed apart)."""
    model, plan = ctx.model, ctx.plan
    rows = []
    for batch in plan.batches:
        row: dict[str, Any] = {"batch": batch}
        try:
            _ensure_pool(ctx, batch)
            engine = ctx.pool_engine
            assert engine is not None
            due = [f"p{i}" for i in range(batch)]
            if ctx.cuda:
                torch.cuda.reset_peak_memory_stats(ctx.device)
            times, generation = [], []
            for step in range(plan.warmup + plan.steps):
                ms, results = ctx.timed_ms(functools.partial(engine.step, max_batch=batch, due=due))
                if step >= plan.warmup:
                    times.append(ms)
                    generation.append(results[0].generation_ms)
            ctx.last_frames = results[0].rgb
            states = ctx.pool_states[:batch]
            diffuse_ms, latents = ctx.timed_ms(
                lambda states=states: model.diffuse(states, [None] * len(states))
            )
            decode_ms, _ = ctx.timed_ms(
                lambda states=states, latents=latents: model.decode(
                    latents, [model.decoder_cache(s) for s in states]
                )
            )
            summary = summarize_ms(times)
            p50 = float(summary["p50"])  # type: ignore[arg-type]
            fps = model.frames_per_chunk / (p50 / 1000.0)
            row.update(
                step_ms=summary,
                generation_ms_p50=round(statistics.median(generation), 3),
                frames_per_s_per_session=round(fps, 3),
                frames_per_s_total=round(fps * batch, 3),
                diffuse_ms=round(diffuse_ms, 3),
                vae_decode_ms=round(decode_ms, 3),
                vae_decode_ms_per_session=round(decode_ms / batch, 3),
            )
            if ctx.cuda:
                row["peak_allocated_bytes"] = torch.cuda.max_memory_allocated(ctx.device)
                row["resident_allocated_bytes"] = torch.cuda.memory_allocated(ctx.device)
            ctx.latency_p50_ms[batch] = p50
        except Exception as exc:
            if not _oom(exc):
                raise
            row["error"] = f"out of memory at batch {batch}: {str(exc).splitlines()[0][:200]}"
            rows.append(row)
            if ctx.cuda:
                torch.cuda.empty_cache()
            break
        rows.append(row)
    figures["rows"] = rows
    figures["steps"], figures["warmup"] = plan.steps, plan.warmup
    figures["summary"] = [
        f"B={r['batch']}: " + (
            r["error"] if "error" in r else
            f"p50 {r['step_ms']['p50']:.1f} ms, p99 {r['step_ms']['p99']:.1f} ms, "
            f"{r['frames_per_s_per_session']:.1f} fps/session, {r['frames_per_s_total']:.1f} fps total, "
            f"diffuse {r['diffuse_ms']:.1f} ms + VAE decode {r['vae_decode_ms']:.1f} ms"
        )
        for r in rows
    ]  # fmt: skip
    if not ctx.latency_p50_ms:
        raise RuntimeError("no batch size could be measured")


def engine_overhead(ctx: CheckContext, figures: dict[str, Any]) -> None:
    """The engine's batched step against the bare batched forward (`model.generate` plus the same
    copy of the frames to the host), alternated per round on the same sessions."""
    model, plan = ctx.model, ctx.plan
    batch = max((b for b in ctx.latency_p50_ms if b <= plan.overhead_batch), default=1)
    _ensure_pool(ctx, batch)
    engine = ctx.pool_engine
    assert engine is not None
    due = [f"p{i}" for i in range(batch)]
    states = ctx.pool_states[:batch]
    engine_ms, bare_ms, bookkeeping = [], [], []

    def bare() -> None:
        chunks = model.generate(states)
        torch.stack([c.frames for c in chunks]).to("cpu")

    for round_index in range(plan.overhead_rounds + 1):
        order = ("bare", "engine") if round_index % 2 else ("engine", "bare")
        for which in order:
            if which == "engine":
                ms, results = ctx.timed_ms(lambda: engine.step(max_batch=batch, due=due))
                if round_index:
                    engine_ms.append(ms)
                    bookkeeping.append(ms - results[0].generation_ms)
            else:
                ms, _ = ctx.timed_ms(bare)
                if round_index:
                    bare_ms.append(ms)
    ratios = [e / b for e, b in zip(engine_ms, bare_ms, strict=True)]
    overhead_pct = (statistics.median(ratios) - 1.0) * 100.0
    figures.update(
        batch=batch,
        rounds=plan.overhead_rounds,
        engine_step_ms=summarize_ms(engine_ms),
        bare_forward_ms=summarize_ms(bare_ms),
        engine_vs_bare_paired_median=round(statistics.median(ratios), 4),
        engine_overhead_pct=round(overhead_pct, 3),
        engine_bookkeeping_ms_median=round(statistics.median(bookkeeping), 3),
    )
    figures["summary"] = [
        f"B={batch}: engine {statistics.median(engine_ms):.1f} ms vs bare forward {statistics.median(bare_ms):.1f} ms "
        f"(paired median {overhead_pct:+.2f} %)"
    ]


def offload(ctx: CheckContext, figures: dict[str, Any]) -> None:
    """Suspend/resume of one session against a plain copy of the same bytes between preallocated
    buffers (pinned host ↔ device on CUDA), per round; with the engine's side stream and pinned
    buffers, and without each (CUDA only). The state is checked byte-exact after each resume
    (per-tensor checksums, computed on the device)."""
    model, plan = ctx.model, ctx.plan
    variants = {"default": GpuPaths()}
    if ctx.cuda:
        variants["no_side_stream"] = GpuPaths(offload_side_stream=False)
        variants["pageable_host"] = GpuPaths(offload_pinned=False)
    rows: dict[str, Any] = {}
    device_buf = host_buf = None
    for name, paths in variants.items():
        engine = ChunkEngine(model, max_batch=1, encode_workers=1, gpu_paths=paths)
        try:
            engine.add_session("o", PROMPTS[3], seed=9)
            nbytes = engine.state_bytes("o")
            if device_buf is None:
                device_buf = torch.empty(nbytes, dtype=torch.uint8, device=ctx.device).fill_(1)
                host_buf = torch.empty(nbytes, dtype=torch.uint8, pin_memory=ctx.cuda)
            assert host_buf is not None
            suspend, resume, d2h, h2d, exact = [], [], [], [], True
            reference = _checksums(engine, "o")
            for round_index in range(plan.offload_repeats + 1):  # round 0 warms the buffer pools
                s_ms, record = ctx.timed_ms(lambda engine=engine: engine.suspend("o"))
                c_ms, _ = ctx.timed_ms(lambda h=host_buf, d=device_buf: h.copy_(d, non_blocking=ctx.cuda))
                r_ms, _ = ctx.timed_ms(lambda engine=engine, record=record: engine.resume("o", record))
                h_ms, _ = ctx.timed_ms(lambda h=host_buf, d=device_buf: d.copy_(h, non_blocking=ctx.cuda))
                exact = exact and _checksums(engine, "o") == reference
                if round_index:
                    suspend.append(s_ms)
                    d2h.append(c_ms)
                    resume.append(r_ms)
                    h2d.append(h_ms)
            rows[name] = {
                "paths": paths.as_dict(),
                "pinned": bool(record.pinned),
                "state_bytes": nbytes,
                "suspend_gbps": round(nbytes / (statistics.median(suspend) / 1000.0) / GB, 3),
                "resume_gbps": round(nbytes / (statistics.median(resume) / 1000.0) / GB, 3),
                "plain_d2h_gbps": round(nbytes / (statistics.median(d2h) / 1000.0) / GB, 3),
                "plain_h2d_gbps": round(nbytes / (statistics.median(h2d) / 1000.0) / GB, 3),
                "suspend_vs_plain": round(
                    statistics.median(p / s for s, p in zip(suspend, d2h, strict=True)), 4
                ),
                "resume_vs_plain": round(
                    statistics.median(p / r for r, p in zip(resume, h2d, strict=True)), 4
                ),
                "suspend_ms": summarize_ms(suspend),
                "resume_ms": summarize_ms(resume),
                "byte_exact": exact,
            }
        finally:
            engine.close()
    device_buf = host_buf = None
    if ctx.cuda:
        torch.cuda.empty_cache()
    figures["variants"] = rows
    figures["repeats"] = plan.offload_repeats
    default = rows["default"]
    ctx.host_link_gbps = min(default["suspend_gbps"], default["resume_gbps"])
    if not all(row["byte_exact"] for row in rows.values()):
        raise RuntimeError("a resumed state's checksums differ from the suspended state's")
    figures["summary"] = [
        f"{name}: suspend {r['suspend_gbps']:.2f} GB/s ({r['suspend_vs_plain'] * 100:.0f} % of plain), "
        f"resume {r['resume_gbps']:.2f} GB/s ({r['resume_vs_plain'] * 100:.0f} % of plain), byte-exact {r['byte_exact']}"
        for name, r in rows.items()
    ]


def _checksums(engine: ChunkEngine, session_id: str) -> list[int]:
    manifest, _ = engine.export_state(session_id)
    engine.thaw(session_id)
    return [int(entry["checksum"]) for entry in manifest["tensors"]]


def profile(ctx: CheckContext, figures: dict[str, Any]) -> None:
    """The scheduler's profile (``profile_model``'s format) from the measured latency curve; what
    one GPU cannot measure (peer link, boot, price) is the built-in ``h100-1.3b`` profile's value,
    and the profile's ``source`` says which is which."""
    model = ctx.model
    device_name = ctx.report.environment.get("device_name", str(ctx.device))
    gpu_type = "h100" if "H100" in device_name else "h200" if "H200" in device_name else ctx.device.type
    state_bytes = model.state_bytes_for()
    if ctx.free_after_build is not None:
        total = torch.cuda.get_device_properties(ctx.device).total_memory
        memory_sessions = max(1, int((ctx.free_after_build - 0.1 * total) // state_bytes))
    else:
        memory_sessions = max(ctx.latency_p50_ms)
    host_link = ctx.host_link_gbps if ctx.host_link_gbps is not None else PCIE_GBPS_NOMINAL
    measured = sorted(ctx.latency_p50_ms.items())
    if len(measured) < 2:
        raise SectionSkipped("the latency curve has fewer than two batch sizes")
    data = scheduler_profile(
        name=f"{gpu_type}-{ctx.model_name}-gpucheck" + ("-dry" if ctx.dry else ""),
        gpu_type=gpu_type,
        measured_ms=measured,
        state_bytes=state_bytes,
        memory_limit_sessions=memory_sessions,
        price_per_hour=H100_1_3B_PRICE_PER_HOUR,
        provisioning_delay_s=H100_1_3B_PROVISIONING_DELAY_S,
        host_link_gbps=host_link,
        link_gbps=NVLINK_GBPS_NOMINAL,
        slo_ms=H100_1_3B_SLO_MS,
        source=(
            f"make gpu-check on {device_name} (torch {torch.__version__}), {ctx.report.started_at.isoformat()}"
            f"{' — CPU DRY RUN, not GPU figures' if ctx.dry else ''}: latency_ms (engine step p50 by batch, "
            f"running max), state_bytes and memory_limit_sessions measured; host_link_gbps "
            f"{'measured (suspend/resume)' if ctx.host_link_gbps is not None else 'nominal PCIe'}; "
            "link_gbps nominal NVLink (one GPU: not measurable); price, provisioning delay and slo_ms "
            "from the built-in h100-1.3b profile"
        ),
    )
    ctx.report.profile = data
    figures["profile"] = data
    figures["summary"] = [
        f"profile {data['name']}: K={data['capacity']:g} within {H100_1_3B_SLO_MS:g} ms, latency {data['latency_ms']}"
    ]


# -- GPU paths, with and without --------------------------------------------------------------------


def _paired(ctx: CheckContext, batch: int, variants: dict[str, Accelerator], steps: int) -> dict[str, Any]:
    """Engine steps at ``batch`` alternating between the model's accelerators; the first step of each
    variant (capture, compilation) is reported apart."""
    model, engine = ctx.model, ctx.pool_engine
    assert engine is not None
    due = [f"p{i}" for i in range(batch)]
    original = model.accel
    first: dict[str, float] = {}
    times: dict[str, list[float]] = {name: [] for name in variants}
    try:
        for round_index in range(steps + 1):
            names = list(variants) if round_index % 2 == 0 else list(reversed(variants))
            for name in names:
                model.accel = variants[name]
                ms, _ = ctx.timed_ms(lambda: engine.step(max_batch=batch, due=due))
                if round_index == 0:
                    first[name] = round(ms, 3)
                else:
                    times[name].append(ms)
    finally:
        model.accel = original
    out: dict[str, Any] = {"batch": batch, "first_step_ms": first}
    base = statistics.median(times["off"])
    for name, values in times.items():
        p50 = statistics.median(values)
        out[name] = {"step_ms": summarize_ms(values), "vs_off": round(p50 / base, 4)}
    return out


def gpu_paths(ctx: CheckContext, figures: dict[str, Any]) -> None:
    """Flash attention and CUDA graphs each on against off (the same sessions, alternated per step),
    plus the attention kernels alone at the model's shapes. On a CPU both paths are inactive by
    design: the rows then compare identical code."""
    model, plan = ctx.model, ctx.plan
    if not hasattr(model, "accel"):
        raise SectionSkipped(f"{type(model).__name__} has no GPU-path hooks (model.accel)")
    off = Accelerator(ctx.device, GpuPaths())
    variants = {
        "off": off,
        "flash_attention": Accelerator(ctx.device, GpuPaths(flash_attention=True)),
        "cuda_graphs": Accelerator(ctx.device, GpuPaths(cuda_graphs=True)),
    }
    figures["active"] = {name: acc.active for name, acc in variants.items()}
    rows = []
    for batch in plan.paths_batches:
        if batch not in ctx.latency_p50_ms:
            continue
        _ensure_pool(ctx, batch)
        rows.append(_paired(ctx, batch, variants, plan.paths_steps))
    graphs = variants["cuda_graphs"].graphs
    figures["rows"] = rows
    figures["graphs_captured"] = graphs.captures if graphs is not None else 0
    figures["attention_kernels"] = _attention_kernels(ctx)
    figures["flash_eligible_at_model_shapes"] = flash_eligible(
        types.SimpleNamespace(is_cuda=ctx.cuda, dtype=model.dtype, shape=(1, 1, 1, _head_dim(model))), None
    )

    def state(name: str) -> str:
        return "" if variants[name].active[name] else " (inactive here)"

    figures["summary"] = [
        f"B={row['batch']}: off {row['off']['step_ms']['p50']:.1f} ms; "
        + ", ".join(f"{name} ×{row[name]['vs_off']:.3f}{state(name)}" for name in variants if name != "off")
        for row in rows
    ] + [
        f"SDPA alone, B={k['batch']}, {k['backend']}: "
        + (f"{k['ms']:.3f} ms ({k['tflops']:.1f} TFLOP/s)" if "ms" in k else k.get("error", ""))
        for k in figures["attention_kernels"]
    ]


def _head_dim(model: Any) -> int:
    heads = getattr(model, "heads", None) or model.cfg.heads
    dim = getattr(model, "dim", None) or model.cfg.dim
    return dim // heads


def _attention_kernels(ctx: CheckContext) -> list[dict[str, Any]]:
    """Self-attention of one steady-state pass (a chunk's tokens against window + chunk) per SDPA
    backend, timed alone; the math backend only on a CPU (it materialises the score matrix)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    model = ctx.model
    heads = getattr(model, "heads", None) or model.cfg.heads
    dim = getattr(model, "dim", None) or model.cfg.dim
    arch = getattr(model, "arch", None) or model.cfg
    tokens = arch.tokens_per_frame * arch.frames_per_chunk
    keys = arch.tokens_per_frame * arch.window_frames + tokens
    backends = {"math": SDPBackend.MATH} if not ctx.cuda else {
        "flash": SDPBackend.FLASH_ATTENTION,
        "efficient": SDPBackend.EFFICIENT_ATTENTION,
        **({"cudnn": SDPBackend.CUDNN_ATTENTION} if hasattr(SDPBackend, "CUDNN_ATTENTION") else {}),
    }  # fmt: skip
    rows = []
    for batch in ctx.plan.paths_batches:
        q = torch.randn(batch, heads, tokens, dim // heads, device=ctx.device, dtype=model.dtype)
        k = torch.randn(batch, heads, keys, dim // heads, device=ctx.device, dtype=model.dtype)
        v = torch.randn_like(k)
        flops = 4 * batch * heads * tokens * keys * (dim // heads)
        for name, backend in backends.items():
            row: dict[str, Any] = {"batch": batch, "backend": name, "q": list(q.shape), "k": list(k.shape)}
            try:
                with sdpa_kernel(backend):
                    attend = functools.partial(torch.nn.functional.scaled_dot_product_attention, q, k, v)
                    attend()
                    times = [ctx.timed_ms(attend)[0] for _ in range(ctx.plan.attention_repeats)]
                ms = statistics.median(times)
                row.update(ms=round(ms, 4), tflops=round(flops / (ms / 1000.0) / 1e12, 2))
            except RuntimeError as exc:
                row["error"] = str(exc).splitlines()[0][:160]
            rows.append(row)
    return rows


def compile_blocks(ctx: CheckContext, figures: dict[str, Any]) -> None:
    """``torch.compile`` of the block on against off at batch 1 (its first step, the compilation,
    reported apart), and on together with CUDA graphs."""
    model, plan = ctx.model, ctx.plan
    if not hasattr(model, "accel"):
        raise SectionSkipped(f"{type(model).__name__} has no GPU-path hooks (model.accel)")
    variants = {
        "off": Accelerator(ctx.device, GpuPaths()),
        "compile_blocks": Accelerator(ctx.device, GpuPaths(compile_blocks=True)),
    }
    figures["active"] = {name: acc.active for name, acc in variants.items()}
    _ensure_pool(ctx, 1)
    row = _paired(ctx, 1, variants, plan.compile_steps)
    figures["row"] = row
    figures["summary"] = [
        f"B=1: off {row['off']['step_ms']['p50']:.1f} ms, compiled ×{row['compile_blocks']['vs_off']:.3f}"
        f"{'' if variants['compile_blocks'].active['compile_blocks'] else ' (inactive here)'} "
        f"(first step with compilation {row['first_step_ms']['compile_blocks'] / 1000.0:.1f} s)"
    ]


# -- encode -----------------------------------------------------------------------------------------


def synthetic_frames(count: int, height: int, width: int) -> np.ndarray:
    """A moving colour gradient with a little texture: what an encoder sees in service is video,
    not the noise a random-weight model draws (which no H.264 encoder handles at its usual cost)."""
    y, x = np.mgrid[0:height, 0:width].astype(np.float32)
    frames = []
    for t in range(count):
        r = 127.5 + 127.5 * np.sin((x + 4 * t) / 37.0)
        g = 127.5 + 127.5 * np.sin((y - 3 * t) / 23.0)
        b = 127.5 + 127.5 * np.sin((x + y + 5 * t) / 51.0)
        frames.append(np.stack([r, g, b], axis=-1))
    return np.clip(np.stack(frames), 0, 255).astype(np.uint8)


def encode(ctx: CheckContext, figures: dict[str, Any]) -> None:
    """H.264 per chunk through `FragmentEncoder`: the encoder `select_h264_encoder(gpu=True)` picks
    (NVENC when the FFmpeg build has it and it opens, else libx264), and libx264 beside it."""
    try:
        import av
    except ImportError as exc:
        raise SectionSkipped(
            f"PyAV is not installed here ({exc}) and was not carried (docs/gpu-check.md: a ~40 MB binary "
            "wheel, and the H100 has no NVENC to measure)"
        ) from None
    # PyAV may be absent on the GPU machine (checked just above): imported only once it is there.
    from workers.runtime.media import FragmentEncoder, select_h264_encoder

    model = ctx.model
    frames = synthetic_frames(model.frames_per_chunk, model.height, model.width)
    figures["nvenc_in_build"] = "h264_nvenc" in av.codecs_available
    chosen = select_h264_encoder(gpu=ctx.cuda)
    figures["selected"] = chosen
    figures["frames"] = f"{frames.shape[0]}×{frames.shape[2]}×{frames.shape[1]} synthetic moving gradient"
    rows = {}
    for encoder in dict.fromkeys([chosen, "libx264"]):
        times, size = [], 0
        for i in range(ctx.plan.encode_repeats + 1):
            fragment = FragmentEncoder(encoder).encode(frames, fps=model.fps, chunk_index=i)
            if i:
                times.append(fragment.encode_ms)
                size = len(fragment.data)
        rows[encoder] = {"encode_ms_per_chunk": summarize_ms(times), "fragment_bytes": size}
    figures["encoders"] = rows
    figures["summary"] = [
        f"H.264 {name}: {row['encode_ms_per_chunk']['p50']:.1f} ms per {model.frames_per_chunk}-frame chunk, {row['fragment_bytes']} B"
        for name, row in rows.items()
    ] + [f"selected for gpu={ctx.cuda}: {chosen} (h264_nvenc in this build: {figures['nvenc_in_build']})"]


def dump(value: Any) -> str:
    return json.dumps(value, default=str)
