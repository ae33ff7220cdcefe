"""One-shot job benchmarks (``manage.py bench_jobs_runtime``, ``profile_model --one-shot``).

Issue 14's targets on CPU: pause < 1 ms, resume < 1 % of a step. Here

- *pause* is the engine's `suspend` of a job at a step boundary (its state region copied to host
  memory and the device copy freed): what a ``job_pause`` costs once the daemon reads it. The
  daemon reads commands between steps, so a pause also waits for the step in flight (at most one
  `step_ms`, reported beside it);
- *resume* is `resume` of that record (the region copied back), as a share of one step of the job;
- step time per batch size: one batched `job_step` of jobs of one shape.

Everything here measures; nothing asserts. Figures are medians over interleaved repeats.
"""

from __future__ import annotations

import statistics
import time
from typing import Any

import torch

from contracts.bench import describe_machine, rounds, summarize
from workers.runtime.engine import ChunkEngine
from workers.runtime.models import build_model
from workers.runtime.models.base import StreamingVideoModel

Shape = tuple[str, int, int, int]  # (kind, width, height, frames)


def parse_resolution(text: str) -> tuple[int, int]:
    """ "WxH" → (width, height); ValueError naming the bad value."""
    try:
        width, height = (int(part) for part in text.lower().split("x"))
    except ValueError:
        raise ValueError(f"resolution {text!r} is not WxH") from None
    if width < 1 or height < 1:
        raise ValueError(f"resolution {text!r} must be positive")
    return width, height


def parse_video(text: str) -> tuple[int, int, int]:
    """ "WxHxF" → (width, height, frames); ValueError naming the bad value."""
    resolution, _, frames = text.rpartition("x")
    width, height = parse_resolution(resolution)
    return width, height, int(frames)


def _sync(model: StreamingVideoModel) -> None:
    if model.device.type == "cuda":
        torch.cuda.synchronize(model.device)


def _add_jobs(engine: ChunkEngine, shape: Shape, count: int, *, steps: int, prefix: str) -> list[str]:
    """`count` jobs of `shape` taking `steps` steps (or the count the model fixes for that shape:
    `job_steps_for`; `_readd_finished` starts them again when they end before the rounds do)."""
    kind, width, height, frames = shape
    steps = engine.model.job_steps_for(kind=kind, frames=frames, steps=steps)
    ids = [f"{prefix}{i}" for i in range(count)]
    for i, job_id in enumerate(ids):
        engine.add_job(
            job_id,
            kind=kind,
            prompt=f"benchmark prompt {i}",
            seed=i,
            width=width,
            height=height,
            frames=frames,
            steps=steps,
        )
    return ids


def _readd_finished(engine: ChunkEngine, shape: Shape, ids: list[str], *, prefix: str) -> None:
    """Start the jobs again (same ids) once they have run all their steps."""
    step, steps = engine.job_progress(ids[0])
    if step >= steps:
        for job_id in ids:
            engine.remove(job_id)
        _add_jobs(engine, shape, len(ids), steps=steps, prefix=prefix)


def step_seconds(model: StreamingVideoModel, shape: Shape, batch: int, *, repeats: int) -> float:
    """Median seconds of one batched job step of `batch` jobs of `shape` (after one warm-up)."""
    engine = ChunkEngine(model, encode_workers=1)
    try:
        ids = _add_jobs(engine, shape, batch, steps=repeats + 1, prefix="step")
        times = []
        for round_ in rounds(repeats, warmup=1):
            _readd_finished(engine, shape, ids, prefix="step")
            report = engine.job_step(ids)
            if round_.measured:
                times.append(report.step_ms / 1000.0)
        return statistics.median(times)
    finally:
        engine.close()


def bench_pause_resume(model: StreamingVideoModel, shape: Shape, *, repeats: int) -> dict[str, Any]:
    """Suspend/resume of one job at a step boundary, interleaved with its steps."""
    engine = ChunkEngine(model, encode_workers=1)
    try:
        (job_id,) = _add_jobs(engine, shape, 1, steps=repeats + 2, prefix="pause")
        pause_ms, resume_ms, step_ms = [], [], []
        for round_ in rounds(repeats, warmup=1):
            _readd_finished(engine, shape, [job_id], prefix="pause")
            step = engine.job_step([job_id])
            _sync(model)
            started = time.perf_counter()
            record = engine.suspend(job_id)
            paused = time.perf_counter()
            engine.resume(job_id, record)
            _sync(model)
            resumed = time.perf_counter()
            if round_.measured:
                step_ms.append(step.step_ms)
                pause_ms.append((paused - started) * 1000.0)
                resume_ms.append((resumed - paused) * 1000.0)
        state_bytes = engine.state_bytes(job_id)
    finally:
        engine.close()
    step_p50 = statistics.median(step_ms)
    return {
        "shape": list(shape),
        "state_bytes": state_bytes,
        "step_ms": summarize(step_ms),
        "pause_ms": summarize(pause_ms),
        "resume_ms": summarize(resume_ms),
        "resume_pct_of_step": round(100.0 * statistics.median(resume_ms) / step_p50, 3),
        "pause_target_met": statistics.median(pause_ms) < 1.0,
        "resume_target_met": statistics.median(resume_ms) < 0.01 * step_p50,
    }


def run_jobs_bench(
    preset: str,
    *,
    device: str = "cpu",
    shapes: list[Shape],
    batches: tuple[int, ...],
    repeats: int,
) -> dict[str, Any]:
    model = build_model(preset, device=device)
    for kind, width, height, frames in shapes:
        steps = model.job_steps_for(kind=kind, frames=frames, steps=repeats + 2)
        model.check_job(kind=kind, width=width, height=height, frames=frames, steps=steps)
    return {
        "preset": preset,
        "device": str(model.device),
        "pause_resume": [bench_pause_resume(model, shape, repeats=repeats) for shape in shapes],
        "step_s": [
            {
                "shape": list(shape),
                "batch": batch,
                "step_s": round(step_seconds(model, shape, batch, repeats=repeats), 6),
            }
            for shape in shapes
            for batch in batches
        ],
    }


def format_jobs_bench(report: dict[str, Any]) -> str:
    lines = [f"one-shot jobs on {report['preset']} ({report['device']})"]
    for row in report["pause_resume"]:
        kind, width, height, frames = row["shape"]
        lines.append(
            f"  {kind} {width}x{height}x{frames}: state {row['state_bytes']} B, step p50 "
            f"{row['step_ms']['p50']:.3f} ms; pause p50 {row['pause_ms']['p50']:.4f} ms "
            f"(p99 {row['pause_ms']['p99']:.4f}) [target < 1 ms: {'met' if row['pause_target_met'] else 'MISSED'}]; "
            f"resume p50 {row['resume_ms']['p50']:.4f} ms = {row['resume_pct_of_step']:.3f} % of a step "
            f"[target < 1 %: {'met' if row['resume_target_met'] else 'MISSED'}]"
        )
    lines.append("  step time per batch size:")
    for row in report["step_s"]:
        kind, width, height, frames = row["shape"]
        lines.append(
            f"    {kind} {width}x{height}x{frames} batch {row['batch']}: {row['step_s'] * 1000:.3f} ms"
        )
    return "\n".join(lines)


def profile_one_shot(
    preset: str,
    *,
    kind: str,
    resolutions: list[tuple[int, int]],
    frames: list[int],
    batches: tuple[int, ...],
    repeats: int,
    device: str = "cpu",
) -> dict[str, Any]:
    """Step seconds per (resolution, frames, batch): the job-cost profile the simulator reads
    (issue 14). Shape: {"model", "kind", "points": [{"width", "height", "frames", "batch",
    "step_s"}], "machine": str}."""
    model = build_model(preset, device=device)
    counts = [1] if kind == "image" else frames
    points = []
    for width, height in resolutions:
        for count in counts:
            steps = model.job_steps_for(kind=kind, frames=count, steps=repeats + 1)
            model.check_job(kind=kind, width=width, height=height, frames=count, steps=steps)
            for batch in batches:
                seconds = step_seconds(model, (kind, width, height, count), batch, repeats=repeats)
                points.append(
                    {
                        "width": width,
                        "height": height,
                        "frames": count,
                        "batch": batch,
                        "step_s": round(seconds, 6),
                    }
                )
    return {"model": preset, "kind": kind, "points": points, "machine": machine_line(model)}


def machine_line(model: StreamingVideoModel) -> str:
    """The machine in one line: the device, and the CPU with its cores and torch threads."""
    machine = describe_machine()
    cpu = (
        f"{machine['cpu']}, {machine['cores_logical']} logical cores, torch threads {torch.get_num_threads()}"
    )
    if model.device.type == "cuda":
        return f"{torch.cuda.get_device_name(model.device)} ({cpu})"
    return f"cpu: {cpu}"
