"""GPU profiles: built-in latency/capacity/price models and the JSON format measured ones use.

The built-in curves are linear in the co-located load (one coalesced forward pass whose cost grows
with the batch once the GPU is compute-bound) and calibrated so that the curve at the utilisation
TurboServe runs at (~0.7 K) gives the average per-chunk latency of the paper's Table 4, and the
migration cost κ = α + state/β gives Table 4's 23–30 ms. Sources and assumptions: docs/scheduling.md.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from .provisioning import ScaleOutModel
from .scaleplan import ScalePlanError, Topology
from .types import GB, GpuTypeSpec


class ProfileError(ValueError):
    pass


def _linear(base_ms: float, slope_ms: float, upto: float) -> tuple[tuple[float, float], ...]:
    return ((0.0, base_ms), (float(upto), base_ms + slope_ms * upto))


# (name, gpu_type, K, base ms, slope ms/load, price $/h, delay s, memory sessions, state GB, link GB/s, availability)
_BUILTIN_ROWS = (
    # TurboServe Table 4: H20 1.3B 1054 ms average at ~0.7 K = 8.4 -> 466 + 70 * 8.4.
    ("h20-1.3b", "h20", 12, 466.0, 70.0, 1.60, 30.0, 24, 3.5, 190.0, 16),
    # Table 4: H20 7B 1201 ms at 0.7 * 6 = 4.2 -> 571 + 150 * 4.2; 7B state ~4 GB -> κ ≈ 24 ms.
    ("h20-7b", "h20", 6, 571.0, 150.0, 1.60, 45.0, 10, 3.8, 200.0, 16),
    # Table 4: B300 1.3B 917 ms at 0.7 * 16 = 11.2 -> 413 + 45 * 11.2; κ ≈ 24 ms.
    ("b300-1.3b", "b300", 16, 413.0, 45.0, 6.50, 30.0, 64, 3.5, 180.0, 64),
    # Table 4: B300 7B 1181 ms at 0.7 * 10 = 7 -> 481 + 100 * 7; state ~5 GB -> κ ≈ 30 ms.
    ("b300-7b", "b300", 10, 481.0, 100.0, 6.50, 45.0, 28, 5.0, 200.0, 64),
    # LongLive on one H100: 20.7 fps -> 12 frames in ~580 ms for one session -> 525 + 55 * 1.
    ("h100-1.3b", "h100", 8, 525.0, 55.0, 2.99, 30.0, 18, 3.5, 190.0, None),
    # Appendix A setting: at most five sessions per GPU, 16 GPUs, L_SLO = 670 ms. 130 + 94 * 5 = 600 ms
    # at K; a resume copy (~70 ms) on top lands exactly on the SLO, as in Table 9 (max 667-668 ms).
    ("paper-k5", "h20", 5, 130.0, 94.0, 1.60, 20.0, 10, 3.5, 190.0, 16),
)

# Links of each GPU type's servers, GB/s per direction (what one flow gets), with their sources.
# NVLink and PCIe: the vendor's bidirectional figure halved. RDMA: one NIC per GPU, the HGX/DGX
# reference design (rail-optimised, non-blocking: spine oversubscription 1). NVMe: the vendor's
# sequential-read figure of one data-centre drive — optimistic for a loader, which rarely reaches
# it (BlitzScale §6 measured 10 Gbps ≈ 1.25 GB/s from its SSDs), so disk is never understated here.
_LINKS: dict[str, dict[str, float]] = {
    # NVIDIA H20 (HGX H20 product brief): NVLink 900 GB/s bidirectional; PCIe Gen5 x16 128 GB/s
    # bidirectional; ConnectX-7 400 Gb/s per GPU; Gen4 NVMe 6.9 GB/s (Samsung PM9A3 datasheet).
    "h20": {"nvlink_gbps": 450.0, "pcie_gbps": 64.0, "rdma_gbps": 50.0, "nvme_gbps": 6.9},
    # NVIDIA H100 SXM (DGX H100 user guide): NVLink 4 900 GB/s bidirectional; PCIe Gen5 x16;
    # 8× ConnectX-7 400 Gb/s (one per GPU); Gen4 U.2 NVMe 6.9 GB/s.
    "h100": {"nvlink_gbps": 450.0, "pcie_gbps": 64.0, "rdma_gbps": 50.0, "nvme_gbps": 6.9},
    # NVIDIA B300 (HGX B300 / DGX B300 datasheet): NVLink 5 1.8 TB/s bidirectional; ConnectX-8
    # SuperNIC 800 Gb/s per GPU; PCIe Gen5 x16 host link counted (conservative); Gen5 NVMe 14 GB/s
    # (Micron 9550 datasheet).
    "b300": {"nvlink_gbps": 900.0, "pcie_gbps": 64.0, "rdma_gbps": 100.0, "nvme_gbps": 14.0},
}
_LINK_SOURCE = (
    "links: vendor datasheets (NVLink/PCIe halved per direction, one NIC per GPU, one NVMe drive); "
    "boot 2 s = worker process with torch import ≈ 1.6–1.8 s (measured here) + CUDA context ≈ 0.5 s "
    "(BlitzScale appendix; a context pool hides it); weights: Wan-family DiT bf16 + UMT5-XXL text "
    "encoder ≈ 11 GB + VAE ≈ 0.5 GB (estimates, NOTES-wave2.md); see docs/scheduling.md"
)
# Model weights by profile (bytes): the DiT in bf16 plus the text encoder and the VAE.
_WEIGHTS_GB = {"1.3b": 2.6 + 11.0 + 0.5, "7b": 14.0 + 11.0 + 0.5, "k5": 2.6 + 11.0 + 0.5}
_BOOT_S = 2.0
# Fixed hop cost of a chain: a pooled pairwise connection's first block and the receiver's set-up
# (BlitzScale appendix: a NCCL group costs ≈ 100 ms unless pre-created; ours are pooled).
_HOP_LATENCY_S = 0.01


def _scale_out(name: str, gpu_type: str) -> ScaleOutModel:
    links = _LINKS[gpu_type]
    return ScaleOutModel(
        boot_s=_BOOT_S,
        weights_bytes=int(_WEIGHTS_GB[name.rsplit("-", 1)[1]] * GB),
        topology=Topology.cluster(**links, hop_latency_s=_HOP_LATENCY_S, source=_LINK_SOURCE),
        # The built-in profiles' own scale-out is the stated cold boot (provisioning_delay_s).
        path="fixed",
        gpus_per_host=8,
        hosts_per_domain=4,
        host_copies=1,
        source=_LINK_SOURCE,
    )


BUILTIN_PROFILES: dict[str, GpuTypeSpec] = {
    name: GpuTypeSpec(
        name=name,
        gpu_type=gpu_type,
        capacity=float(k),
        latency_points=_linear(base, slope, 2 * k),
        price_per_hour=price,
        provisioning_delay_s=delay,
        memory_limit_sessions=mem,
        state_bytes=int(state_gb * GB),
        link_gbps=link,
        availability=avail,
        slo_ms=670.0 if name == "paper-k5" else None,
        source="calibrated to TurboServe Table 4 / Appendix A and DESIGN.md; see docs/scheduling.md",
        scale_out=_scale_out(name, gpu_type),
    )
    for name, gpu_type, k, base, slope, price, delay, mem, state_gb, link, avail in _BUILTIN_ROWS
}

_REQUIRED = ("name", "capacity", "price_per_hour", "provisioning_delay_s", "latency_ms")
_OPTIONAL = (
    "gpu_type",
    "memory_limit_sessions",
    "memory_limit_bytes",
    "state_bytes",
    "link_gbps",
    "host_link_gbps",
    "migration_alpha_ms",
    "availability",
    "slo_ms",
    "source",
    "scale_out",
)


def profile_from_json(data: dict[str, Any]) -> GpuTypeSpec:
    """Build a spec from the documented JSON object (the worker's ``profile_model`` writes it)."""
    if not isinstance(data, dict):
        raise ProfileError("profile must be a JSON object")
    missing = [k for k in _REQUIRED if k not in data]
    if missing:
        raise ProfileError(f"profile is missing {', '.join(missing)}")
    unknown = sorted(set(data) - set(_REQUIRED) - set(_OPTIONAL))
    if unknown:
        raise ProfileError(f"profile has unknown field(s) {', '.join(unknown)}")
    curve = data["latency_ms"]
    if not isinstance(curve, list) or not all(isinstance(p, list | tuple) and len(p) == 2 for p in curve):
        raise ProfileError("latency_ms must be a list of [load, ms] pairs")
    kwargs: dict[str, Any] = {k: data[k] for k in _OPTIONAL if k in data}
    kwargs.setdefault("gpu_type", data["name"])
    if "scale_out" in kwargs:
        # Optional (older profiles have none): boot, weights and links, maybe measured phases.
        try:
            kwargs["scale_out"] = ScaleOutModel.from_json(kwargs["scale_out"])
        except ScalePlanError as exc:
            raise ProfileError(str(exc)) from exc
    try:
        return GpuTypeSpec(
            name=str(data["name"]),
            capacity=float(data["capacity"]),
            latency_points=tuple((float(x), float(y)) for x, y in curve),
            price_per_hour=float(data["price_per_hour"]),
            provisioning_delay_s=float(data["provisioning_delay_s"]),
            **kwargs,
        )
    except (TypeError, ValueError) as exc:
        raise ProfileError(str(exc)) from exc


def load_profile(name_or_path: str) -> GpuTypeSpec:
    """A built-in profile name, or a path to a JSON file in the documented format."""
    if name_or_path in BUILTIN_PROFILES:
        return BUILTIN_PROFILES[name_or_path]
    path = Path(name_or_path)
    if not path.exists():
        raise ProfileError(
            f"unknown profile {name_or_path!r} (built-in: {', '.join(sorted(BUILTIN_PROFILES))})"
        )
    try:
        data = json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise ProfileError(f"{path}: not valid JSON ({exc})") from exc
    return profile_from_json(data)


def load_profiles(spec: str) -> list[GpuTypeSpec]:
    """Comma-separated names/paths: a heterogeneous pool; the first is the initial pool's type."""
    profiles = [load_profile(part.strip()) for part in spec.split(",") if part.strip()]
    if not profiles:
        raise ProfileError("no profile given")
    names = [p.name for p in profiles]
    if len(set(names)) != len(names):
        raise ProfileError("duplicate profile names in pool")
    return profiles
