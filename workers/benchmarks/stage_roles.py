"""``manage.py bench_stage_roles``: a ``DC`` worker fed by an ``E`` worker process vs a monolithic one.

Both engines run in this process, one after the other in alternating rounds (same load for both); the
encoder worker is a second process serving encodings over a stage link (``stages/service.py``: its
own store, Gloo on CPU, NCCL on GPUs). Figures (ms):

- ``chunk_ms``: a steady chunk's generation time at batch ``sessions`` (no prompt switch), DC and EDC;
- ``switch_chunk_ms``: from a prompt switch scheduled at every session's next chunk to that chunk
  generated for all of them: EDC encodes inside the step, DC asks the encoder when the switch is set
  and steps once the embeddings are back;
- ``encode_round_trip_ms``: one new prompt's embeddings fetched from the encoder process (a cache
  miss at both ends), beside ``local_encode_ms``, the same encode in this process.
"""

from __future__ import annotations

import multiprocessing as mp
import time
from collections.abc import Callable
from typing import Any

import torch

from contracts import bench
from workers.runtime.engine import ChunkEngine
from workers.runtime.stages.host import StageHost
from workers.runtime.stages.link import resolve_device
from workers.runtime.stages.staged_model import staged_engine_model
from workers.runtime.transport import MigrationListener


def _encoder_process(preset: str, device: str, conn: Any) -> None:
    torch.set_num_threads(1)
    listener = MigrationListener(device=device)
    engine = ChunkEngine(staged_engine_model(preset, "E", device=device), encode_workers=1)
    host = StageHost(engine, store_address=listener.address)
    host.start()
    conn.send(listener.address)
    conn.recv()  # until told to stop
    conn.send(host.report())
    host.close()
    engine.close()
    listener.close()


def _step_all(engine: ChunkEngine, count: int) -> float:
    """Step until ``count`` chunks came out (a DC session may wait for its embeddings); wall ms."""
    started = time.perf_counter()
    done = 0
    while done < count:
        results = engine.step()
        done += len(results)
        if engine.model.device.type == "cuda":
            torch.cuda.synchronize(engine.model.device)
        if not results:
            time.sleep(0.0005)
    return (time.perf_counter() - started) * 1000.0


def run_stage_roles(
    preset: str = "tiny",
    *,
    device: str = "cpu",
    sessions: int = 2,
    repeats: int = 20,
    warmup: int = 3,
    progress: Callable[[str], Any] = print,
) -> dict[str, Any]:
    if sessions < 1 or repeats < 1 or warmup < 0:
        raise ValueError("--sessions and --repeats must be >= 1, --warmup >= 0")
    target = str(resolve_device(device))
    torch.set_num_threads(1)
    context = mp.get_context("spawn")
    parent, child = context.Pipe()
    peer_device = target
    if target.startswith("cuda"):
        # NCCL allows one rank per GPU: the encoder process takes the next one.
        index = torch.device(target).index or 0
        if torch.cuda.device_count() < 2:
            raise ValueError("on CUDA the encoder process needs a second GPU (NCCL: one rank per GPU)")
        peer_device = f"cuda:{(index + 1) % torch.cuda.device_count()}"
    process = context.Process(target=_encoder_process, args=(preset, peer_device, child), daemon=True)
    process.start()
    progress(f"encoder process on {peer_device} ...")
    address = parent.recv()
    dc = ChunkEngine(staged_engine_model(preset, "DC", device=target), max_batch=sessions, encode_workers=1)
    host = StageHost(dc)
    started = time.perf_counter()
    host.use_encoder({"worker": "bench-encoder", "address": address})
    connect_ms = (time.perf_counter() - started) * 1000.0
    edc = ChunkEngine.from_preset(preset, device=target, max_batch=sessions, encode_workers=1)
    engines = {"DC": dc, "EDC": edc}
    for engine in engines.values():
        for i in range(sessions):
            engine.add_session(f"s{i}", "a heron over the river", seed=i)
    chunk: dict[str, list[float]] = {"DC": [], "EDC": []}
    switch: dict[str, list[float]] = {"DC": [], "EDC": []}
    round_trip: list[float] = []
    local: list[float] = []
    progress(f"{preset}: {sessions} session(s), {warmup} + {repeats} rounds ...")
    for round_ in bench.rounds(repeats, warmup):
        order = list(engines.items())
        if round_.index % 2:
            order.reverse()  # alternate who goes first
        for role, engine in order:
            results = []
            while not results:
                results = engine.step()
            if round_.measured:
                chunk[role].append(results[0].generation_ms)
            prompt = f"round {round_.index}: a heron, {role}"
            for sid in engine.sessions():
                engine.set_prompt(sid, prompt, engine.next_chunk(sid))
            elapsed = _step_all(engine, sessions)
            if round_.measured:
                switch[role].append(elapsed)
        fresh = f"a fresh prompt {round_.index}"
        started = time.perf_counter()
        host.encodings.get(fresh)
        elapsed = (time.perf_counter() - started) * 1000.0
        started = time.perf_counter()
        edc.model.encode_prompt(fresh)
        if round_.measured:
            round_trip.append(elapsed)
            local.append((time.perf_counter() - started) * 1000.0)
    parent.send("stop")
    encoder_report = parent.recv()
    process.join(30)
    host.close()
    for engine in engines.values():
        engine.close()
    return {
        "benchmark": "stage_roles",
        "preset": preset,
        "device": target,
        "encoder_device": peer_device,
        "sessions": sessions,
        "repeats": repeats,
        "warmup": warmup,
        "encoder_connect_ms": round(connect_ms, 3),
        "chunk_ms": {role: bench.summarize(values) for role, values in chunk.items()},
        "switch_chunk_ms": {role: bench.summarize(values) for role, values in switch.items()},
        "encode_round_trip_ms": bench.summarize(round_trip),
        "local_encode_ms": bench.summarize(local),
        "weights_bytes": {
            "DC": dc.model.staged.loaded_weight_bytes(),
            "EDC": sum(t.numel() * t.element_size() for t in edc.model.net.state_dict().values()),
        },
        "encoder": encoder_report.get("encoder", {}),
    }


def format_report(report: dict[str, Any]) -> str:
    def line(label: str, summary: dict[str, Any]) -> str:
        return f"  {label:<34} p50 {summary['p50']:.3f}  p99 {summary['p99']:.3f}  (n={summary['count']})"

    lines = [
        f"stage roles: {report['preset']} on {report['device']}, encoder process on {report['encoder_device']}, "
        f"{report['sessions']} session(s) per batch (ms)",
        line("chunk, DC fed by E", report["chunk_ms"]["DC"]),
        line("chunk, EDC monolithic", report["chunk_ms"]["EDC"]),
        line("prompt-switch chunk, DC", report["switch_chunk_ms"]["DC"]),
        line("prompt-switch chunk, EDC", report["switch_chunk_ms"]["EDC"]),
        line("encode round trip (DC -> E -> DC)", report["encode_round_trip_ms"]),
        line("encode in process (EDC)", report["local_encode_ms"]),
        f"  encoder connect {report['encoder_connect_ms']:.3f} ms; weights DC {report['weights_bytes']['DC']} B, "
        f"EDC {report['weights_bytes']['EDC']} B",
    ]
    return "\n".join(lines)


__all__ = ["format_report", "run_stage_roles"]
