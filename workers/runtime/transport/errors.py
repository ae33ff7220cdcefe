"""Errors raised by a state migration, on either side.

Every error carries the protocol ``stage`` it happened in so the worker daemon can report it, and the
guarantee that matters to the control plane is the same for all of them: a migration that raised on
the source never reached step (iii) of TurboServe §6.1, so ownership must not flip and the source's
state region is still the session's only authoritative copy.
"""

from __future__ import annotations


class MigrationError(RuntimeError):
    """A migration did not complete; the session stays owned by its source."""

    def __init__(self, message: str, *, stage: str) -> None:
        super().__init__(f"[{stage}] {message}")
        self.stage = stage


class ManifestError(MigrationError, ValueError):
    """The manifest and tensors handed to the transport disagree, or a received manifest is malformed."""


class MigrationTimeout(MigrationError, TimeoutError):
    """A step did not finish within the caller's deadline (peer absent, hung or too slow)."""


class PeerLost(MigrationError):
    """The other side's process or connection went away mid-protocol."""


class ChecksumMismatch(MigrationError):
    """The bytes the target received differ from the bytes the source sent."""


class MigrationRejected(MigrationError):
    """The target's ``install`` callback refused the state (e.g. the manifest does not match its model)."""
