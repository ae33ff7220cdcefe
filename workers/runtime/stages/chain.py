"""A driver for a chain of stage worker processes (``E → D → C``, ``E → DC``, …).

The driver hosts the rendezvous store, starts one worker process per role (``worker.main``, the
entry point of ``python -m workers.runtime.stages.worker``, forked from a forkserver that has
already imported torch and the runtime: seconds saved per process), feeds the head of the chain and reads frames from its tail:

    driver ──link "in"──▶ worker 0 ──"s0"──▶ worker 1 ──"s1"──▶ … ──"out"──▶ driver

It is what the tests and the hand-off benchmark use; a deployment's control plane would place the
workers and wire their links instead (not built here: see docs/runtime.md, stage-level serving).
"""

from __future__ import annotations

import multiprocessing as mp
import threading
from collections.abc import Sequence

import torch
from torch._C._distributed_c10d import TCPStore

from workers.runtime.stages import worker
from workers.runtime.stages.contract import parse_role
from workers.runtime.stages.link import DEFAULT_TIMEOUT_S, LinkReceiver, LinkSender, connect_store, open_pair
from workers.runtime.stages.pipeline import StageMessage
from workers.runtime.transport.pair import SOURCE_RANK, TARGET_RANK, timedelta

CONTEXT = mp.get_context("forkserver")
# torch._dynamo too: building a network on the meta device imports it (≈ 2 s per process here).
CONTEXT.set_forkserver_preload(["torch", "torch._dynamo", "workers.runtime.stages.worker"])


class StageChain:
    def __init__(
        self,
        preset: str,
        roles: Sequence[str],
        *,
        device: str = "cpu",
        max_in_flight_bytes: int | None = None,
        timeout_s: float = DEFAULT_TIMEOUT_S,
    ) -> None:
        for role in roles:
            parse_role(role)  # a bad role fails here, not in a child process
        self.device = torch.device(device)
        self.store = TCPStore(
            "127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(timeout_s)
        )
        links = ["in", *(f"s{i}" for i in range(len(roles) - 1)), "out"]
        address = f"127.0.0.1:{self.store.port}"
        self.processes = [
            CONTEXT.Process(
                target=worker.main,
                args=(
                    _flags(
                        preset=preset,
                        role=role,
                        store=address,
                        upstream=links[i],
                        downstream=links[i + 1],
                        device=device,
                        timeout_s=timeout_s,
                        max_in_flight_mb=None if max_in_flight_bytes is None else max_in_flight_bytes / 2**20,
                    ),
                ),
                name=f"stage-worker-{role}",
                daemon=True,
            )
            for i, role in enumerate(roles)
        ]
        for process in self.processes:
            process.start()
        # The head's link and the tail's are opened concurrently: each worker opens its upstream
        # link first, so the chain only completes once both ends are held. The tail's opener has
        # its own store client: a client blocks while it waits for a key.
        tail: dict[str, LinkReceiver] = {}
        opener = threading.Thread(
            target=lambda: tail.setdefault(
                "out",
                LinkReceiver(
                    open_pair(
                        connect_store(address), "out", TARGET_RANK, device=self.device, timeout_s=timeout_s
                    ),
                    timeout_s=timeout_s,
                ),
            ),
            daemon=True,
        )
        opener.start()
        kwargs = {} if max_in_flight_bytes is None else {"max_in_flight_bytes": max_in_flight_bytes}
        self.head = LinkSender(
            open_pair(self.store, "in", SOURCE_RANK, device=self.device, timeout_s=timeout_s),
            timeout_s=timeout_s,
            **kwargs,
        )
        opener.join(timeout_s)
        if "out" not in tail:
            self.close()
            raise RuntimeError("the tail of the stage chain did not connect")
        self.tail = tail["out"]

    def send(self, message: StageMessage) -> None:
        self.head.send(message)

    def recv(self) -> StageMessage:
        return self.tail.recv()

    def close(self, timeout_s: float = 30.0) -> list[int | None]:
        """Stop the chain (``stop`` through every worker) and return the workers' exit codes."""
        if hasattr(self, "tail"):
            self.head.send(StageMessage("stop"))
            while self.tail.recv().kind != "stop":
                pass
        codes = []
        for process in self.processes:
            process.join(timeout_s)
            if process.exitcode is None:
                process.kill()
                process.join()
            codes.append(process.exitcode)
        self.head.close()
        if hasattr(self, "tail"):
            self.tail.close()
        return codes


def _flags(**values: object) -> list[str]:
    """``worker.main`` arguments: ``max_in_flight_mb=2.0`` → ``["--max-in-flight-mb", "2.0"]``."""
    argv = []
    for name, value in values.items():
        if value is not None:
            argv += [f"--{name.replace('_', '-')}", str(value)]
    return argv
