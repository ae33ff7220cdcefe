"""Scale-plan decision time (BlitzScale §5.1; issue 13's goal: < 5 ms at 64 GPUs): ``manage.py bench_scaleplan``.

For each cluster size M: M GPUs, 8 per host, 4 hosts per leaf switch (BlitzScale's testbed shape).
A quarter of the GPUs serve the model (sources), one host cache holds a copy (O(1) host caching,
§5.3), a few serving GPUs are busy with session migrations, and every other GPU is a target — the
largest scale-out a cluster of that size can see. Only :func:`plan_scale_out` is timed, wall and
process CPU time both (on a shared machine wall time also counts preemption).
"""

from __future__ import annotations

import gc
import time
from collections.abc import Sequence
from typing import Any

from contracts import bench
from scheduling.core.scaleplan import (
    GB,
    Endpoint,
    Topology,
    cluster_endpoints,
    host_cache_endpoint,
    plan_scale_out,
)
from scheduling.sim.cli import CliError

GPUS_PER_HOST = 8
HOSTS_PER_DOMAIN = 4
# BlitzScale's A800 testbed (§6): NVLink 1.6 Tbps ≈ 200 GB/s, 100 Gbps RDMA = 12.5 GB/s per GPU.
BENCH_TOPOLOGY = Topology.cluster(
    nvlink_gbps=200.0, rdma_gbps=12.5, pcie_gbps=25.0, nvme_gbps=1.25, spine_oversubscription=2.0
)


def scale_out_case(
    n_gpus: int, *, source_fraction: float = 0.25
) -> tuple[list[Endpoint], list[Endpoint], Topology]:
    hosts = max(1, -(-n_gpus // GPUS_PER_HOST))
    gpus = [
        e
        for h in cluster_endpoints(
            hosts=hosts, gpus_per_host=GPUS_PER_HOST, hosts_per_domain=HOSTS_PER_DOMAIN
        )
        for e in h
    ][:n_gpus]
    n_sources = max(1, int(n_gpus * source_fraction)) if n_gpus > 1 else 0
    # Sources spread over the hosts (every fourth GPU), as serving instances usually are.
    step = max(1, n_gpus // max(1, n_sources))
    source_ids = {gpus[i].id for i in range(0, n_gpus, step)[:n_sources]}
    sources = [g for g in gpus if g.id in source_ids]
    targets = [g for g in gpus if g.id not in source_ids]
    sources.append(host_cache_endpoint(gpus[-1].host, gpus[-1].domain))
    busy = {(s.id, "elsewhere") for s in sources[: max(0, len(sources) // 8)]}
    return sources, targets, BENCH_TOPOLOGY.with_busy(busy)


def bench_scaleplan(
    sizes: Sequence[int], *, weights_bytes: int, repeats: int = 200, warmup: int = 20
) -> dict[str, Any]:
    rows = []
    for m in sizes:
        sources, targets, topology = scale_out_case(m)
        wall: list[float] = []
        cpu: list[float] = []
        plan = None
        gc.collect()
        for r in bench.rounds(repeats, warmup):
            t0, c0 = time.perf_counter(), time.process_time()
            plan = plan_scale_out(
                sources=sources, targets=targets, topology=topology, weights_bytes=weights_bytes
            )
            t1, c1 = time.perf_counter(), time.process_time()
            if r.measured:
                wall.append((t1 - t0) * 1000.0)
                cpu.append((c1 - c0) * 1000.0)
        assert plan is not None
        rows.append(
            {
                "gpus": m,
                "sources": len(sources),
                "targets": len(targets),
                "busy_links": len(topology.busy),
                "chains": len(plan.chains),
                "longest_chain": max((len(c.targets) for c in plan.chains), default=0),
                "plan_expected_seconds": round(plan.expected_seconds, 4),
                "decision_ms": bench.summarize(wall),
                "cpu_ms": bench.summarize(cpu),
            }
        )
    return {
        "weights_bytes": weights_bytes,
        "gpus_per_host": GPUS_PER_HOST,
        "hosts_per_domain": HOSTS_PER_DOMAIN,
        "topology": BENCH_TOPOLOGY.to_json(),
        "repeats": repeats,
        "warmup": warmup,
        "sizes": rows,
    }


def run_bench(*, gpus: str, weights_gb: float, repeats: int, warmup: int) -> dict[str, Any]:
    """The command's flags, checked (a bad one raises :class:`CliError` naming it), then the bench."""
    try:
        sizes = [int(x) for x in gpus.split(",") if x.strip()]
    except ValueError as exc:
        raise CliError("gpus", f"expected comma-separated integers, got {gpus!r}") from exc
    if not sizes or any(s < 2 for s in sizes):
        raise CliError("gpus", "sizes must be integers >= 2")
    if not weights_gb > 0:
        raise CliError("weights-gb", "must be > 0")
    if repeats < 1:
        raise CliError("repeats", "must be >= 1")
    if warmup < 0:
        raise CliError("warmup", "must be >= 0")
    return bench_scaleplan(sizes, weights_bytes=int(weights_gb * GB), repeats=repeats, warmup=warmup)


def format_bench(report: dict[str, Any]) -> str:
    lines = [
        f"scale-plan decision time, {report['weights_bytes'] / GB:g} GB of weights, "
        f"{report['gpus_per_host']} GPUs/host, {report['hosts_per_domain']} hosts/leaf"
    ]
    lines.append(
        f"  {'GPUs':>6} {'sources':>8} {'targets':>8} {'chains':>7} {'plan s':>8} "
        f"{'p50 ms':>8} {'p99 ms':>8} {'max ms':>8} {'cpu p99':>8}"
    )
    for r in report["sizes"]:
        d, c = r["decision_ms"], r["cpu_ms"]
        lines.append(
            f"  {r['gpus']:>6} {r['sources']:>8} {r['targets']:>8} {r['chains']:>7} "
            f"{r['plan_expected_seconds']:>8.3f} {d['p50']:>8.3f} {d['p99']:>8.3f} {d['max']:>8.3f} {c['p99']:>8.3f}"
        )
    return "\n".join(lines)
