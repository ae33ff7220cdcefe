"""``manage.py bench_stage_reload``: what a role change costs a worker (issue 15).

A worker started ``EDC`` (weights from its local file, served as its pool copy) becomes ``DC``: the
encoder's weights are dropped and the worker leaves the pool (``weights_bytes`` before and after).
Then, ``repeats`` times, it becomes ``EDC`` again and back: the encoder's components are loaded
through `StageWeightsFetcher` from ``local`` (the weights file) or ``peer`` (a second holder serving
the preset's packed copy over the weights transport in this process — the same server a host cache
runs), timed by ``set_role``'s ``load_ms`` (build + load + drop + garbage collection).
"""

from __future__ import annotations

import tempfile
from collections.abc import Callable
from typing import Any

import torch

from contracts import bench
from workers.ports import PoolLink
from workers.runtime.engine import ChunkEngine
from workers.runtime.stages.host import StageHost
from workers.runtime.transport import MigrationListener
from workers.weights_loading import PooledCopy, StageWeightsFetcher, WeightsLoader


class _Listed(PoolLink):
    """A pool that lists the given holders (no database: the real one is ``DjangoPoolLink``)."""

    def __init__(self, holders: list[dict[str, Any]]) -> None:
        self.holders = holders

    def sources_now(self) -> list[dict[str, Any]]:
        return self.holders


def run_stage_reload(
    preset: str,
    *,
    repeats: int,
    warmup: int,
    progress: Callable[[str], Any] = lambda _line: None,
) -> dict[str, Any]:
    torch.set_num_threads(1)
    weights_dir = tempfile.mkdtemp(prefix="stage-reload-")

    def load() -> Any:
        return WeightsLoader(
            preset=preset,
            device="cpu",
            host="127.0.0.1",
            weights_from="disk",
            weights_dir=weights_dir,
            pool=PoolLink(),
        ).load()

    peer = load()
    holder = {
        "kind": "gpu",
        "name": "peer",
        "address": peer.address,
        "digest": peer.packed.manifest.weights_id,
    }
    listener = MigrationListener()
    report: dict[str, Any] = {
        "benchmark": "stage_reload",
        "preset": preset,
        "repeats": repeats,
        "warmup": warmup,
    }
    try:
        for label, holders in (("local", []), ("peer", [holder])):
            weights = load()
            host = StageHost(
                ChunkEngine(weights.model, max_batch=1),
                store_address=listener.address,
                pool_copy=PooledCopy(weights, PoolLink()),
                loader=StageWeightsFetcher(
                    preset=preset,
                    device="cpu",
                    host="127.0.0.1",
                    weights_dir=weights_dir,
                    pool=_Listed(holders),
                ).fetch,
            )
            try:
                dropped = host.set_role("DC", {})
                loads, sources = [], set()
                for turn in bench.rounds(repeats, warmup):
                    back = host.set_role("EDC", {})
                    sources.add(back["source"])
                    if turn.measured:
                        loads.append(back["load_ms"])
                    host.set_role("DC", {})
                progress(f"{label}: {len(loads)} loads")
                report[label] = {
                    "edc_to_dc_weights_bytes": [dropped["weights_bytes_before"], dropped["weights_bytes"]],
                    "dc_to_edc_load_ms": bench.summarize(loads),
                    "sources": sorted(sources),
                }
            finally:
                host.close()
                weights.close()
    finally:
        listener.close()
        peer.close()
    report["machine"] = bench.describe_machine()
    return report


def format_report(report: dict[str, Any]) -> str:
    lines = [f"stage reload: {report['preset']} (ms)"]
    for label in ("local", "peer"):
        part = report[label]
        before, after = part["edc_to_dc_weights_bytes"]
        summary = part["dc_to_edc_load_ms"]
        lines.append(
            f"  EDC -> DC weights {before} -> {after} B; DC -> EDC from {label} ({', '.join(part['sources'])}) "
            f"p50 {summary['p50']:.3f}  p99 {summary['p99']:.3f}  (n={summary['count']})"
        )
    return "\n".join(lines)


__all__ = ["format_report", "run_stage_reload"]
