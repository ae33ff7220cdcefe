"""A worker that has lost its control plane stops rather than generating for nobody (issue 31).

Two signs of a living control plane reach a worker: commands on its stream, and the scheduler
tick's acknowledgement of its heartbeat (``contracts.wire.channel.heartbeats_acknowledge``, a
counter the tick bumps for every worker it counts as alive). A worker that sees neither for
``timeout_s`` (``WORKER_ORPHAN_TIMEOUT_S``) checkpoints its sessions and exits non-zero; the
sessions continue from those checkpoints once a control plane runs again (``sessions_recover``).
A worker whose row the control plane has failed or released gets no acknowledgement either, so it
stops too: its sessions were already placed elsewhere.

Timed on the worker's own clock, from the moment it saw the counter change: no clock is shared
across hosts.
"""

from __future__ import annotations

import threading
from collections.abc import Callable


class OrphanWatch:
    """When the control plane was last heard from; ``timeout_s`` 0 never declares it lost."""

    def __init__(self, *, timeout_s: float, clock: Callable[[], float]) -> None:
        self.timeout_s = timeout_s
        self.clock = clock
        self._lock = threading.Lock()
        self._heard_at = clock()  # a whole timeout of grace from the start
        self._ack: bytes | None = None

    def heard(self) -> None:
        """A command arrived on the stream."""
        with self._lock:
            self._heard_at = self.clock()

    def acknowledgement(self, value: bytes | None) -> None:
        """The heartbeat thread read the acknowledgement counter: a new value is contact."""
        with self._lock:
            if value is not None and value != self._ack:
                self._ack = value
                self._heard_at = self.clock()

    def silent_s(self) -> float:
        with self._lock:
            return self.clock() - self._heard_at

    def lost(self) -> bool:
        return self.timeout_s > 0 and self.silent_s() > self.timeout_s
