"""Stage hand-off benchmark: embeddings and latents between two processes over a stage link.

    python manage.py bench_stage_handoff [--presets demo tiny small wan-1.3b] [--device cpu] [--json]

A peer process (forked from a forkserver that has imported torch) receives on link ``ping`` and
answers on link ``pong``, both `LinkSender`/`LinkReceiver` over the migration transport's pair
groups: Gloo on CPU, NCCL when ``--device cuda`` (the backend follows the device; NCCL allows one
rank per GPU, so the peer then runs on the next GPU and the command needs two). For each preset's
per-session embeddings and latents (``handoff_layout``) it measures:

- ``latency_ms``: one-way hand-off latency, half the round trip of a message the peer echoes back
  (count / p50 / p99 / max / mean over ``repeats``, after ``warmup`` dropped rounds);
- ``throughput``: ``stream`` messages sent back to back through the bounded link, then one
  acknowledgement: messages/s and GB/s of payload;
- ``stage_ms`` (``--stage-times``): each stage's own time for one session in this process, what a
  hand-off is weighed against (presets that fit the device only: wan-1.3b does not fit this box).
"""

from __future__ import annotations

import functools
import multiprocessing as mp
import time
from collections.abc import Callable
from typing import Any

import torch

from contracts import bench
from workers.runtime.stages.contract import build_staged, staged_class
from workers.runtime.stages.link import (
    DEFAULT_MAX_IN_FLIGHT_BYTES,
    LinkReceiver,
    LinkSender,
    connect_store,
    open_pair,
    resolve_device,
)
from workers.runtime.stages.pipeline import StageMessage
from workers.runtime.transport.pair import SOURCE_RANK, TARGET_RANK, backend_for_device, timedelta
from workers.runtime.transport.wire import byte_view

DEFAULT_PRESETS = ("demo", "tiny", "small", "wan-1.3b")
_PROMPT = "a red circle moving left on a blue background"
_TIMEOUT_S = 60.0
CONTEXT = mp.get_context("forkserver")
CONTEXT.set_forkserver_preload(["torch", "workers.runtime.stages.link"])


def _peer_main(address: str, device: str) -> None:
    """Echo ``echo`` messages back, count the others, answer ``ack`` requests; exit on ``stop``."""
    torch.set_num_threads(1)
    store = connect_store(address, timeout_s=_TIMEOUT_S)
    inbound = LinkReceiver(
        open_pair(store, "ping", TARGET_RANK, device=resolve_device(device)), idle_timeout_s=_TIMEOUT_S
    )
    outbound = LinkSender(open_pair(store, "pong", SOURCE_RANK, device=resolve_device(device)))
    try:
        while True:
            message = inbound.recv()
            if message.kind == "stop":
                break
            if message.meta.get("echo"):
                outbound.send(message)
            elif message.meta.get("ack"):
                outbound.send(StageMessage("frames", {"ack": True}))
        outbound.flush()
    finally:
        outbound.close()
        inbound.close()


class _Peer:
    def __init__(self, device: torch.device, peer_device: torch.device, max_in_flight_bytes: int) -> None:
        from torch._C._distributed_c10d import TCPStore

        self.store = TCPStore(
            "127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(_TIMEOUT_S)
        )
        address = f"127.0.0.1:{self.store.port}"
        self.process = CONTEXT.Process(target=_peer_main, args=(address, str(peer_device)), daemon=True)
        self.process.start()
        self.sender = LinkSender(
            open_pair(self.store, "ping", SOURCE_RANK, device=device), max_in_flight_bytes=max_in_flight_bytes
        )
        self.receiver = LinkReceiver(
            open_pair(connect_store(address), "pong", TARGET_RANK, device=device), idle_timeout_s=_TIMEOUT_S
        )

    def close(self) -> None:
        self.sender.send(StageMessage("stop"))
        self.sender.flush()
        self.process.join(_TIMEOUT_S)
        self.sender.close()
        self.receiver.close()


def _peer_device(device: torch.device) -> torch.device:
    """Where the peer process runs: the same CPU, or the next GPU (NCCL allows one rank per GPU)."""
    if device.type != "cuda":
        return device
    count = torch.cuda.device_count()
    if count < 2:
        raise ValueError(f"the NCCL hand-off needs two GPUs, one per process; this machine has {count}")
    return torch.device("cuda", (device.index + 1) % count)


def _payload(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    raw = torch.randint(0, 256, (torch.Size(shape).numel() * dtype.itemsize,), dtype=torch.uint8)
    return raw.view(dtype).view(shape).to(device)


def _measure(peer: _Peer, payload: torch.Tensor, *, repeats: int, warmup: int, stream: int) -> dict[str, Any]:
    one_way_ms = []
    for round_ in bench.rounds(repeats, warmup):
        started = time.perf_counter()
        peer.sender.send(StageMessage("latents", {"echo": True}, payload))
        echoed = peer.receiver.recv()
        elapsed = time.perf_counter() - started
        # Bytes, not values: random bit patterns include NaNs, which never compare equal.
        if not torch.equal(byte_view(echoed.tensor), byte_view(payload)):
            raise RuntimeError("the peer echoed different bytes")
        if round_.measured:
            one_way_ms.append(elapsed * 1000.0 / 2)
    spilled_before = peer.sender.stats.spilled_messages
    started = time.perf_counter()
    for _ in range(stream):
        peer.sender.send(StageMessage("latents", {}, payload))
    peer.sender.send(StageMessage("latents", {"ack": True}))
    peer.receiver.recv()
    seconds = time.perf_counter() - started
    nbytes = payload.numel() * payload.element_size()
    return {
        "latency_ms": bench.summarize(one_way_ms),
        "throughput": {
            "messages": stream,
            "seconds": round(seconds, 4),
            "messages_per_s": round(stream / seconds, 1),
            "gb_per_s": round(stream * nbytes / seconds / 1e9, 4),
        },
        "spilled_messages": peer.sender.stats.spilled_messages - spilled_before,
    }


def _stage_times(preset: str, device: torch.device, *, repeats: int, warmup: int) -> dict[str, Any]:
    """Each stage's time for one session (batch 1) on ``device``: what a hand-off is weighed against."""
    staged = build_staged(preset, "EDC", device=device)
    times: dict[str, list[float]] = {"encode": [], "diffuse": [], "decode": []}
    state = staged.create_diffusion_state(0, staged.encode(_PROMPT))
    cache = staged.create_decoder_cache()

    def timed(stage: str, measured: bool, run: Callable[[], Any]) -> Any:
        started = time.perf_counter()
        out = run()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        if measured:
            times[stage].append((time.perf_counter() - started) * 1000.0)
        return out

    for round_ in bench.rounds(repeats, warmup):
        timed("encode", round_.measured, functools.partial(staged.encode, _PROMPT))
        latents = timed("diffuse", round_.measured, functools.partial(staged.diffuse, [state], [None]))
        timed("decode", round_.measured, functools.partial(staged.decode, latents, [cache]))
    return {stage: bench.summarize(values) for stage, values in times.items()}


def run_stage_handoff(
    presets: tuple[str, ...] = DEFAULT_PRESETS,
    *,
    device: str = "cpu",
    repeats: int = 20,
    warmup: int = 3,
    stream: int = 50,
    max_in_flight_bytes: int = DEFAULT_MAX_IN_FLIGHT_BYTES,
    stage_time_presets: tuple[str, ...] = (),
    progress: Callable[[str], Any] = print,
) -> dict[str, Any]:
    """Hand-off figures for ``presets``; with ``stage_time_presets``, also each stage's own time
    (built whole on ``device``: keep to presets that fit it)."""
    if repeats < 1 or warmup < 0 or stream < 1:
        raise ValueError("--repeats and --stream must be >= 1, --warmup >= 0")
    layouts = {preset: staged_class(preset).handoff_layout(preset) for preset in presets}
    target = resolve_device(device)
    peer_device = _peer_device(target)
    torch.set_num_threads(1)
    peer = _Peer(target, peer_device, max_in_flight_bytes)
    results = []
    try:
        for preset, layout in layouts.items():
            for kind, (shape, dtype) in layout.items():
                progress(f"measuring {preset} {kind} {list(shape)} {dtype} ...")
                payload = _payload(shape, dtype, target)
                figures = _measure(peer, payload, repeats=repeats, warmup=warmup, stream=stream)
                row = {
                    "preset": preset,
                    "payload": kind,
                    "shape": list(shape),
                    "dtype": str(dtype).removeprefix("torch."),
                }
                row |= {"bytes": payload.numel() * payload.element_size(), **figures}
                results.append(row)
    finally:
        peer.close()
    stage_ms = {}
    for preset in stage_time_presets:
        progress(f"timing the stages of {preset} ...")
        stage_ms[preset] = _stage_times(preset, target, repeats=repeats, warmup=warmup)
    return {
        "benchmark": "stage_handoff",
        "backend": backend_for_device(target),
        "device": str(target),
        "peer_device": str(peer_device),
        "max_in_flight_bytes": max_in_flight_bytes,
        "repeats": repeats,
        "warmup": warmup,
        "results": results,
        "stage_ms": stage_ms,
    }


def format_row(row: dict[str, Any]) -> str:
    latency, throughput = row["latency_ms"], row["throughput"]
    return (
        f"{row['preset']:>9} {row['payload']:<10} {row['bytes']:>10} B  one-way p50 {latency['p50']:.3f} ms "
        f"p99 {latency['p99']:.3f} ms  stream {throughput['messages_per_s']:.0f} msg/s {throughput['gb_per_s']:.3f} GB/s"
    )


def format_report(report: dict[str, Any]) -> str:
    header = f"stage hand-off over {report['backend']} ({report['device']}), two processes"
    lines = [header, *(format_row(row) for row in report["results"])]
    for preset, stages in report["stage_ms"].items():
        figures = ", ".join(f"{stage} p50 {summary['p50']:.3f} ms" for stage, summary in stages.items())
        lines.append(f"{preset:>9} stages at batch 1: {figures}")
    return "\n".join(lines)


__all__ = ["format_report", "run_stage_handoff"]
