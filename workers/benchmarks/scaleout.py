"""Scale-out benchmark: new worker processes becoming ready from each weights source.

    python manage.py bench_scaleout --preset small --targets 1,2,3 [--link-mbps 200] [--json]

Real processes on this machine. Started once: a *peer* (a serving worker: the preset's model built
and its weights packed and served, ``weights_serve``), a *host cache* (the weights read from the
safetensors file into (pinned, with CUDA) host memory and served), and ``max(targets)`` *target*
worker processes (spawned, so their boot is a real interpreter + torch start, reported apart). Then,
per source and per number of targets ``n``, a round: each of the first ``n`` targets makes a fresh
``WeightsReceiver`` (allocated before the clock starts), the clock starts, and a target is *ready*
when its weights are complete, verified and installed into a model (``model_from_weights``). Sources:

* ``disk``: every target reads the safetensors file (verified block by block), the file's pages
  dropped from the page cache before the round (``posix_fadvise(DONTNEED)``); ``disk_warm``: the
  same with the file in the page cache (what a second load on one box really costs);
* ``host_cache``: the chain ``host cache → T1 → … → Tn`` (BlitzScale's O(1) host copy, multicast);
* ``peer_chain``: the chain ``peer → T1 → … → Tn``;
* ``peer_sequential``: unicast from the peer to T1, then T2, … (each starts when the last is ready).

``--link-mbps`` paces every node's egress and ingress (``LinkPacer``), so the network, not the CPU,
decides on a 2-core box; disk reads are not paced. The figures are medians over ``--repeats``.
After the last round each target runs one chunk and its frames are compared with the reference
model's (``frames_match_reference``): ready means able to step, with the exact weights.
"""

from __future__ import annotations

import multiprocessing as mp
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import xxhash

from contracts.bench import rounds
from scheduling.core.scaleplan import Endpoint, Topology, plan_scale_out
from workers.runtime.models import build_model
from workers.runtime.models.causal_dit import PRESETS as CONFIGS
from workers.runtime.models.causal_dit import CausalDiTNetwork
from workers.runtime.weights import (
    DEFAULT_PIECE_BYTES,
    PackedWeights,
    WeightsManifest,
    WeightsReceiver,
    WeightsUnavailable,
    chain_sources,
    drop_page_cache,
    load_weights,
    model_from_weights,
    pack_model,
    save_weights,
    weights_serve,
)

SOURCES = ("disk", "disk_warm", "host_cache", "peer_chain", "peer_sequential")
REPLY_TIMEOUT_S = 600.0
STEP_PROMPT, STEP_SEED = "a red kite over a grey sea", 7
# Documented links for the projections (bytes / bandwidth; no protocol overhead): sources in
# docs/scaleout.md. Gbit/s, as vendors quote them.
PROJECTION_LINKS_GBITPS = {
    "nvme_ssd_per_gpu_10g": 10.0,  # BlitzScale §2 / Table 2: 2–10 Gbps SSD per GPU
    "nvme_gen4_x4_56g": 56.0,  # one PCIe Gen4 x4 NVMe drive, ~7 GB/s sequential read
    "rdma_100g": 100.0,
    "rdma_200g": 200.0,
    "rdma_400g": 400.0,
    "pcie_gen4_x16_256g": 256.0,  # host cache → GPU (BlitzScale §3: 256 Gbps PCIe 4.0)
    "pcie_gen5_x16_512g": 512.0,
    "nvlink_h100_3600g": 3600.0,  # H100 NVLink 4: 450 GB/s per direction
}


def _frames_digest(model: Any) -> str:
    frames = model.generate([model.create_state(STEP_PROMPT, STEP_SEED)])[0].frames
    return xxhash.xxh3_64(frames.contiguous().numpy().tobytes()).hexdigest()


def _holder_main(
    kind: str, preset: str, path: str, link_mbps: float | None, piece_bytes: int, replies: Any, commands: Any
) -> None:
    torch.set_num_threads(1)
    # The host cache: one verified host copy, page-locked when there is a GPU to feed.
    if kind == "peer":
        packed = pack_model(build_model(preset), piece_bytes=piece_bytes)
    else:
        packed = load_weights(path).pin()
    server = weights_serve(packed, link_mbps=link_mbps)
    replies.put(("address", server.address))
    commands.get()
    server.close()


def _target_main(
    manifest_json: str, link_mbps: float | None, device: str, replies: Any, commands: Any
) -> None:
    torch.set_num_threads(1)
    manifest = WeightsManifest.from_json(manifest_json)
    # Imported here, not at module level, on purpose: what a worker daemon imports at start-up
    # anyway, so the spawned target's first round does not pay for it.
    import safetensors.torch  # noqa: F401

    # (the same reason: the model classes a daemon loads)
    import workers.runtime.models.causal_dit  # noqa: F401

    replies.put(("up", time.monotonic()))
    receiver: WeightsReceiver | None = None
    model: Any = None
    while True:
        command, args = commands.get()
        if command == "stop":
            return
        if command == "prepare":
            receiver = WeightsReceiver(manifest, device=device, link_mbps=link_mbps, serve=args["serve"])
            replies.put(("prepared", receiver.address))
        elif command == "go":
            assert receiver is not None
            try:
                result = receiver.receive(args["sources"], disk_path=args.get("disk_path"), timeout_s=300)
            except WeightsUnavailable as exc:
                replies.put(("failed", {"error": str(exc), "attempts": exc.attempts}))
                continue
            weights_at = time.monotonic()
            model = model_from_weights(result.packed, device=device)
            ready_at = time.monotonic()
            replies.put(
                (
                    "ready",
                    {
                        "weights_at": weights_at,
                        "ready_at": ready_at,
                        "source": result.source,
                        "bytes_by_source": result.bytes_by_source,
                        "fell_back": result.fell_back,
                        "timings": result.timings,
                    },
                )
            )
        elif command == "step":
            replies.put(("stepped", _frames_digest(model)))
        elif command == "release":
            if receiver is not None:
                receiver.close()
            receiver, model = None, None
            replies.put(("released", None))


class _Proc:
    def __init__(self, context: Any, target: Any, args: tuple) -> None:
        self.replies, self.commands = context.Queue(), context.Queue()
        self.started = time.monotonic()
        self.process = context.Process(target=target, args=(*args, self.replies, self.commands), daemon=True)
        self.process.start()

    def expect(self, kind: str) -> Any:
        got, payload = self.replies.get(timeout=REPLY_TIMEOUT_S)
        if got != kind:
            raise RuntimeError(f"expected {kind!r} from a benchmark process, got {got!r}: {payload}")
        return payload

    def send(self, command: str, **args: Any) -> None:
        self.commands.put((command, args))

    def stop(self) -> None:
        if self.process.is_alive():
            self.commands.put(("stop", {}))
            self.process.join(timeout=10)
        if self.process.is_alive():
            self.process.kill()
            self.process.join(timeout=5)


def _read_gbps(path: Path) -> float:
    started = time.monotonic()
    with open(path, "rb", buffering=0) as handle:
        while handle.read(16 << 20):
            pass
    return path.stat().st_size / (time.monotonic() - started) / 1e9


def _filesystem(path: Path) -> str:
    best, kind = "", "unknown"
    try:
        for line in Path("/proc/mounts").read_text().splitlines():
            _, mount, fstype, *_ = line.split()
            if str(path.resolve()).startswith(mount) and len(mount) > len(best):
                best, kind = mount, fstype
    except OSError:
        pass
    return kind


def _round(source: str, n: int, targets: list[_Proc], holders: dict[str, str], path: Path) -> dict[str, Any]:
    active = targets[:n]
    for proc in active:
        proc.send("prepare", serve=source not in ("disk", "disk_warm"))
    addresses = [proc.expect("prepared") for proc in active]
    if source == "disk":
        drop_page_cache(path)
    reports: list[dict[str, Any]] = []
    started = time.monotonic()
    if source in ("disk", "disk_warm"):
        for proc in active:
            proc.send("go", sources=[], disk_path=str(path))
        reports = [proc.expect("ready") for proc in active]
    elif source == "peer_sequential":
        for proc in active:
            proc.send("go", sources=[holders["peer"]], disk_path=str(path))
            reports.append(proc.expect("ready"))
    else:
        head = holders["host_cache" if source == "host_cache" else "peer"]
        chain = [head, *addresses]
        for position, proc in enumerate(active, start=1):
            proc.send("go", sources=chain_sources(chain, position), disk_path=str(path))
        reports = [proc.expect("ready") for proc in active]
    for proc in active:
        proc.send("release")
    for proc in active:
        proc.expect("released")
    per_target = [round(r["ready_at"] - started, 4) for r in reports]
    return {
        "seconds": max(per_target),
        "per_target_s": per_target,
        "weights_s": [round(r["weights_at"] - started, 4) for r in reports],
        "install_s": [round(r["ready_at"] - r["weights_at"], 4) for r in reports],
        "connect_s": [round(r["timings"]["connect_s"], 4) for r in reports],
        "transfer_s": [round(r["timings"]["transfer_s"], 4) for r in reports],
        "disk_s": [round(r["timings"]["disk_s"], 4) for r in reports],
        "sources_used": [r["source"] for r in reports],
        "fell_back": any(r["fell_back"] for r in reports),
    }


def _summary(measured: list[dict[str, Any]]) -> dict[str, Any]:
    """Medians across rounds, position by position."""

    def med(key: str) -> list[float]:
        return [round(statistics.median(col), 4) for col in zip(*(r[key] for r in measured), strict=True)]

    return {
        "seconds": round(statistics.median(r["seconds"] for r in measured), 4),
        "per_target_s": med("per_target_s"),
        "phases": {key: med(key) for key in ("weights_s", "install_s", "connect_s", "transfer_s", "disk_s")},
        "rounds_s": [r["seconds"] for r in measured],
        "fell_back": any(r["fell_back"] for r in measured),
        "sources_used": measured[-1]["sources_used"],
    }


def planner_expectation(manifest: WeightsManifest, n: int, link_mbps: float) -> dict[str, Any]:
    """What the scale planner (``scheduling.core.scaleplan``) expects for this paced set-up.

    One peer and ``n`` targets, each on its own host behind one leaf at ``link_mbps``; the
    pipeline unit is our piece count; no hop latency and no local disk (``nvme_gbps`` ≈ 0), so the
    figure is the planner's pure network model, to set beside the measured ``peer_chain``.
    """
    pieces = sum(len(block.pieces) for block in manifest.blocks)
    topology = Topology.flat(link_mbps / 8000, nvme_gbps=1e-12, hop_latency_s=0.0, pipeline_blocks=pieces)
    plan = plan_scale_out(
        sources=[Endpoint("peer", host="peer", domain="leaf")],
        targets=[Endpoint(f"T{i}", host=f"host{i}", domain="leaf") for i in range(1, n + 1)],
        topology=topology,
        weights_bytes=manifest.total_bytes,
    )
    return {
        "chains": [[chain.source, *chain.targets] for chain in plan.chains],
        "expected_ready_s": [round(plan.expected_ready_s[f"T{i}"], 4) for i in range(1, n + 1)],
        "pipeline_blocks": pieces,
    }


def projections(preset: str = "wan-1.3b") -> dict[str, Any]:
    """Seconds to move one replica's weights over documented links: bytes / bandwidth, labelled."""

    config = CONFIGS[preset]
    with torch.device("meta"):  # shapes only: nothing is allocated
        network = CausalDiTNetwork(config)
    itemsize = config.torch_dtype.itemsize
    model_bytes = sum(t.numel() for t in network.state_dict().values()) * itemsize
    return {
        "kind": "projection (bytes / documented bandwidth; no protocol overhead, not measured)",
        "preset": preset,
        "weights_bytes": model_bytes,
        "seconds_by_link": {
            name: round(model_bytes * 8 / (gbit * 1e9), 4) for name, gbit in PROJECTION_LINKS_GBITPS.items()
        },
    }


def run_scaleout(
    preset: str,
    *,
    targets: tuple[int, ...] = (1, 2, 3),
    link_mbps: float | None = None,
    repeats: int = 3,
    warmup: int = 1,
    device: str = "cpu",
    sources: tuple[str, ...] = SOURCES,
    piece_bytes: int = DEFAULT_PIECE_BYTES,
    workdir: str | None = None,
    progress: Any = print,
) -> dict[str, Any]:
    if not targets or min(targets) < 1:
        raise ValueError(f"--targets must be positive counts, got {targets}")
    unknown = set(sources) - set(SOURCES)
    if unknown:
        raise ValueError(f"--sources: unknown {sorted(unknown)}; known: {', '.join(SOURCES)}")
    if device != "cpu":
        raise ValueError("--device: only cpu is wired here (a host cache feeding GPUs needs a staged path)")
    if piece_bytes <= 0:
        raise ValueError(f"--piece-kib must be positive, got {piece_bytes / 1024}")
    if link_mbps is not None and not link_mbps > 0:
        raise ValueError(f"--link-mbps must be positive, got {link_mbps}")
    torch.set_num_threads(1)
    reference = build_model(preset)
    expected_frames = _frames_digest(reference)
    packed: PackedWeights = pack_model(reference, piece_bytes=piece_bytes)
    manifest = packed.manifest
    folder = Path(workdir or tempfile.mkdtemp(prefix="bench-scaleout-"))
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{preset}.safetensors"
    save_weights(path, packed)
    del reference, packed

    drop_page_cache(path)
    disk_probe = {"cold_read_gbps": round(_read_gbps(path), 3), "warm_read_gbps": round(_read_gbps(path), 3)}
    progress(
        f"weights {manifest.total_bytes:,} B in {len(manifest.blocks)} blocks; file on {_filesystem(path)}"
    )

    holders_context = mp.get_context("forkserver")
    holders_context.set_forkserver_preload(
        ["torch", "workers.runtime.weights", "workers.runtime.models.causal_dit"]
    )
    spawn = mp.get_context("spawn")
    procs: list[_Proc] = []
    try:
        holder_procs = {
            kind: _Proc(holders_context, _holder_main, (kind, preset, str(path), link_mbps, piece_bytes))
            for kind in ("peer", "host_cache")
        }
        procs += holder_procs.values()
        holders = {kind: proc.expect("address") for kind, proc in holder_procs.items()}
        target_procs = [
            _Proc(spawn, _target_main, (manifest.dumps(), link_mbps, device)) for _ in range(max(targets))
        ]
        procs += target_procs
        boot = [round(proc.expect("up") - proc.started, 3) for proc in target_procs]
        progress(
            f"holders up; {len(target_procs)} target processes booted in {boot} s (spawned concurrently)"
        )

        results: dict[str, dict[str, Any]] = {}
        for source in sources:
            by_targets: dict[str, Any] = {}
            for n in targets:
                measured = []
                for round_ in rounds(repeats, warmup):
                    outcome = _round(source, n, target_procs, holders, path)
                    if round_.measured:
                        measured.append(outcome)
                by_targets[str(n)] = _summary(measured)
                progress(
                    f"{source:>16} n={n}: {by_targets[str(n)]['seconds']:.3f} s {by_targets[str(n)]['per_target_s']}"
                )
            results[source] = {"seconds": by_targets[str(max(targets))]["seconds"], "by_targets": by_targets}
        if "disk" in results:
            results["disk"]["page_cache"] = "dropped before each round (posix_fadvise DONTNEED)"
        if "disk_warm" in results:
            results["disk_warm"]["page_cache"] = "warm (file pages cached by the previous round)"

        digests = []
        for proc in target_procs:  # one last receive and a step: ready means able to step
            proc.send("prepare", serve=False)
            proc.expect("prepared")
            proc.send("go", sources=[holders["peer"]])
            proc.expect("ready")
            proc.send("step")
            digests.append(proc.expect("stepped"))
            proc.send("release")
            proc.expect("released")
    finally:
        for proc in procs:
            proc.stop()
        path.unlink(missing_ok=True)
        if workdir is None:
            folder.rmdir()

    def ratio(a: float | None, b: float | None) -> float | None:
        return round(a / b, 3) if a is not None and b else None

    def at(source: str, n: int) -> float | None:
        return results.get(source, {}).get("by_targets", {}).get(str(n), {}).get("seconds")

    low, high = min(targets), max(targets)
    return {
        "preset": preset,
        "weights_bytes": manifest.total_bytes,
        "blocks": len(manifest.blocks),
        "piece_bytes": manifest.piece_bytes,
        "link_mbps": link_mbps,
        "wire_floor_s": None if link_mbps is None else round(manifest.total_bytes * 8 / (link_mbps * 1e6), 4),
        "device": device,
        "targets": list(targets),
        "repeats": repeats,
        "warmup": warmup,
        "sources": results,
        "chain_vs_single": ratio(at("peer_chain", high), at("peer_chain", low)),
        "host_cache_chain_vs_single": ratio(at("host_cache", high), at("host_cache", low)),
        "chain_speedup_vs_sequential": ratio(at("peer_sequential", high), at("peer_chain", high)),
        "peer_chain_vs_disk_cold": ratio(at("disk", high), at("peer_chain", high)),
        "planner": None if link_mbps is None else planner_expectation(manifest, high, link_mbps),
        "boot_s": boot,
        "disk_probe": {**disk_probe, "filesystem": _filesystem(folder)},
        "frames_match_reference": all(d == expected_frames for d in digests),
        "projection": projections(),
    }


def format_scaleout(report: dict[str, Any]) -> str:
    pace = f"{report['link_mbps']} Mbit/s per node" if report["link_mbps"] else "unpaced (loopback)"
    lines = [
        f"scale-out bench: preset={report['preset']} weights={report['weights_bytes']:,} B "
        f"({report['blocks']} blocks), links {pace}"
        + (f", wire floor {report['wire_floor_s']} s" if report["wire_floor_s"] else ""),
        f"target boot (spawn → up, not in the figures): {report['boot_s']} s; "
        f"disk probe {report['disk_probe']}",
        "",
        f"{'source':>16} "
        + " ".join(f"{'n=' + str(n):>10}" for n in report["targets"])
        + "   per target (largest n)",
    ]
    for name, source in report["sources"].items():
        cells = " ".join(f"{source['by_targets'][str(n)]['seconds']:>9.3f}s" for n in report["targets"])
        last = source["by_targets"][str(max(report["targets"]))]["per_target_s"]
        lines.append(f"{name:>16} {cells}   {last}")
    lines += [
        "",
        f"chain_vs_single (peer chain, n={max(report['targets'])} / n={min(report['targets'])}): "
        f"{report['chain_vs_single']}",
        f"host_cache_chain_vs_single: {report['host_cache_chain_vs_single']}",
        f"chain_speedup_vs_sequential: {report['chain_speedup_vs_sequential']}",
        f"peer_chain_vs_disk_cold: {report['peer_chain_vs_disk_cold']}",
        f"frames_match_reference: {report['frames_match_reference']}",
    ]
    if report.get("planner"):
        lines.append(
            f"scale planner's expectation (pure network model, chains {report['planner']['chains']}): "
            f"{report['planner']['expected_ready_s']} s"
        )
    lines += [
        "",
        f"projection for {report['projection']['preset']} ({report['projection']['weights_bytes']:,} B) — "
        f"{report['projection']['kind']}:",
    ]
    lines += [f"  {name:>22}: {s:.3f} s" for name, s in report["projection"]["seconds_by_link"].items()]
    return "\n".join(lines)
