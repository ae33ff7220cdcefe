"""NCCL pair group: GPU tensors between two worker processes (NVLink / PCIe / IB, as NCCL chooses).

Not exercised on the CPU-only development box; see docs/migration.md for what was and was not tested.
"""

from __future__ import annotations

import contextlib
import time
from typing import Any

import torch

from .pair import PairGroup, timedelta

_WATCHDOG_TIMEOUT_S = 3600.0


class NcclPairGroup(PairGroup):
    name = "nccl"

    def __init__(
        self, store: Any, rank: int, *, device: torch.device, local_host: str, timeout_s: float
    ) -> None:
        super().__init__(store, rank, device=device, local_host=local_host, timeout_s=timeout_s)
        from torch._C._distributed_c10d import ProcessGroupNCCL

        if device.type != "cuda" or device.index is None:
            raise ValueError(f"NCCL pair group needs an indexed CUDA device, got {device}")
        options = ProcessGroupNCCL.Options()
        options.is_high_priority_stream = False
        # The caller's deadline is enforced by `wait` on the host, followed by `abort`. The PG's own
        # timeout drives the NCCL watchdog, whose default error handling tears the whole process
        # down, and a cached link outlives the deadline it was built under: keep it far away.
        options._timeout = timedelta(max(timeout_s, _WATCHDOG_TIMEOUT_S))
        with torch.cuda.device(device):
            self._group: Any = ProcessGroupNCCL(store, rank, 2, options)

    def _live(self) -> Any:
        if self._group is None:
            raise RuntimeError("pair group already closed")
        return self._group

    def isend(self, tensor: torch.Tensor) -> Any:
        with torch.cuda.device(self.device):
            return self._live().send([tensor], self.peer, 0)

    def irecv(self, tensor: torch.Tensor) -> Any:
        with torch.cuda.device(self.device):
            return self._live().recv([tensor], self.peer, 0)

    def wait(self, handle: Any, timeout_s: float) -> None:
        # NCCL work completes asynchronously on a stream; poll so the deadline holds on the host too
        # (the NCCL watchdog enforces the group timeout as well).
        deadline = time.monotonic() + timeout_s
        while not handle.is_completed():
            if time.monotonic() > deadline:
                raise TimeoutError(f"NCCL transfer did not complete within {timeout_s:.1f}s")
            time.sleep(0.0005)
        handle.wait()
        torch.cuda.current_stream(self.device).synchronize()

    def abort(self) -> None:
        group, self._group = self._group, None
        if group is not None:
            with contextlib.suppress(RuntimeError):
                group.abort()

    def close(self) -> None:
        group, self._group = self._group, None
        if group is not None:
            try:
                group.shutdown()
            except (RuntimeError, AttributeError):
                group.abort()
