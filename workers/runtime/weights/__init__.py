"""Model weights by block, and their fast transfer between workers (BlitzScale §5.1, §5.3).

``manifest``: the block manifest, packed per-block buffers, checksums, the safetensors disk source.
``transfer``: ``WeightServer`` / ``weights_serve`` (holders) and ``WeightsReceiver`` /
``weights_receive`` (new workers), chained and pipelined over pair groups, with fallbacks.
See docs/scaleout.md.
"""

from __future__ import annotations

from typing import Any

import torch

from workers.runtime.models import build_model

from .manifest import (
    DEFAULT_PIECE_BYTES,
    PackedWeights,
    WeightsManifest,
    WeightsManifestError,
    drop_page_cache,
    load_weights,
    read_manifest,
    save_weights,
)
from .transfer import (
    LinkPacer,
    ReceiveResult,
    WeightsChecksumMismatch,
    WeightServer,
    WeightsReceiver,
    WeightsRefused,
    WeightsSourceLost,
    WeightsTimeout,
    WeightsTransferError,
    WeightsUnavailable,
    chain_sources,
    weights_receive,
    weights_serve,
)


def pack_model(model: Any, *, piece_bytes: int = DEFAULT_PIECE_BYTES) -> PackedWeights:
    """Pack a built model's weights and make the model use the packed buffers (one copy, served)."""
    packed = PackedWeights.from_state_dict(model.preset, model.weights_state_dict(), piece_bytes=piece_bytes)
    model.adopt_weights(packed.state_dict())
    return packed


def model_from_weights(packed: PackedWeights, *, device: torch.device | str | None = None) -> Any:
    """Build the manifest's model around the packed buffers (no copy when the device matches)."""
    return build_model(
        packed.manifest.model, device=packed.device if device is None else device, weights=packed.state_dict()
    )


__all__ = [
    "DEFAULT_PIECE_BYTES",
    "LinkPacer",
    "PackedWeights",
    "ReceiveResult",
    "WeightServer",
    "WeightsChecksumMismatch",
    "WeightsManifest",
    "WeightsManifestError",
    "WeightsReceiver",
    "WeightsRefused",
    "WeightsSourceLost",
    "WeightsTimeout",
    "WeightsTransferError",
    "WeightsUnavailable",
    "chain_sources",
    "drop_page_cache",
    "load_weights",
    "model_from_weights",
    "pack_model",
    "read_manifest",
    "save_weights",
    "weights_receive",
    "weights_serve",
]
