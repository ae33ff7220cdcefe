"""How long a stream command waits for the device while a job step runs (``manage.py
bench_job_abandon``; docs/jobs.md "Abandoning a step").

For each repeat one job step runs on the engine while a timer thread appends a session ``start`` to
a real Redis command stream at a uniformly random point of the step (over the step's measured
median). The figure is the time from that append to the step's return, i.e. until the device is
free for the stream:

- ``finish``: as before this change: the step runs to its end (the hot loop reads the command
  after it);
- ``abandon``: a `StreamClaimWatch` reads the stream beside the step and sets the flag the step
  checks at its block boundaries; the step returns at the next boundary, its work lost.

And ``final_decode_ms``: a finished video's decode (`job_frames`), which the daemon runs right after
the last step with no block boundary, set beside the step's median.

The two modes alternate, repeat by repeat, on the same job. Everything here measures; nothing
asserts.
"""

from __future__ import annotations

import random
import statistics
import threading
import time
import uuid
from typing import Any

import redis
import torch

from contracts.bench import describe_machine, rounds, summarize
from contracts.wire.channel import StreamClaimWatch, send_command, stream_key
from workers.runtime.engine import ChunkEngine
from workers.runtime.models import build_model

Shape = tuple[str, int, int, int]  # (kind, width, height, frames)
MODES = ("finish", "abandon")


def _fresh_job(engine: ChunkEngine, shape: Shape, steps: int) -> None:
    if "job" in engine.sessions():
        engine.remove("job")
    kind, width, height, frames = shape
    engine.add_job(
        "job",
        kind=kind,
        prompt="benchmark prompt",
        seed=1,
        width=width,
        height=height,
        frames=frames,
        steps=steps,
    )


def _arrive(arrived: list[float], client: redis.Redis, worker: str) -> None:
    """A session's ``start`` lands on the worker's command stream now."""
    arrived.append(time.perf_counter())
    send_command(client, worker, {"id": str(uuid.uuid4()), "kind": "start", "session": "s"})


def bench_claim_to_free(
    preset: str, shape: Shape, *, client: redis.Redis, repeats: int, seed: int = 0, device: str = "cpu"
) -> dict[str, Any]:
    model = build_model(preset, device=device)
    kind, width, height, frames = shape
    steps = 50
    model.check_job(kind=kind, width=width, height=height, frames=frames, steps=steps)
    engine = ChunkEngine(model, encode_workers=1)
    worker = f"bench-abandon-{uuid.uuid4().hex[:8]}"
    watch = StreamClaimWatch(client, worker, poll_ms=50)
    watch.start()
    rng = random.Random(seed)
    try:
        _fresh_job(engine, shape, steps)
        step_ms = []
        for _ in range(5):  # the step's length, for where the command lands
            if engine.job_progress("job")[0] >= steps:
                _fresh_job(engine, shape, steps)
            step_ms.append(engine.job_step(["job"]).step_ms)
        typical_s = statistics.median(step_ms) / 1000.0
        waits: dict[str, list[float]] = {mode: [] for mode in MODES}
        landed = dict.fromkeys(MODES, 0)
        lost: list[float] = []
        abandoned = 0
        last_id = "0-0"
        for round_ in rounds(repeats, warmup=1):
            for mode in MODES:
                if engine.job_progress("job")[0] >= steps:
                    _fresh_job(engine, shape, steps)
                arrived: list[float] = []
                timer = threading.Timer(rng.uniform(0.0, typical_s), _arrive, (arrived, client, worker))
                if mode == "abandon":
                    watch.arm(last_id)
                timer.start()
                report = engine.job_step(["job"], abandon=watch.claimed if mode == "abandon" else None)
                freed = time.perf_counter()
                watch.disarm()
                timer.join()
                # The next round's watch starts after this command, as the daemon's would after
                # reading it.
                last_id = client.xrevrange(stream_key(worker), count=1)[0][0].decode()
                if not round_.measured:
                    continue
                if arrived[0] >= freed:
                    continue  # the step ended first (it ran shorter than its median): not a claim
                landed[mode] += 1
                waits[mode].append((freed - arrived[0]) * 1000.0)
                if report.abandoned:
                    abandoned += 1
                    lost.append(report.step_ms)
        decode_ms = _final_decodes(engine, steps, repeats=max(5, repeats // 4))
    finally:
        watch.stop()
        watch.join(timeout=2)
        client.delete(stream_key(worker))
        engine.close()
    return {
        "preset": preset,
        "shape": list(shape),
        "step_ms_p50": round(typical_s * 1000.0, 3),
        "landed": landed,
        "claim_to_free_ms": {mode: summarize(values) for mode, values in waits.items()},
        "abandoned": abandoned,
        "lost_ms": summarize(lost),
        "final_decode_ms": summarize(decode_ms),
    }


def _final_decodes(engine: ChunkEngine, steps: int, *, repeats: int) -> list[float]:
    """The finished job's decode (`job_frames`), timed ``repeats`` times: the daemon runs it on its
    loop right after the last step, with no block boundary, so a claim landing then waits for it."""
    while engine.job_progress("job")[0] < steps:
        engine.job_step(["job"])
    cuda = engine.model.device.type == "cuda"
    out = []
    for _ in range(repeats):
        started = time.perf_counter()
        engine.job_frames("job")  # copies to the host: the decode's kernels are done at return
        if cuda:
            torch.cuda.synchronize(engine.model.device)
        out.append((time.perf_counter() - started) * 1000.0)
    return out


def run_abandon_bench(
    presets: list[tuple[str, Shape]], *, client: redis.Redis, repeats: int, seed: int = 0
) -> dict[str, Any]:
    return {
        "machine": describe_machine(),
        "torch_threads": torch.get_num_threads(),
        "repeats": repeats,
        "rows": [
            bench_claim_to_free(preset, shape, client=client, repeats=repeats, seed=seed)
            for preset, shape in presets
        ],
    }


def format_abandon_bench(report: dict[str, Any]) -> str:
    lines = [f"stream command → device free, {report['repeats']} repeats per mode"]
    for row in report["rows"]:
        kind, width, height, frames = row["shape"]
        finish, abandon = row["claim_to_free_ms"]["finish"], row["claim_to_free_ms"]["abandon"]
        lines.append(
            f"  {row['preset']} {kind} {width}x{height}x{frames} (step p50 {row['step_ms_p50']:.2f} ms, "
            f"commands landed in a step: {row['landed']['finish']} / {row['landed']['abandon']}): finish p50 {finish['p50']:.2f} / p99 {finish['p99']:.2f} ms; "
            f"abandon p50 {abandon['p50']:.2f} / p99 {abandon['p99']:.2f} ms "
            f"({row['abandoned']} steps abandoned, work lost p50 {row['lost_ms']['p50']:.2f} ms); "
            f"final decode p50 {row['final_decode_ms']['p50']:.2f} / max {row['final_decode_ms']['max']:.2f} ms"
        )
    return "\n".join(lines)
