"""Migration benchmark: state transfer between two worker processes vs raw loopback TCP.

    python -m workers.benchmarks.migration [--json] [--out PATH] [--sizes-mb 1 16 64 256] [--device cpu] [--repeats 5]

A target process runs a ``MigrationListener`` and a plain socket server; the calling process is the
source. For each size it times (median of ``repeats``):
  * ``raw``: ``socket.sendall`` of the bytes into a preallocated ``recv_into`` buffer, plus a 1-byte ack;
  * ``migration``: ``MigrationSender.send`` end to end (hello, manifest, payload, checksums, install,
    ack) on the pair group cached from the previous migration (the steady state of a worker), the
    target receiving into a preallocated region (same footing as ``raw``);
  * ``migration_new_link``: one-shot ``send_state``, building and closing a pair group each time;
  * ``migration_cold``: cached group, but a fresh allocation on the target per migration (first-touch
    page faults included, as when a target receives a session it has no buffer for);
  * ``per_tensor`` / ``packed``: wire variants (every tensor its own messages / one flat buffer).
"""

from __future__ import annotations

import argparse
import functools
import multiprocessing as mp
import os
import socket
import statistics
import time
from typing import Any

import torch

from contracts import bench
from workers.runtime.transport.migration import MigrationListener, MigrationSender, send_state
from workers.runtime.transport.pair import backend_for_device
from workers.runtime.transport.wire import dtype_from_name

_TIMEOUT_S = 120.0
_KV_TENSORS = 8
_NO_PACKING = {"pack_below": 0}
_ONE_BUFFER = {"pack_below": 1 << 62, "segment_bytes": 1 << 62}


def make_state_region(
    nbytes: int, device: torch.device | str, seed: int = 0
) -> tuple[dict, dict[str, torch.Tensor]]:
    """A region shaped like a session's: a few large bf16 KV buffers plus small counters and RNG state."""
    device = torch.device(device)
    generator = torch.Generator().manual_seed(seed)
    tensors: dict[str, torch.Tensor] = {}
    per_kv = max(nbytes // _KV_TENSORS // 2, 1)
    for index in range(_KV_TENSORS):
        raw = torch.randint(0, 1 << 15, (per_kv,), dtype=torch.int16, generator=generator)
        tensors[f"kv.{index}"] = raw.view(torch.bfloat16).to(device)
    tensors["positions"] = torch.arange(64, dtype=torch.int64, device=device)
    tensors["rng_state"] = torch.randint(0, 256, (5056,), dtype=torch.uint8, generator=generator).to(device)
    manifest = {
        "model": "bench",
        "version": 1,
        "tensors": [{"name": k, "shape": list(v.shape), "dtype": str(v.dtype)} for k, v in tensors.items()],
        "meta": {},
    }
    return manifest, tensors


def _region_nbytes(tensors: dict[str, torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors.values())


def _target_main(device: str, commands: Any, replies: Any) -> None:
    torch.set_num_threads(1)
    listener = MigrationListener(device)
    server = socket.create_server(("127.0.0.1", 0))
    replies.put((listener.address, server.getsockname()[1]))
    connection, _ = server.accept()
    connection.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    preallocated: dict[str, torch.Tensor] = {}
    raw_buffer = bytearray()
    while True:
        command, nbytes = commands.get()
        if command == "stop":
            return
        if command == "raw":
            if len(raw_buffer) != nbytes:
                raw_buffer = bytearray(nbytes)
            view, received = memoryview(raw_buffer), 0
            while received < nbytes:
                received += connection.recv_into(view[received:], nbytes - received)
            connection.sendall(b"k")
            continue
        warm = command == "migrate_warm"

        def allocate(manifest: dict, warm: bool = warm) -> dict[str, torch.Tensor]:
            names = [entry["name"] for entry in manifest["tensors"]]
            if (
                not warm
                or [*preallocated] != names
                or any(list(preallocated[e["name"]].shape) != e["shape"] for e in manifest["tensors"])
            ):
                fresh = _empty_region(manifest, device)
                if warm:
                    preallocated.clear()
                    preallocated.update(fresh)
                return fresh
            return dict(preallocated)

        listener.receive(_TIMEOUT_S, lambda manifest, tensors: None, allocate=allocate)


def _empty_region(manifest: dict, device: str) -> dict[str, torch.Tensor]:
    return {
        e["name"]: torch.empty(e["shape"], dtype=dtype_from_name(e["dtype"]), device=device)
        for e in manifest["tensors"]
    }


def bench_migration(
    nbytes_list: list[int],
    device: torch.device | str = "cpu",
    *,
    repeats: int = 3,
    target_device: str | None = None,
) -> dict[str, Any]:
    """Measure migration and raw-socket throughput for each size; returns a JSON-able dict."""
    device = torch.device(device)
    backend = backend_for_device(device)
    if target_device is None:
        target_device = "cuda:1" if device.type == "cuda" else str(device)
    if device.type == "cuda" and torch.cuda.device_count() < 2:
        return {"device": str(device), "backend": backend, "skipped": "NCCL migration needs two CUDA devices"}
    torch.set_num_threads(1)
    context = mp.get_context("spawn")
    commands, replies = context.Queue(), context.Queue()
    target = context.Process(target=_target_main, args=(target_device, commands, replies), daemon=True)
    target.start()
    results = []
    try:
        address, raw_port = replies.get(timeout=60)
        raw = socket.create_connection(("127.0.0.1", raw_port), timeout=_TIMEOUT_S)
        raw.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        epoch = 0

        sender = MigrationSender(device)

        def migrate(
            nbytes: int, tensors: dict, manifest: dict, command: str, new_link: bool = False, **wire: Any
        ) -> dict[str, float]:
            nonlocal epoch
            epoch += 1
            commands.put((command, nbytes))
            send = functools.partial(send_state, device=device) if new_link else sender.send
            report = send(
                address, manifest, tensors, timeout_s=_TIMEOUT_S, session_id="bench", epoch=epoch, **wire
            )
            return {"seconds": report.seconds, "transfer_s": report.transfer_s, "connect_s": report.connect_s}

        def raw_once(nbytes: int, payload: memoryview) -> dict[str, float]:
            commands.put(("raw", nbytes))
            started = time.perf_counter()
            raw.sendall(payload)
            if raw.recv(1) != b"k":
                raise RuntimeError("raw socket peer did not ack")
            return {"seconds": time.perf_counter() - started}

        for requested in nbytes_list:
            manifest, tensors = make_state_region(requested, device)
            nbytes = _region_nbytes(tensors)
            payload = memoryview(torch.randint(0, 256, (nbytes,), dtype=torch.uint8).numpy())
            variants = {
                "raw": lambda nbytes=nbytes, payload=payload: raw_once(nbytes, payload),
                "migration": lambda n=nbytes, t=tensors, m=manifest: migrate(n, t, m, "migrate_warm"),
                "migration_new_link": lambda n=nbytes, t=tensors, m=manifest: migrate(
                    n, t, m, "migrate_warm", new_link=True
                ),
                "migration_cold": lambda n=nbytes, t=tensors, m=manifest: migrate(n, t, m, "migrate_cold"),
                "per_tensor": lambda n=nbytes, t=tensors, m=manifest: migrate(
                    n, t, m, "migrate_warm", **_NO_PACKING
                ),
                "packed": lambda n=nbytes, t=tensors, m=manifest: migrate(
                    n, t, m, "migrate_warm", **_ONE_BUFFER
                ),
            }
            timings: dict[str, list[dict[str, float]]] = {name: [] for name in variants}
            # Round-robin, so that load from other processes on a shared box hits every variant alike;
            # the warm-up round sets connections up and first-touches the preallocated buffers.
            for _, measured in bench.rounds(repeats, warmup=1):
                for name, run in variants.items():
                    timing = run()
                    if measured:
                        timings[name].append(timing)
            row: dict[str, Any] = {"nbytes": nbytes, "n_tensors": len(tensors)}
            for name, samples in timings.items():
                seconds = statistics.median(s["seconds"] for s in samples)
                row[f"{name}_seconds"] = seconds
                row[f"{name}_gbps"] = nbytes / seconds / 1e9
                # Best of the repeats: what the path can do when other processes leave the cores alone.
                row[f"{name}_best_gbps"] = nbytes / min(s["seconds"] for s in samples) / 1e9
                if "transfer_s" in samples[0]:
                    row[f"{name}_transfer_gbps"] = (
                        nbytes / statistics.median(s["transfer_s"] for s in samples) / 1e9
                    )
                    row[f"{name}_connect_seconds"] = statistics.median(s["connect_s"] for s in samples)
            row["ratio_to_raw"] = row["migration_gbps"] / row["raw_gbps"]
            row["best_ratio_to_raw"] = row["migration_best_gbps"] / row["raw_best_gbps"]
            row["new_link_ratio_to_raw"] = row["migration_new_link_gbps"] / row["raw_gbps"]
            row["cold_ratio_to_raw"] = row["migration_cold_gbps"] / row["raw_gbps"]
            results.append(row)
        sender.close()
        raw.close()
        commands.put(("stop", 0))
        target.join(30)
    finally:
        if target.is_alive():
            target.kill()
    return {
        "device": str(device),
        "target_device": target_device,
        "backend": backend,
        "repeats": repeats,
        "cpu_count": os.cpu_count(),
        "torch": torch.__version__,
        "results": results,
    }


def format_table(report: dict[str, Any]) -> str:
    if "skipped" in report:
        return f"skipped: {report['skipped']}"
    lines = [
        f"backend={report['backend']} device={report['device']} cpus={report['cpu_count']} repeats={report['repeats']}",
        f"{'MB':>8} {'raw GB/s':>9} {'mig GB/s':>9} {'ratio':>6} {'best':>5} {'new link':>9} {'ratio':>6} "
        f"{'cold':>6} {'per-tensor':>10} {'packed':>7} {'setup ms':>9} {'new ms':>7}",
    ]
    for row in report["results"]:
        lines.append(
            f"{row['nbytes'] / 1e6:8.1f} {row['raw_gbps']:9.3f} {row['migration_gbps']:9.3f} "
            f"{row['ratio_to_raw']:6.2f} {row['best_ratio_to_raw']:5.2f} {row['migration_new_link_gbps']:9.3f} {row['new_link_ratio_to_raw']:6.2f} "
            f"{row['migration_cold_gbps']:6.3f} {row['per_tensor_gbps']:10.3f} {row['packed_gbps']:7.3f} "
            f"{row['migration_connect_seconds'] * 1e3:9.2f} {row['migration_new_link_connect_seconds'] * 1e3:7.2f}"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m workers.benchmarks.migration", description=__doc__.splitlines()[0]
    )
    parser.add_argument("--sizes-mb", type=float, nargs="+", default=[1, 16, 64, 256])
    parser.add_argument("--device", default="cpu")
    bench.add_repeats_argument(parser, default=5, help="measured rounds per size (default 5)")
    bench.add_report_arguments(parser)
    args = parser.parse_args(argv)
    report = bench_migration([int(mb * (1 << 20)) for mb in args.sizes_mb], args.device, repeats=args.repeats)
    bench.emit(report, json_mode=args.json, out=args.out, text=format_table)


if __name__ == "__main__":
    main()
