"""Encoder failover's rule (docs/stages.md, "Encoders"): when a worker without E needs another encoder.

The live loop's encoder failover (``scheduling.live.stages.encoders.encoder_failover``, a step of the
decision run after the pipeline: ``scheduling.core.pipeline``) reads the workers' roles, the encoder
each was last told to use and their heartbeats, asks this rule for each, and sends ``set_encoder``.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from typing import Any


def encoder_lost(
    current: str | None, ready_encoders: Collection[str], encoder_wait: Mapping[str, Any] | None
) -> str | None:
    """Why a worker without E needs another encoder, or ``None``: the one it uses (``current``) is
    no longer among the ready encoders, or its heartbeat's ``encoder_wait`` says its sessions wait
    for an encoder that is lost (or unknown)."""
    if current and current not in ready_encoders:
        return f"encoder {current} is no longer ready"
    if isinstance(encoder_wait, Mapping) and encoder_wait.get("sessions"):
        reason = str(encoder_wait.get("reason", ""))
        # "waiting for encoder X's answer" is an encode in flight; anything else (X lost, X's encode
        # failed, no encoder known) will not end by itself.
        if not reason.startswith("waiting for encoder"):
            return f"heartbeat: {reason}"[:500]
    return None
