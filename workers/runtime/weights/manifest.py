"""Model weights addressed by block: the manifest, packed blocks, checksums and the safetensors file.

A model's state dict is cut into *blocks* (BlitzScale §5.3 addresses parameters by layer): every
tensor whose name has a numeric component belongs to the block named by the prefix through it
(``dit.blocks.3.q.weight`` → ``dit.blocks.3``), any other tensor to the block of its first two name
components (``dit.patch_embed.weight`` → ``dit.patch_embed``). Blocks keep the state dict's order.

A block travels and lives as one flat ``uint8`` buffer: its tensors back to back, each starting at a
multiple of ``ALIGNMENT`` bytes, padding zeroed (so the bytes, hence the checksums, are a function of
the weights alone). The buffer is cut into *pieces* of ``piece_bytes``; every piece carries its own
XXH3-64 checksum in the manifest, so a receiver verifies (and forwards) each piece as soon as it has
arrived, and a block is complete when all its pieces are. The manifest, as JSON::

    {"format": "streamserve-weights", "version": 1, "model": <preset>, "piece_bytes": int,
     "alignment": 256, "weights_id": <hex: XXH3-64 over the block checksums>, "total_bytes": int,
     "blocks": [{"name": str, "nbytes": int, "checksum": <hex XXH3-64 of the block buffer>,
                 "pieces": [<hex XXH3-64 of each piece>, ...],
                 "tensors": [{"name": str, "dtype": "float32", "shape": [int, ...], "offset": int}]}]}

``weights_id`` names one version of one model's weights: two holders with the same id hold the same
bytes, which is what lets a receiver take any block from any of them.

On disk (the "disk" source) the weights are an ordinary safetensors file of the state dict with the
manifest JSON in its metadata under ``streamserve.weights_manifest``; loading packs and verifies
each block against a manifest the caller trusts (never only against the file's own copy).
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import xxhash

WEIGHTS_FORMAT = "streamserve-weights"
WEIGHTS_FORMAT_VERSION = 1
ALIGNMENT = 256  # bytes: every tensor view is aligned for any dtype and for GPU copies
DEFAULT_PIECE_BYTES = 1 << 20
METADATA_KEY = "streamserve.weights_manifest"

_DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "float64": torch.float64,
    "int64": torch.int64,
    "int32": torch.int32,
    "int16": torch.int16,
    "int8": torch.int8,
    "uint8": torch.uint8,
    "bool": torch.bool,
}
_DTYPE_NAMES = {dtype: name for name, dtype in _DTYPES.items()}


class WeightsManifestError(ValueError):
    """A weights manifest is malformed, or weights do not match the manifest they claim to follow."""


def block_name(tensor_name: str) -> str:
    parts = tensor_name.split(".")
    for index, part in enumerate(parts[:-1]):
        if part.isdigit():
            return ".".join(parts[: index + 1])
    return ".".join(parts[:2])


def checksum(data: torch.Tensor) -> str:
    """XXH3-64 (hex) of a flat uint8 tensor's bytes; a CUDA tensor is hashed from a host copy."""
    if data.device.type != "cpu":
        data = data.cpu()
    if data.numel() == 0:
        return xxhash.xxh3_64(b"").hexdigest()
    return xxhash.xxh3_64(memoryview(data.numpy())).hexdigest()


@dataclass(frozen=True)
class TensorEntry:
    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    offset: int

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize


@dataclass(frozen=True)
class BlockEntry:
    index: int
    name: str
    nbytes: int
    checksum: str
    pieces: tuple[str, ...]
    tensors: tuple[TensorEntry, ...]


@dataclass(frozen=True)
class WeightsManifest:
    model: str
    piece_bytes: int
    blocks: tuple[BlockEntry, ...]
    weights_id: str

    @property
    def total_bytes(self) -> int:
        return sum(block.nbytes for block in self.blocks)

    @property
    def tensor_count(self) -> int:
        return sum(len(block.tensors) for block in self.blocks)

    def piece_range(self, block: int, piece: int) -> tuple[int, int]:
        start = piece * self.piece_bytes
        return start, min(start + self.piece_bytes, self.blocks[block].nbytes)

    def to_json(self) -> dict[str, Any]:
        return {
            "format": WEIGHTS_FORMAT,
            "version": WEIGHTS_FORMAT_VERSION,
            "model": self.model,
            "piece_bytes": self.piece_bytes,
            "alignment": ALIGNMENT,
            "weights_id": self.weights_id,
            "total_bytes": self.total_bytes,
            "blocks": [
                {
                    "name": block.name,
                    "nbytes": block.nbytes,
                    "checksum": block.checksum,
                    "pieces": list(block.pieces),
                    "tensors": [
                        {
                            "name": t.name,
                            "dtype": _DTYPE_NAMES[t.dtype],
                            "shape": list(t.shape),
                            "offset": t.offset,
                        }
                        for t in block.tensors
                    ],
                }
                for block in self.blocks
            ],
        }

    def dumps(self) -> str:
        return json.dumps(self.to_json(), separators=(",", ":"))

    @classmethod
    def from_json(cls, raw: Mapping[str, Any] | str) -> WeightsManifest:
        """Parse and validate; every error names the offending field."""
        if isinstance(raw, str):
            try:
                raw = json.loads(raw)
            except ValueError as exc:
                raise WeightsManifestError(f"weights manifest is not valid JSON: {exc}") from exc
        if not isinstance(raw, Mapping):
            raise WeightsManifestError("weights manifest must be a JSON object")
        if raw.get("format") != WEIGHTS_FORMAT or raw.get("version") != WEIGHTS_FORMAT_VERSION:
            raise WeightsManifestError(
                f"format/version is {raw.get('format')!r}/{raw.get('version')!r}, "
                f"expected {WEIGHTS_FORMAT!r}/{WEIGHTS_FORMAT_VERSION}"
            )
        if raw.get("alignment") != ALIGNMENT:
            raise WeightsManifestError(f"alignment is {raw.get('alignment')!r}, expected {ALIGNMENT}")
        model, piece_bytes = raw.get("model"), raw.get("piece_bytes")
        if not isinstance(model, str) or not model:
            raise WeightsManifestError("model must be a non-empty string")
        if not isinstance(piece_bytes, int) or piece_bytes <= 0:
            raise WeightsManifestError(f"piece_bytes must be a positive integer, got {piece_bytes!r}")
        entries = raw.get("blocks")
        if not isinstance(entries, list) or not entries:
            raise WeightsManifestError("blocks must be a non-empty list")
        blocks = tuple(_parse_block(index, entry, piece_bytes) for index, entry in enumerate(entries))
        names = [t.name for block in blocks for t in block.tensors]
        if len(set(names)) != len(names):
            raise WeightsManifestError("tensor names are not unique across blocks")
        manifest = cls(model, piece_bytes, blocks, str(raw.get("weights_id")))
        expected = weights_id_of(block.checksum for block in blocks)
        if manifest.weights_id != expected:
            raise WeightsManifestError(
                f"weights_id {manifest.weights_id!r} does not match the block checksums ({expected!r})"
            )
        return manifest


def _parse_block(index: int, entry: Any, piece_bytes: int) -> BlockEntry:
    where = f"blocks[{index}]"
    if not isinstance(entry, Mapping):
        raise WeightsManifestError(f"{where} must be an object")
    name, nbytes, digest, pieces = (entry.get(k) for k in ("name", "nbytes", "checksum", "pieces"))
    if not isinstance(name, str) or not isinstance(nbytes, int) or nbytes <= 0:
        raise WeightsManifestError(f"{where}: name must be a string and nbytes a positive integer")
    if not isinstance(digest, str) or not isinstance(pieces, list):
        raise WeightsManifestError(f"{where}: checksum must be a string and pieces a list")
    if len(pieces) != -(-nbytes // piece_bytes) or not all(isinstance(p, str) for p in pieces):
        raise WeightsManifestError(
            f"{where}.pieces: {len(pieces)} entries, expected {-(-nbytes // piece_bytes)} checksums"
        )
    tensors = []
    for position, t in enumerate(entry.get("tensors") or []):
        field = f"{where}.tensors[{position}]"
        try:
            dtype = _DTYPES[t["dtype"]]
            shape = tuple(int(d) for d in t["shape"])
            tensor = TensorEntry(str(t["name"]), dtype, shape, int(t["offset"]))
        except (KeyError, TypeError, ValueError) as exc:
            raise WeightsManifestError(f"{field} is malformed: {exc!r}") from exc
        if tensor.offset % ALIGNMENT or tensor.offset + tensor.nbytes > nbytes or min(shape, default=0) < 0:
            raise WeightsManifestError(f"{field} ({tensor.name}) lies outside its block or is misaligned")
        tensors.append(tensor)
    if not tensors:
        raise WeightsManifestError(f"{where}.tensors must be a non-empty list")
    return BlockEntry(index, name, nbytes, digest, tuple(pieces), tuple(tensors))


def weights_id_of(block_checksums: Iterable[str]) -> str:
    return xxhash.xxh3_64("|".join(block_checksums).encode()).hexdigest()


def _layout(named: Sequence[tuple[str, torch.Tensor]]) -> tuple[list[TensorEntry], int]:
    entries, cursor = [], 0
    for name, tensor in named:
        if tensor.dtype not in _DTYPE_NAMES:
            raise WeightsManifestError(f"tensor {name!r} has unsupported dtype {tensor.dtype}")
        cursor = -(-cursor // ALIGNMENT) * ALIGNMENT
        entry = TensorEntry(name, tensor.dtype, tuple(tensor.shape), cursor)
        entries.append(entry)
        cursor += entry.nbytes
    return entries, cursor


def block_views(buffer: torch.Tensor, block: BlockEntry) -> dict[str, torch.Tensor]:
    """The named tensors of ``block`` as views of its flat buffer (no copy)."""
    return {t.name: buffer[t.offset : t.offset + t.nbytes].view(t.dtype).view(t.shape) for t in block.tensors}


def _piece_checksums(buffer: torch.Tensor, piece_bytes: int) -> tuple[str, ...]:
    host = buffer.cpu() if buffer.device.type != "cpu" else buffer
    return tuple(checksum(host[start : start + piece_bytes]) for start in range(0, host.numel(), piece_bytes))


class PackedWeights:
    """A complete, verified set of weights: the manifest plus one flat buffer per block.

    The holder side of every transfer (a serving worker, the host cache, a receiver that finished).
    ``state_dict()`` gives views into the buffers, so a model built with
    ``build_model(preset, weights=packed.state_dict())`` and the server that serves its peers share
    one copy of the bytes.
    """

    def __init__(self, manifest: WeightsManifest, buffers: Sequence[torch.Tensor]) -> None:
        if len(buffers) != len(manifest.blocks):
            raise WeightsManifestError(f"{len(buffers)} buffers for {len(manifest.blocks)} blocks")
        for block, buffer in zip(manifest.blocks, buffers, strict=True):
            if buffer.dtype != torch.uint8 or buffer.dim() != 1 or buffer.numel() != block.nbytes:
                raise WeightsManifestError(f"buffer of block {block.name!r} does not match its size")
        self.manifest = manifest
        self.buffers = list(buffers)

    @property
    def device(self) -> torch.device:
        return self.buffers[0].device

    def state_dict(self) -> dict[str, torch.Tensor]:
        out: dict[str, torch.Tensor] = {}
        for block, buffer in zip(self.manifest.blocks, self.buffers, strict=True):
            out.update(block_views(buffer, block))
        return out

    def verify(self) -> None:
        """Recompute every block checksum; raise ``WeightsManifestError`` naming the first bad block."""
        for block, buffer in zip(self.manifest.blocks, self.buffers, strict=True):
            if checksum(buffer) != block.checksum:
                raise WeightsManifestError(f"block {block.name!r} fails its checksum")

    def pin(self) -> PackedWeights:
        """Page-locked host copies (a host cache on a GPU machine), when CUDA is present."""
        if not torch.cuda.is_available() or self.device.type != "cpu":
            return self
        return PackedWeights(self.manifest, [b.pin_memory() for b in self.buffers])

    @classmethod
    def from_state_dict(
        cls,
        model: str,
        state_dict: Mapping[str, torch.Tensor],
        *,
        device: torch.device | str | None = None,
        piece_bytes: int = DEFAULT_PIECE_BYTES,
    ) -> PackedWeights:
        """Pack (copy) a state dict into per-block buffers and compute the manifest."""
        if piece_bytes <= 0:
            raise ValueError(f"piece_bytes must be positive, got {piece_bytes}")
        groups: dict[str, list[tuple[str, torch.Tensor]]] = {}
        for name, tensor in state_dict.items():
            groups.setdefault(block_name(name), []).append((name, tensor))
        blocks, buffers = [], []
        for index, (name, named) in enumerate(groups.items()):
            entries, nbytes = _layout(named)
            target = torch.device(device) if device is not None else named[0][1].device
            buffer = torch.zeros(nbytes, dtype=torch.uint8, device=target)
            for entry, (_, tensor) in zip(entries, named, strict=True):
                view = buffer[entry.offset : entry.offset + entry.nbytes]
                view.copy_(tensor.detach().contiguous().reshape(-1).view(torch.uint8))
            blocks.append(
                BlockEntry(
                    index,
                    name,
                    nbytes,
                    checksum(buffer),
                    _piece_checksums(buffer, piece_bytes),
                    tuple(entries),
                )
            )
            buffers.append(buffer)
        weights_id = weights_id_of(block.checksum for block in blocks)
        return cls(WeightsManifest(model, piece_bytes, tuple(blocks), weights_id), buffers)


# --- the disk source (safetensors) ----------------------------------------------------------------


def save_weights(path: str | os.PathLike[str], packed: PackedWeights) -> None:
    """Write the state dict as safetensors with the manifest in the file's metadata."""
    from safetensors.torch import save_file

    # Views of one block buffer share storage, which safetensors refuses: hand it owning copies.
    tensors = {name: t.detach().cpu().clone() for name, t in packed.state_dict().items()}
    save_file(tensors, os.fspath(path), metadata={METADATA_KEY: packed.manifest.dumps()})


def read_manifest(path: str | os.PathLike[str]) -> WeightsManifest:
    from safetensors import safe_open

    with safe_open(os.fspath(path), framework="pt") as handle:
        metadata = handle.metadata() or {}
    if METADATA_KEY not in metadata:
        raise WeightsManifestError(f"{os.fspath(path)} carries no {METADATA_KEY} metadata")
    return WeightsManifest.from_json(metadata[METADATA_KEY])


def load_blocks(
    path: str | os.PathLike[str],
    manifest: WeightsManifest,
    blocks: Iterable[int],
    into: Mapping[int, torch.Tensor],
) -> None:
    """Read ``blocks`` of the file into the flat buffers ``into[index]`` and verify each one.

    Raises ``WeightsManifestError`` when the file's weights are not ``manifest``'s (another
    ``weights_id``, a missing tensor, another shape) or a block fails its checksum; a buffer that
    failed is left with unverified bytes, which the caller must not install.
    """
    from safetensors import safe_open

    path = os.fspath(path)
    with safe_open(path, framework="pt") as handle:
        own = (handle.metadata() or {}).get(METADATA_KEY)
        if own is not None and json.loads(own).get("weights_id") != manifest.weights_id:
            raise WeightsManifestError(f"{path} holds other weights than {manifest.weights_id}")
        keys = set(handle.keys())
        for index in blocks:
            block, buffer = manifest.blocks[index], into[index]
            staging = buffer if buffer.device.type == "cpu" else torch.empty_like(buffer, device="cpu")
            staging.zero_()
            for entry in block.tensors:
                if entry.name not in keys:
                    raise WeightsManifestError(f"{path} lacks tensor {entry.name!r}")
                tensor = handle.get_tensor(entry.name)
                if tuple(tensor.shape) != entry.shape or tensor.dtype != entry.dtype:
                    raise WeightsManifestError(
                        f"{path}: tensor {entry.name!r} is {tuple(tensor.shape)}/{tensor.dtype}, "
                        f"manifest says {entry.shape}/{entry.dtype}"
                    )
                staging[entry.offset : entry.offset + entry.nbytes].copy_(
                    tensor.reshape(-1).view(torch.uint8)
                )
            if checksum(staging) != block.checksum:
                raise WeightsManifestError(f"{path}: block {block.name!r} fails its checksum")
            if staging is not buffer:
                buffer.copy_(staging)


def load_weights(
    path: str | os.PathLike[str],
    manifest: WeightsManifest | None = None,
    *,
    device: torch.device | str = "cpu",
) -> PackedWeights:
    """All blocks from disk, verified against ``manifest`` (default: the file's own manifest)."""
    manifest = manifest or read_manifest(path)
    buffers = {
        block.index: torch.empty(block.nbytes, dtype=torch.uint8, device=device) for block in manifest.blocks
    }
    load_blocks(path, manifest, range(len(manifest.blocks)), buffers)
    return PackedWeights(manifest, [buffers[i] for i in range(len(manifest.blocks))])


def drop_page_cache(path: str | os.PathLike[str]) -> bool:
    """Ask the kernel to evict the file's clean pages (``POSIX_FADV_DONTNEED``), so the next read
    comes from the device. Returns False where the call is unavailable; pages mapped elsewhere stay."""
    if not hasattr(os, "posix_fadvise"):
        return False
    fd = os.open(os.fspath(path), os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)
    return True
