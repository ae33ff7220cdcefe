"""Step time of one video job at sequence-parallel degrees (``manage.py bench_job_sp``).

Each degree runs the same job's step with its tokens split across that many devices
(``StreamingVideoModel.sequence_parallel``): the worker's CUDA devices where there are enough, else
the device repeated — on one CPU that measures the split's overhead, never a speed-up. The latents
after the measured steps are compared with degree 1's (max abs difference).
"""

from __future__ import annotations

import time
from typing import Any

import torch

from contracts import bench
from workers.runtime.models import build_model


def sp_devices(device: str, degree: int) -> list[str]:
    """``degree`` devices: distinct CUDA devices when ``device`` is CUDA and there are enough, else
    ``device`` repeated (one device running every shard in turn)."""
    if device.startswith("cuda") and torch.cuda.device_count() >= degree:
        return [f"cuda:{i}" for i in range(degree)]
    return [device] * degree


def run_job_sp_bench(
    preset: str, *, device: str, width: int, height: int, frames: int, degrees: tuple[int, ...], repeats: int
) -> dict[str, Any]:
    model = build_model(preset, device=device)
    rows, reference = [], None
    for degree in degrees:
        devices = sp_devices(device, degree)
        state = model.create_job(
            kind="video", prompt="bench", seed=1, width=width, height=height, frames=frames, steps=repeats + 1
        )
        times = []
        with model.sequence_parallel(devices):
            for round_ in bench.rounds(repeats, warmup=1):
                started = time.perf_counter()
                model.job_step([state])
                if model.device.type == "cuda":
                    torch.cuda.synchronize()
                if round_.measured:
                    times.append((time.perf_counter() - started) * 1000.0)
        latents = state.tensors["latents"].float().cpu()
        reference = latents if reference is None else reference
        rows.append(
            {
                "sp": degree,
                "devices": devices,
                "step_ms": bench.summarize(times),
                "max_abs_diff_vs_first": float((latents - reference).abs().max()),
            }
        )
    return {
        "preset": preset,
        "device": device,
        "video": {"width": width, "height": height, "frames": frames},
        "repeats": repeats,
        "threads": torch.get_num_threads(),
        "rows": rows,
    }


def format_job_sp_bench(report: dict[str, Any]) -> str:
    video = report["video"]
    lines = [
        f"video job step, {report['preset']} {video['width']}x{video['height']}x{video['frames']} on "
        f"{report['device']} ({report['threads']} threads, {report['repeats']} steps per degree)",
        f"{'SP':>3} {'devices':<28} {'p50 ms':>9} {'p99 ms':>9} {'max |Δ| vs first':>17}",
    ]
    for row in report["rows"]:
        shown = ",".join(row["devices"])
        lines.append(
            f"{row['sp']:>3} {shown[:28]:<28} {row['step_ms']['p50']:>9.2f} {row['step_ms']['p99']:>9.2f} "
            f"{row['max_abs_diff_vs_first']:>17.3g}"
        )
    return "\n".join(lines)
