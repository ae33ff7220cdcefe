"""Gloo pair group: CPU tensors over TCP between two worker processes."""

from __future__ import annotations

import contextlib
from typing import Any

import torch
from torch._C._distributed_c10d import ProcessGroupGloo

from .pair import PairGroup, timedelta


class GlooPairGroup(PairGroup):
    name = "gloo"

    def __init__(
        self, store: Any, rank: int, *, device: torch.device, local_host: str, timeout_s: float
    ) -> None:
        super().__init__(store, rank, device=device, local_host=local_host, timeout_s=timeout_s)
        options = ProcessGroupGloo._Options()
        options._timeout = timedelta(timeout_s)
        # Bind to the interface that reaches the peer instead of resolving this host's name, which
        # may not resolve (containers) or may resolve to an address the peer cannot reach.
        options._devices = [ProcessGroupGloo.create_device(hostname=local_host)]
        self._group: ProcessGroupGloo | None = ProcessGroupGloo(store, rank, 2, options)

    def _live(self) -> ProcessGroupGloo:
        if self._group is None:
            raise RuntimeError("pair group already closed")
        return self._group

    def isend(self, tensor: torch.Tensor) -> Any:
        return self._live().send([tensor], self.peer, 0)

    def irecv(self, tensor: torch.Tensor) -> Any:
        return self._live().recv([tensor], self.peer, 0)

    def wait(self, handle: Any, timeout_s: float) -> None:
        handle.wait(timedelta(timeout_s))

    def abort(self) -> None:
        group, self._group = self._group, None
        if group is not None:
            with contextlib.suppress(RuntimeError):
                group.abort()
