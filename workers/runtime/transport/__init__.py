"""State-region migration between worker processes over ``torch.distributed`` point-to-point.

See docs/migration.md. Public API: ``MigrationListener`` (target), ``send_state`` (source), their
reports, and the error types.
"""

from __future__ import annotations

from .errors import (
    ChecksumMismatch,
    ManifestError,
    MigrationError,
    MigrationRejected,
    MigrationTimeout,
    PeerLost,
)
from .migration import MigrationListener, MigrationSender, ReceiveReport, SendReport, send_state
from .pair import backend_for_device

__all__ = [
    "ChecksumMismatch",
    "ManifestError",
    "MigrationError",
    "MigrationListener",
    "MigrationRejected",
    "MigrationSender",
    "MigrationTimeout",
    "PeerLost",
    "ReceiveReport",
    "SendReport",
    "backend_for_device",
    "send_state",
]
