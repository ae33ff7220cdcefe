"""``manage.py bench_stage_decode``: a one-shot job's final decode on a ``C`` worker process vs in
process.

A ``D`` worker's job steps here; its final decode goes to a decoder worker process over a stage link
(``stages/service.py``: the C worker's own store, Gloo on CPU, NCCL on GPUs). Figures (ms), per
finished job of the given shape:

- ``decode_round_trip_ms``: latents and meta out, frames back (`Decoders.decode_job`, what a ``D``
  or ``ED`` worker's `job_frames` does);
- ``local_decode_ms``: the same decode in this process (an ``EDC`` or ``DC`` worker's `job_frames`);
- ``identical``: whether the two frame tensors were equal in every round.
"""

from __future__ import annotations

import multiprocessing as mp
import time
from collections.abc import Callable
from typing import Any

import torch

from contracts import bench
from workers.runtime.engine import ChunkEngine
from workers.runtime.models import build_model
from workers.runtime.stages.host import StageHost
from workers.runtime.stages.link import resolve_device
from workers.runtime.stages.staged_model import staged_engine_model
from workers.runtime.transport import MigrationListener


def _decoder_process(preset: str, device: str, conn: Any) -> None:
    torch.set_num_threads(1)
    listener = MigrationListener(device=device)
    engine = ChunkEngine(staged_engine_model(preset, "C", device=device))
    host = StageHost(engine, store_address=listener.address)
    host.start()
    conn.send(listener.address)
    conn.recv()  # until told to stop
    conn.send(host.report())
    host.close()
    engine.close()
    listener.close()


def run_stage_decode(
    preset: str = "tiny",
    *,
    device: str = "cpu",
    kind: str = "video",
    size: int = 64,
    frames: int = 16,
    repeats: int = 10,
    warmup: int = 2,
    progress: Callable[[str], Any] = print,
) -> dict[str, Any]:
    if repeats < 1 or warmup < 0 or size < 1 or frames < 1:
        raise ValueError("--repeats, --size and --frames must be >= 1, --warmup >= 0")
    target = str(resolve_device(device))
    torch.set_num_threads(1)
    peer_device = target
    if target.startswith("cuda"):
        index = torch.device(target).index or 0
        if torch.cuda.device_count() < 2:
            raise ValueError("on CUDA the decoder process needs a second GPU (NCCL: one rank per GPU)")
        peer_device = f"cuda:{(index + 1) % torch.cuda.device_count()}"
    context = mp.get_context("spawn")
    parent, child = context.Pipe()
    process = context.Process(target=_decoder_process, args=(preset, peer_device, child), daemon=True)
    process.start()
    progress(f"decoder process on {peer_device} ...")
    address = parent.recv()
    d = staged_engine_model(preset, "D", device=target)
    started = time.perf_counter()
    d.decoders.use(address, "bench-decoder")
    connect_ms = (time.perf_counter() - started) * 1000.0
    model = build_model(preset, device=target)
    frames = 1 if kind == "image" else frames
    shape = {"kind": kind, "width": size, "height": size, "frames": frames, "steps": 1}
    round_trip: list[float] = []
    local: list[float] = []
    identical = True
    progress(f"{preset}: {kind} {size}x{size}x{frames}, {warmup} + {repeats} rounds ...")
    for round_ in bench.rounds(repeats, warmup):
        state = model.create_job(prompt=f"a heron {round_.index}", seed=round_.index, **shape)
        model.job_step([state])
        started = time.perf_counter()
        remote = d.decoders.decode_job(state.tensors["latents"], state.meta)
        elapsed = (time.perf_counter() - started) * 1000.0
        started = time.perf_counter()
        here = model.job_frames(state)
        if target.startswith("cuda"):
            torch.cuda.synchronize(target)
        local_ms = (time.perf_counter() - started) * 1000.0
        identical = identical and torch.equal(remote.cpu(), here.cpu())
        if round_.measured:
            round_trip.append(elapsed)
            local.append(local_ms)
    parent.send("stop")
    decoder_report = parent.recv()
    process.join(30)
    d.decoders.close()
    return {
        "benchmark": "stage_decode",
        "preset": preset,
        "device": target,
        "decoder_device": peer_device,
        "shape": shape,
        "repeats": repeats,
        "warmup": warmup,
        "decoder_connect_ms": round(connect_ms, 3),
        "decode_round_trip_ms": bench.summarize(round_trip),
        "local_decode_ms": bench.summarize(local),
        "identical": identical,
        "decoder": decoder_report.get("decoder", {}),
    }


def format_report(report: dict[str, Any]) -> str:
    def line(label: str, summary: dict[str, Any]) -> str:
        return f"  {label:<34} p50 {summary['p50']:.3f}  p99 {summary['p99']:.3f}  (n={summary['count']})"

    shape = report["shape"]
    return "\n".join(
        [
            f"stage decode: {report['preset']} {shape['kind']} {shape['width']}x{shape['height']}x"
            f"{shape['frames']} on {report['device']}, decoder process on {report['decoder_device']} (ms)",
            line("decode round trip (D -> C -> D)", report["decode_round_trip_ms"]),
            line("decode in process (EDC)", report["local_decode_ms"]),
            f"  decoder connect {report['decoder_connect_ms']:.3f} ms; frames identical: {report['identical']}",
        ]
    )


__all__ = ["format_report", "run_stage_decode"]
