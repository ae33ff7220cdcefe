"""Runtime benchmarks and profiling (``manage.py bench_runtime`` and ``profile_model`` are thin wrappers).

Everything here measures; nothing asserts. Timings on a shared CPU box are noisy, so comparisons are
interleaved (the engine step and the bare forward alternate on identical inputs) and reported as
medians.
"""

from __future__ import annotations

import statistics
import time
from datetime import UTC, datetime
from typing import Any

import psutil
import torch

from contracts.bench import rounds
from gpu import telemetry
from workers.benchmarks.migration import bench_migration
from workers.benchmarks.profile import scheduler_profile
from workers.runtime.engine import ChunkEngine
from workers.runtime.models import build_model
from workers.runtime.models.base import SessionState, StreamingVideoModel
from workers.runtime.models.causal_dit import PRESETS

GB = 1e9
PCIE_GBPS = 25.0  # host↔device, PCIe Gen4/5 x16 effective (DESIGN.md: 25–55 GB/s)
NVLINK_GBPS = 150.0  # H100 NVLink p2p, conservative end of DESIGN.md's 150–380 GB/s
PAPER_MIGRATION_MS = (23.0, 30.0)  # TurboServe: migration overhead per session


def check_device(device: str) -> None:
    """Fail early and clearly when the requested device is not usable here."""
    kind = torch.device(device).type
    if kind == "cuda" and not torch.cuda.is_available():
        raise ValueError(
            f"--device {device}: CUDA is not available on this machine (torch {torch.__version__})"
        )


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _clone_states(model: StreamingVideoModel, engine: ChunkEngine, ids: list[str]) -> list[SessionState]:
    states = []
    for sid in ids:
        manifest, tensors = engine.export_state(sid)
        engine.thaw(sid)
        states.append(model.restore_state(manifest, tensors, verify_checksums=False, copy=True))
    return states


def _drain(results: list[Any]) -> list[float]:
    return [r.encode_ms() for r in results]


def bench_coalescing(
    model: StreamingVideoModel,
    *,
    batches: tuple[int, ...] = (1, 2, 4, 8),
    steps: int = 8,
    warmup_chunks: int = 2,
) -> list[dict[str, Any]]:
    """Per batch size B: the engine's batched step vs the bare batched forward vs one at a time.

    Three copies of the same B sessions at the same stream positions advance in lockstep: each round
    runs the engine's batched step, the bare `model.generate` on cloned states (plus the frames'
    copy to the host, which the engine also does), and B single-session engine steps, so that all
    three see the same load from whatever else shares the machine.
    """
    device = model.device
    rows = []
    for batch in batches:
        ids = [f"s{i}" for i in range(batch)]
        batched = ChunkEngine(model, max_batch=batch, encode_workers=1)
        for i, sid in enumerate(ids):
            batched.add_session(sid, f"benchmark prompt {i}: a city street at night, rain", seed=i)
        for _ in range(warmup_chunks):
            _drain(batched.step(max_batch=batch))
        bare_states = _clone_states(model, batched, ids)
        sequential = ChunkEngine(model, max_batch=1, encode_workers=1)
        for sid, state in zip(ids, _clone_states(model, batched, ids), strict=True):
            sequential.import_state(sid, model.state_manifest(state), state.tensors, copy=False)
        engine_ms, bare_ms, sequential_ms, encode_ms = [], [], [], []
        bookkeeping_ms: list[float] = []
        # The first round warms up the bare and sequential copies.
        for round_index, measured in rounds(steps, warmup=1):
            # Alternate which goes first so neither always runs on a cache warmed by the other.
            order = ("bare", "engine") if round_index % 2 else ("engine", "bare")
            for which in order:
                if which == "engine":
                    started = time.perf_counter()
                    results = batched.step(max_batch=batch)
                    elapsed_engine = (time.perf_counter() - started) * 1000.0
                    bookkeeping_ms.append(elapsed_engine - results[0].generation_ms)
                    encode_ms.extend(_drain(results))  # waited outside the timer
                else:
                    _sync(device)
                    started = time.perf_counter()
                    chunks = model.generate(bare_states)
                    torch.stack([c.frames for c in chunks]).to("cpu")
                    elapsed_bare = (time.perf_counter() - started) * 1000.0
            started = time.perf_counter()
            for sid in ids:
                _drain(sequential.step(max_batch=1, due=[sid]))
            elapsed_sequential = (time.perf_counter() - started) * 1000.0
            if measured:
                engine_ms.append(elapsed_engine)
                bare_ms.append(elapsed_bare)
                sequential_ms.append(elapsed_sequential)
        batched.close()
        sequential.close()
        step_ms = statistics.median(engine_ms)
        bare = statistics.median(bare_ms)
        seq = statistics.median(sequential_ms)
        ratios = sorted(e / b for e, b in zip(engine_ms, bare_ms, strict=True))
        rows.append(
            {
                "batch": batch,
                "engine_step_ms": round(step_ms, 3),
                "bare_forward_ms": round(bare, 3),
                "engine_vs_bare": round(step_ms / bare, 4),
                "engine_vs_bare_paired_median": round(statistics.median(ratios), 4),
                "engine_overhead_pct": round((statistics.median(ratios) - 1.0) * 100.0, 2),
                "per_chunk_latency_ms": round(step_ms, 3),
                "chunks_per_s_batched": round(batch / (step_ms / 1000.0), 2),
                "chunks_per_s_one_at_a_time": round(batch / (seq / 1000.0), 2),
                "one_at_a_time_round_ms": round(seq, 3),
                "batching_speedup": round(seq / step_ms, 3),
                # On a shared machine the minimum is the least noisy estimate of what code costs.
                "engine_step_ms_min": round(min(engine_ms), 3),
                "bare_forward_ms_min": round(min(bare_ms), 3),
                "engine_vs_bare_min": round(min(engine_ms) / min(bare_ms), 4),
                # Step time outside the model call and the frames' copy to the host.
                "engine_bookkeeping_ms_median": round(statistics.median(bookkeeping_ms[1:]), 4),
                "engine_bookkeeping_pct_of_step": round(
                    statistics.median(bookkeeping_ms[1:]) / step_ms * 100.0, 2
                ),
                "encode_ms_per_chunk_median": round(statistics.median(encode_ms), 3),
                "steps": steps,
            }
        )
    return rows


def bench_offload(model: StreamingVideoModel, *, repeats: int = 20) -> dict[str, Any]:
    """Suspend/resume throughput vs a plain copy of the same number of bytes, interleaved per round.

    The plain copy is one flat copy between preallocated buffers in the same direction (pinned host
    ↔ device on CUDA; host ↔ host on a CPU worker, where the "device" is host memory too).
    """
    device = model.device
    engine = ChunkEngine(model, max_batch=1, encode_workers=1)
    engine.add_session("s", "offload benchmark", seed=0)
    _drain(engine.step())
    nbytes = engine.state_bytes("s")
    pin = device.type == "cuda"
    device_buf = torch.empty(nbytes, dtype=torch.uint8, device=device).fill_(1)
    host_buf = torch.empty(nbytes, dtype=torch.uint8, pin_memory=pin)
    suspend_ms, resume_ms, suspend_call_ms, resume_call_ms, d2h, h2d = [], [], [], [], [], []
    for _, measured in rounds(repeats, warmup=2):  # warm-up: first-touch, pool fill
        _sync(device)
        started = time.perf_counter()
        record = engine.suspend("s")
        elapsed_suspend = (time.perf_counter() - started) * 1000.0
        started = time.perf_counter()
        host_buf.copy_(device_buf, non_blocking=pin)
        _sync(device)
        elapsed_d2h = (time.perf_counter() - started) * 1000.0
        started = time.perf_counter()
        report = engine.resume("s", record)
        elapsed_resume = (time.perf_counter() - started) * 1000.0
        started = time.perf_counter()
        device_buf.copy_(host_buf, non_blocking=pin)
        _sync(device)
        elapsed_h2d = (time.perf_counter() - started) * 1000.0
        if measured:
            suspend_call_ms.append(elapsed_suspend)
            suspend_ms.append(record.copy_ms)
            resume_call_ms.append(elapsed_resume)
            resume_ms.append(report.copy_ms)
            d2h.append(elapsed_d2h)
            h2d.append(elapsed_h2d)
    engine.close()

    def rate(ms_list: list[float]) -> float:
        return nbytes / (statistics.median(ms_list) / 1000.0) / GB

    def paired(numerator: list[float], denominator: list[float]) -> float:
        # throughput ratio = plain time / engine time, per round; median over rounds
        return statistics.median(d / n for n, d in zip(numerator, denominator, strict=True))

    out = {
        "state_bytes": nbytes,
        "suspend_copy_gbps": rate(suspend_ms),
        "suspend_call_gbps": rate(suspend_call_ms),
        "resume_copy_gbps": rate(resume_ms),
        "resume_call_gbps": rate(resume_call_ms),
        "plain_copy_d2h_gbps": rate(d2h),
        "plain_copy_h2d_gbps": rate(h2d),
        "suspend_ms_median": statistics.median(suspend_call_ms),
        "resume_ms_median": statistics.median(resume_call_ms),
        "suspend_vs_plain": paired(suspend_call_ms, d2h),
        "resume_vs_plain": paired(resume_call_ms, h2d),
        "suspend_copy_vs_plain": paired(suspend_ms, d2h),
        "resume_copy_vs_plain": paired(resume_ms, h2d),
        "repeats": repeats,
    }
    return {k: round(v, 4) if isinstance(v, float) else v for k, v in out.items()}


def state_sizes() -> dict[str, dict[str, Any]]:
    """Analytic state region and parameter sizes of every preset (nothing is allocated)."""
    return {
        name: {
            "state_bytes": cfg.state_bytes(),
            "state_gb": round(cfg.state_bytes() / GB, 4),
            "kv_bytes_per_latent_frame": cfg.blocks * 2 * cfg.tokens_per_frame * cfg.dim
            * torch.empty((), dtype=cfg.torch_dtype).element_size(),
            "parameters": cfg.parameter_count(),
            "tokens_per_latent_frame": cfg.tokens_per_frame,
            "video": f"{cfg.width}x{cfg.height}, {cfg.video_frames_per_chunk} frames/chunk @ {cfg.fps:g} fps",
        }
        for name, cfg in PRESETS.items()
    }  # fmt: skip


def wan_projection() -> dict[str, Any]:
    """Projected wan-1.3b offload/migration times from its state size and nominal link bandwidths."""
    nbytes = PRESETS["wan-1.3b"].state_bytes()
    return {
        "state_bytes": nbytes,
        "pcie_gbps": PCIE_GBPS,
        "nvlink_gbps": NVLINK_GBPS,
        "offload_ms_pcie": round(nbytes / (PCIE_GBPS * GB) * 1000.0, 1),
        "migration_ms_pcie_staged": round(2 * nbytes / (PCIE_GBPS * GB) * 1000.0, 1),
        "migration_ms_nvlink": round(nbytes / (NVLINK_GBPS * GB) * 1000.0, 1),
        "paper_migration_ms": list(PAPER_MIGRATION_MS),
        "note": "bandwidth-only projections (no per-transfer latency α); staged = device→host→device",
    }


def bench_migration_hook(*, state_bytes: int, device: str, chunk_latency_ms: float) -> dict[str, Any]:
    """The transport's migration bench (:func:`workers.benchmarks.migration.bench_migration`) on a
    region of this preset's size.

    Adds the stall a migration puts in front of the session's next chunk as a fraction of the chunk
    latency measured here (paper: 2–3 % on GPUs).
    """
    try:
        report = bench_migration([state_bytes], device, repeats=3)
    except Exception as exc:  # report it; do not lose the rest of the bench
        return {"available": False, "error": f"{type(exc).__name__}: {exc}"}
    for row in report.get("results", []):
        if "migration_seconds" in row:
            row["stall_ms"] = row["migration_seconds"] * 1000.0
            row["stall_fraction_of_chunk"] = row["stall_ms"] / chunk_latency_ms
    return {"available": True, "chunk_latency_ms": chunk_latency_ms, **report}


def run_bench(
    preset: str = "tiny",
    *,
    device: str = "cpu",
    batches: tuple[int, ...] = (1, 2, 4, 8),
    steps: int = 8,
    offload_repeats: int = 20,
    offload_presets: tuple[str, ...] | None = None,
    migration: bool = True,
) -> dict[str, Any]:
    """The whole runtime bench in one run (see docs/runtime.md). `offload_presets` defaults to the
    bench preset plus `small` when the preset is `tiny` (tiny's 0.5 MB state measures per-call cost
    more than bandwidth)."""
    check_device(device)
    started = time.perf_counter()
    model = build_model(preset, device=device)
    _sync(model.device)
    load_s = time.perf_counter() - started
    coalescing = bench_coalescing(model, batches=batches, steps=steps)
    if offload_presets is None:
        offload_presets = (preset, "small") if preset == "tiny" else (preset,)
    offload = {}
    for name in offload_presets:
        offload_model = model if name == preset else build_model(name, device=device)
        offload[name] = bench_offload(offload_model, repeats=offload_repeats)
    chunk_ms = coalescing[0]["per_chunk_latency_ms"]
    report = {
        "preset": preset,
        "device": str(model.device),
        "torch_threads": torch.get_num_threads(),
        "model_load_s": round(load_s, 3),
        "model": {k: v for k, v in model.describe().items() if k != "config"},  # type: ignore[attr-defined]
        "coalescing": coalescing,
        "offload": offload,
        "state_sizes": state_sizes(),
        "wan_1_3b_projection": wan_projection(),
        "migration": (
            bench_migration_hook(
                state_bytes=model.state_bytes_for(), device=device, chunk_latency_ms=chunk_ms
            )
            if migration
            else {"available": False, "reason": "skipped"}
        ),
        "telemetry": telemetry.sample(),
        "at": datetime.now(UTC).isoformat(),
    }
    return report


def format_bench(report: dict[str, Any]) -> str:
    load = report["telemetry"].get("host", {}).get("load_average")
    lines = [
        f"runtime bench: preset={report['preset']} device={report['device']} "
        f"threads={report['torch_threads']} model load {report['model_load_s']} s"
        + (f"; host load average at the end {', '.join(f'{x:.2f}' for x in load)}" if load else ""),
        "",
        "coalescing (median per step, per-chunk latency = step time; engine vs bare = median of the",
        "per-round ratios; bookkeeping = step time outside the model call and frame copy)",
        f"{'B':>3} {'engine ms':>10} {'bare ms':>9} {'vs bare':>8} {'bookkeep':>9} "
        f"{'chunks/s':>9} {'1-at-a-time':>12} {'speedup':>8} {'encode ms':>10}",
    ]
    for row in report["coalescing"]:
        lines.append(
            f"{row['batch']:>3} {row['engine_step_ms']:>10.2f} {row['bare_forward_ms']:>9.2f} "
            f"{row['engine_overhead_pct']:>+7.1f}% "
            f"{row['engine_bookkeeping_pct_of_step']:>8.2f}% {row['chunks_per_s_batched']:>9.1f} "
            f"{row['chunks_per_s_one_at_a_time']:>12.1f} {row['batching_speedup']:>7.2f}x "
            f"{row['encode_ms_per_chunk_median']:>10.2f}"
        )
    lines += [
        "",
        "offload (suspend = state → host, resume = host → device; whole call, and in brackets the",
        "median per-round throughput ratio to a plain copy of the same bytes: call / copy only)",
    ]
    for name, off in report["offload"].items():
        lines.append(
            f"  {name:>9} ({off['state_bytes']:,} B): suspend {off['suspend_call_gbps']:.2f} GB/s "
            f"({off['suspend_vs_plain']:.0%} / {off['suspend_copy_vs_plain']:.0%}), resume "
            f"{off['resume_call_gbps']:.2f} GB/s ({off['resume_vs_plain']:.0%} / "
            f"{off['resume_copy_vs_plain']:.0%}); plain copy {off['plain_copy_d2h_gbps']:.2f} / "
            f"{off['plain_copy_h2d_gbps']:.2f} GB/s; {off['suspend_ms_median']:.3f} / "
            f"{off['resume_ms_median']:.3f} ms per call"
        )
    lines += [
        "",
        "state bytes per session:",
    ]
    for name, row in report["state_sizes"].items():
        lines.append(f"  {name:>9}: {row['state_bytes']:>14,} B ({row['state_gb']} GB), {row['video']}")
    proj = report["wan_1_3b_projection"]
    lines += [
        "",
        f"wan-1.3b projection: offload over PCIe {proj['offload_ms_pcie']} ms, migration NVLink "
        f"{proj['migration_ms_nvlink']} ms / PCIe-staged {proj['migration_ms_pcie_staged']} ms "
        f"(paper: {proj['paper_migration_ms'][0]:g}–{proj['paper_migration_ms'][1]:g} ms)",
        _format_migration(report["migration"]),
        f"telemetry: nvml={report['telemetry']['nvml']} {report['telemetry'].get('reason', '')}",
    ]
    return "\n".join(lines)


def _format_migration(migration: dict[str, Any]) -> str:
    if not migration.get("available"):
        return f"migration: not measured ({migration.get('reason') or migration.get('error')})"
    if "skipped" in migration:
        return f"migration: skipped ({migration['skipped']})"
    parts = []
    for row in migration.get("results", []):
        parts.append(
            f"{row['nbytes']:,} B over {migration.get('backend')}: {row['migration_gbps']:.2f} GB/s vs raw "
            f"socket {row['raw_gbps']:.2f} GB/s ({row['ratio_to_raw']:.0%}); stall "
            f"{row['stall_ms']:.1f} ms = {row['stall_fraction_of_chunk']:.1%} of a "
            f"{migration['chunk_latency_ms']:.1f} ms chunk"
        )
    return "migration: " + "; ".join(parts)


# -- profiling for the scheduler's simulator ------------------------------------------------------


def _memory_limit_sessions(model: StreamingVideoModel, state_bytes: int, reserve: float = 0.1) -> int:
    if model.device.type == "cuda":
        free, total = torch.cuda.mem_get_info(model.device)
        budget = free - reserve * total
    else:
        budget = psutil.virtual_memory().available * (1.0 - reserve)
    return max(1, int(budget // state_bytes))


def _weights_bytes(model: StreamingVideoModel) -> int:
    """Bytes of the model's parameters (0 when the model exposes no ``net`` module)."""
    net = getattr(model, "net", None)
    if not isinstance(net, torch.nn.Module):
        return 0
    return sum(p.numel() * p.element_size() for p in net.parameters())


def profile_model(
    preset: str,
    *,
    device: str = "cpu",
    max_batch: int = 8,
    steps: int = 6,
    name: str | None = None,
    gpu_type: str | None = None,
    price_per_hour: float = 0.0,
    link_gbps: float | None = None,
    slo_ms: float | None = None,
) -> tuple[dict[str, Any], dict[str, Any]]:
    """Measure per-chunk latency at batch 1..K and the state size; return (profile, raw figures).

    `profile` is the GPU profile the scheduler's simulator loads (scheduling/core/gpu_profiles.py):
    latency points are made non-decreasing (a running maximum over batch sizes, since a noisy
    measurement must not claim that more load is faster); `raw` keeps the medians as measured.
    `provisioning_delay_s` is the measured model build/load time (boot time is not included).
    `scale_out` carries the measured phases (scheduling/core/provisioning.py): ``process_up`` (this
    process's creation to the start of profiling: interpreter, Django and torch imports — a worker
    starts the same way) and ``weights_disk`` (the model build from local storage), the weights'
    bytes and the effective disk rate they imply, so the simulator can compute a delay by source.
    """
    if max_batch < 2:
        raise ValueError("profile needs --max-batch >= 2 (the latency curve needs two points)")
    check_device(device)
    process_up_s = max(0.0, time.time() - psutil.Process().create_time())
    started = time.perf_counter()
    model = build_model(preset, device=device)
    _sync(model.device)
    load_s = time.perf_counter() - started
    engine = ChunkEngine(model, max_batch=max_batch, encode_workers=1)
    for i in range(max_batch):
        engine.add_session(f"s{i}", f"profile prompt {i}", seed=i)
    raw_ms: list[float] = []
    for batch in range(1, max_batch + 1):
        due = [f"s{i}" for i in range(batch)]
        _drain(engine.step(max_batch=batch, due=due))  # warm-up at this batch size
        times = []
        for _ in range(steps):
            results = engine.step(max_batch=batch, due=due)
            times.append(results[0].generation_ms)
            _drain(results)
        raw_ms.append(statistics.median(times))
    state_bytes = engine.state_bytes("s0")
    memory_sessions = _memory_limit_sessions(model, state_bytes)
    engine.close()
    offload = bench_offload(model, repeats=5)
    host_link_gbps = min(offload["suspend_call_gbps"], offload["resume_call_gbps"])
    device_name = str(model.device)
    if model.device.type == "cuda":
        device_name = torch.cuda.get_device_name(model.device)
    if link_gbps is None and model.device.type == "cuda":
        link_gbps = NVLINK_GBPS  # nominal peer link; pass --link-gbps with a measured figure
    profile = scheduler_profile(
        name=name or f"{(gpu_type or model.device.type)}-{preset}",
        gpu_type=gpu_type or model.device.type,
        measured_ms=list(enumerate(raw_ms, start=1)),
        max_batch=max_batch,
        memory_limit_sessions=memory_sessions,
        price_per_hour=price_per_hour,
        provisioning_delay_s=load_s,
        state_bytes=state_bytes,
        host_link_gbps=host_link_gbps,
        link_gbps=link_gbps,
        slo_ms=slo_ms,
        source=f"profile_model --preset {preset} on {device_name}, {datetime.now(UTC).isoformat()}",
    )
    weights = _weights_bytes(model)
    if weights and load_s > 0:
        profile["scale_out"] = {
            # The path this profile was measured on: its own delay is boot + the disk load.
            "path": "disk",
            "weights_bytes": weights,
            "measured_phases_s": {"process_up": round(process_up_s, 3), "weights_disk": round(load_s, 3)},
            "topology": {
                # Disk: the rate the measured build implies. The network links are not measured
                # here: the peer link is --link-gbps (or the nominal NVLink), the host copy PCIe the
                # measured pinned-copy rate; one GPU per host.
                "nvme_gbps": round(weights / load_s / GB, 6),
                "pcie_gbps": round(host_link_gbps, 3),
                "rdma_gbps": float(link_gbps) if link_gbps is not None else round(host_link_gbps, 3),
                "hop_latency_s": 0.01,
            },
            "gpus_per_host": 1,
            "hosts_per_domain": 1,
            "source": "profile_model: process_up and weights_disk measured; network links nominal",
        }
    raw: dict[str, Any] = {
        "offload": offload,
        "latency_ms_measured": [[b, round(ms, 3)] for b, ms in enumerate(raw_ms, start=1)],
        "model_load_s": load_s,
    }
    return profile, raw
