"""How a starting worker gets its model's weights: from the scale plan's chain, the pool, or disk.

``gpuworker --weights-from``:

- ``disk``: the local safetensors file (``<WEIGHTS_DIR>/<preset>.safetensors``), every block
  verified against its checksum; when the file does not exist yet, the model's seeded weights are
  written there first (source ``init``: every worker of a preset derives the same bytes).
- ``pool``: from peers only: the plan's chain when the scaler wrote one on this worker's row, else
  every complete copy the parameter pool lists now. No disk fallback: if no peer delivers, the
  worker does not start (a mode for tests and benchmarks that must not silently read disk).
- ``auto`` (default): the plan's chain when there is one, with disk as the last fallback, else disk.

A chain ``S → T1 → T2`` is pulled (``workers.runtime.weights``): ``T(k)`` serves what it has
verified while it receives the rest, and advertises its address in the pool (a *loading* holding)
before it starts receiving, so ``T(k+1)`` finds its upstream there. Whatever the path, the model is
built only from a complete, verified set, and the worker then keeps serving its weights to later
scale-outs (a *complete* holding) until it exits.

This module holds no ORM code: the pool is reached through the ``PoolLink`` port (``workers.ports``;
``workers.adapters.pool.DjangoPoolLink`` is the real one), like the daemon's ``Reporter``.
"""

from __future__ import annotations

import logging
import os
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from workers.ports import PoolLink
from workers.runtime.models import build_model, model_class
from workers.runtime.weights import (
    PackedWeights,
    WeightsReceiver,
    WeightsUnavailable,
    load_weights,
    model_from_weights,
    pack_model,
    read_manifest,
    save_weights,
    weights_serve,
)

logger = logging.getLogger("workers.weights")

WEIGHTS_FROM = ("auto", "pool", "disk")
# Recorded sources (``gpu.models.WeightsSource``).
DISK, INIT, PEER, HOST_CACHE = "disk", "init", "peer", "host_cache"
# Where a stage loaded at run time came from (``set_role``'s answer, issue 15).
STAGE_SOURCES = {PEER: "peer", HOST_CACHE: "host-cache", DISK: "local", INIT: "seed"}


@dataclass
class LoadedWeights:
    model: Any
    packed: PackedWeights | None
    source: str  # disk | init | peer | host_cache
    detail: str
    address: str
    seconds: float
    bytes_by_source: dict[str, int] = field(default_factory=dict)
    closer: Any = None

    def close(self) -> None:
        if self.closer is not None:
            self.closer.close()

    # -- the worker's copy in the parameter pool (``workers.runtime.stages.host.PoolCopy``) ----

    def tensors(self) -> list[torch.Tensor]:
        """The packed buffers this worker holds for the pool (the model's weights are views of them)."""
        return [] if self.packed is None else list(self.packed.buffers)

    def release(self, pool: PoolLink) -> None:
        """Leave the parameter pool and let go of the packed copy: once the model drops a stage, the
        copy is no longer complete (no source for anyone) and its buffers of the dropped stage's
        blocks are freed once the model stops viewing them."""
        pool.withdraw()
        self.close()
        self.closer = None
        self.packed = None
        self.address = ""


def weights_file(weights_dir: str | os.PathLike[str], preset: str) -> Path:
    return Path(weights_dir) / f"{preset}.safetensors"


def weights_file_ensure(path: Path, preset: str) -> bool:
    """Write the preset's seeded weights to ``path`` when it is missing; returns whether it wrote.

    Atomic (a temporary file renamed into place): a concurrent reader sees no file or a whole one,
    and two workers writing at once write the same bytes.
    """
    if path.exists():
        return False
    path.parent.mkdir(parents=True, exist_ok=True)
    model = build_model(preset, device="cpu")
    packed = pack_model(model)
    tmp = path.with_suffix(f".{os.getpid()}.{uuid.uuid4().hex[:6]}.tmp")
    save_weights(tmp, packed)
    os.replace(tmp, path)
    logger.info("weights.file_written preset=%s path=%s bytes=%d", preset, path, packed.manifest.total_bytes)
    return True


class WeightsLoader:
    def __init__(
        self,
        *,
        preset: str,
        device: str,
        host: str,
        weights_from: str,
        weights_dir: str | os.PathLike[str],
        pool: PoolLink,
        link_mbps: float | None = None,
        timeout_s: float = 600.0,
        upstream_wait_s: float = 30.0,
    ) -> None:
        if weights_from not in WEIGHTS_FROM:
            raise ValueError(f"--weights-from must be one of {', '.join(WEIGHTS_FROM)}, got {weights_from!r}")
        self.preset = preset
        self.device = device
        self.host = host
        self.weights_from = weights_from
        self.path = weights_file(weights_dir, preset)
        self.pool = pool
        self.link_mbps = link_mbps
        self.timeout_s = timeout_s
        self.upstream_wait_s = upstream_wait_s

    def load(self) -> LoadedWeights:
        if not model_class(self.preset).transferable_weights:
            return self._from_checkpoint()
        plan = self.pool.plan() if self.weights_from in ("auto", "pool") else {}
        chain = plan.get("chain") or []
        if self.weights_from == "disk" or (self.weights_from == "auto" and len(chain) < 2):
            return self._from_disk()
        return self._from_pool(plan)

    # --- a model that loads from its own checkpoint directory ---------------------------------

    def _from_checkpoint(self) -> LoadedWeights:
        """Build the model from its own files (``MODEL_PATHS``); it serves no blocks to the pool."""
        if self.weights_from == "pool":
            raise WeightsUnavailable(
                f"--weights-from pool: {self.preset} loads from its checkpoint directory, not from peers", []
            )
        started = time.monotonic()
        model = build_model(self.preset, device=self.device)
        return LoadedWeights(model, None, DISK, "checkpoint directory", "", time.monotonic() - started)

    # --- disk -------------------------------------------------------------------------------------

    def _from_disk(self) -> LoadedWeights:
        started = time.monotonic()
        created = weights_file_ensure(self.path, self.preset)
        packed = load_weights(self.path, device=self.device)  # every block verified
        model = model_from_weights(packed, device=self.device)
        server = weights_serve(packed, device=self.device, host=self.host, link_mbps=self.link_mbps)
        seconds = time.monotonic() - started
        self.pool.complete(
            digest=packed.manifest.weights_id,
            address=server.address,
            weights_bytes=packed.manifest.total_bytes,
        )
        source = INIT if created else DISK
        return LoadedWeights(
            model,
            packed,
            source,
            str(self.path),
            server.address,
            seconds,
            {"disk": packed.manifest.total_bytes},
            server,
        )

    # --- peers ------------------------------------------------------------------------------------

    def _from_pool(self, plan: dict[str, Any]) -> LoadedWeights:
        """Pull along the plan's chain (or from the pool's copies); disk last under ``auto``."""
        started = time.monotonic()
        created = weights_file_ensure(self.path, self.preset)
        manifest = read_manifest(self.path)  # the manifest this worker trusts
        receiver = WeightsReceiver(manifest, device=self.device, host=self.host, link_mbps=self.link_mbps)
        kinds: dict[str, tuple[str, str]] = {}  # address → (recorded source, holder)
        try:
            # Advertised before receiving: the next receiver of the chain pulls from us.
            self.pool.loading(address=receiver.address or "", weights_bytes=manifest.total_bytes)
            sources = self._sources(plan, manifest.weights_id, kinds)
            disk = self.path if self.weights_from == "auto" else None
            logger.info(
                "weights.receive preset=%s sources=%s disk=%s",
                self.preset,
                [kinds[a][1] for a in sources],
                bool(disk),
            )
            result = receiver.receive(sources, disk_path=disk, timeout_s=self.timeout_s)
        except WeightsUnavailable:
            receiver.close()
            raise
        except BaseException:
            receiver.close()
            raise
        model = model_from_weights(result.packed, device=self.device)
        seconds = time.monotonic() - started
        if result.source == "disk" or result.source not in kinds:
            source, holder = (INIT if created else DISK), str(self.path)
        else:
            source, holder = kinds[result.source]
        self.pool.complete(
            digest=manifest.weights_id, address=receiver.address or "", weights_bytes=manifest.total_bytes
        )
        by_holder = {kinds.get(a, ("", a))[1]: n for a, n in result.bytes_by_source.items()}
        detail = f"{holder} ({', '.join(f'{h}: {n} B' for h, n in by_holder.items())})"
        return LoadedWeights(
            model, result.packed, source, detail, receiver.address or "", seconds, by_holder, receiver
        )

    def _sources(self, plan: dict[str, Any], weights_id: str, kinds: dict[str, tuple[str, str]]) -> list[str]:
        chain = plan.get("chain") or []
        position = int(plan.get("position") or 0)
        addresses: list[str] = []
        if len(chain) >= 2 and 1 <= position < len(chain):
            if plan.get("digest") and plan["digest"] != weights_id:
                logger.warning("weights.plan_version_mismatch plan=%s ours=%s", plan["digest"], weights_id)
                return []
            # Upstream first, then every holder further up the chain (chain_sources' order).
            for index in range(position - 1, -1, -1):
                name = chain[index]
                if index == 0:
                    if plan.get("source_kind") == "disk":
                        continue  # a disk chain's head is our own storage: the last fallback
                    address = plan.get("source_address") or self.pool.holder_address(name, 0.0)
                    kind = HOST_CACHE if plan.get("source_kind") == "host_cache" else PEER
                else:
                    address = self.pool.holder_address(name, self.upstream_wait_s)
                    kind = PEER
                if address and address not in kinds:
                    kinds[address] = (kind, name)
                    addresses.append(address)
            return addresses
        for holder in self.pool.sources_now():
            if holder.get("digest") and holder["digest"] != weights_id:
                continue
            address = holder.get("address")
            if address and address not in kinds:
                kinds[address] = (PEER if holder["kind"] == "gpu" else HOST_CACHE, holder["name"])
                addresses.append(address)
        return addresses


class PooledCopy:
    """A worker's loaded weights as its copy in the parameter pool (``stages.host.PoolCopy``)."""

    def __init__(self, weights: LoadedWeights, pool: PoolLink) -> None:
        self.weights = weights
        self.pool = pool

    def tensors(self) -> list[torch.Tensor]:
        return self.weights.tensors()

    def release(self) -> None:
        self.weights.release(self.pool)


class StageWeightsFetcher:
    """The weights of some components of the preset (a stage a worker loads at run time, issue 15):
    pulled from the parameter pool's complete copies (GPU peers, host caches; `PoolLink.sources_now`)
    block by block — only the components' blocks, verified against the local file's manifest —
    else read from the local file (written from the seeded weights first when missing).

    ``fetch(components)`` returns ``(tensors, source, detail)``: ``source`` is ``peer``,
    ``host-cache``, ``local`` or ``seed`` (where most of the bytes came from)."""

    def __init__(
        self,
        *,
        preset: str,
        device: str,
        host: str,
        weights_dir: str | os.PathLike[str],
        pool: PoolLink,
        link_mbps: float | None = None,
        timeout_s: float = 120.0,
    ) -> None:
        self.preset = preset
        self.device = device
        self.host = host
        self.path = weights_file(weights_dir, preset)
        self.pool = pool
        self.link_mbps = link_mbps
        self.timeout_s = timeout_s

    def fetch(self, components: list[str]) -> tuple[dict[str, torch.Tensor], str, str]:
        created = weights_file_ensure(self.path, self.preset)
        manifest = read_manifest(self.path)  # the manifest this worker trusts
        wanted = set(components)
        blocks = [block.index for block in manifest.blocks if block.tensors[0].name.split(".")[0] in wanted]
        kinds: dict[str, tuple[str, str]] = {}
        for holder in self.pool.sources_now():
            address = holder.get("address")
            if (
                not address
                or address in kinds
                or (holder.get("digest") and holder["digest"] != manifest.weights_id)
            ):
                continue
            kinds[address] = (PEER if holder["kind"] == "gpu" else HOST_CACHE, holder["name"])
        receiver = WeightsReceiver(
            manifest, device=self.device, host=self.host, link_mbps=self.link_mbps, serve=False, blocks=blocks
        )
        try:
            result = receiver.receive(list(kinds), disk_path=self.path, timeout_s=self.timeout_s)
        finally:
            receiver.close()
        if result.source in kinds:
            kind, holder_name = kinds[result.source]
        else:
            kind, holder_name = (INIT if created else DISK), str(self.path)
        by_holder = {kinds.get(a, ("", a))[1]: n for a, n in result.bytes_by_source.items()}
        detail = f"{holder_name} ({', '.join(f'{h}: {n} B' for h, n in by_holder.items())})"
        logger.info(
            "weights.stage_fetch preset=%s components=%s source=%s %s", self.preset, components, kind, detail
        )
        return receiver.block_tensors(), STAGE_SOURCES[kind], detail


def pinned(packed: PackedWeights) -> PackedWeights:
    """Page-locked host buffers where CUDA is available (fast host → GPU copies), else as they are."""
    if torch.cuda.is_available():
        return packed.pin()
    return packed
