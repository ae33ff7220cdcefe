"""A driver for stage worker processes: a chain (``E → D → C``, ``E → DC``) or a shared head.

The driver hosts the rendezvous store, starts one worker process per role (``worker.main``, the
entry point of ``python -m workers.runtime.stages.worker``, forked from a forkserver that has
already imported torch and the runtime: seconds saved per process), feeds the head and reads
frames from each branch's tail:

    branches=1:  driver ─"in"─▶ roles[0] ─▶ roles[1] ─▶ … ─"out0"─▶ driver
    branches=n:  driver ─"in"─▶ roles[0] ─route b0─▶ roles[1:] ─"out0"─▶ driver
                                        └─route b1─▶ roles[1:] ─"out1"─▶ driver   (…)

With several branches ``roles[0]`` is one worker shared by all of them — a shared text-encoder
(``E``) serving several diffusion workers — and a session's ``open`` names its branch in
``meta["route"]`` (``"b0"``, ``"b1"``, …). It is what the tests and the hand-off benchmark use; live
workers run as worker daemons in a role instead (``gpuworker --stages``, ``stages/host.py``).
"""

from __future__ import annotations

import multiprocessing as mp
import threading
from collections.abc import Sequence

import torch
from torch._C._distributed_c10d import TCPStore

from contracts.catalog.local_paths import WanCausalArchitecture
from contracts.catalog.presets import PRESETS
from workers.runtime.stages import worker
from workers.runtime.stages.contract import parse_role
from workers.runtime.stages.link import DEFAULT_TIMEOUT_S, LinkReceiver, LinkSender, connect_store, open_pair
from workers.runtime.stages.pipeline import StageMessage
from workers.runtime.transport.pair import SOURCE_RANK, TARGET_RANK, timedelta

CONTEXT = mp.get_context("forkserver")
# torch._dynamo too: building a network on the meta device imports it (≈ 2 s per process here).
CONTEXT.set_forkserver_preload(["torch", "torch._dynamo", "workers.runtime.stages.worker"])


def route(branch: int) -> str:
    return f"b{branch}"


class StageChain:
    def __init__(
        self,
        preset: str,
        roles: Sequence[str],
        *,
        branches: int = 1,
        device: str = "cpu",
        max_in_flight_bytes: int | None = None,
        timeout_s: float = DEFAULT_TIMEOUT_S,
    ) -> None:
        for role in roles:
            parse_role(role)  # a bad role fails here, not in a child process
        if branches < 1 or (branches > 1 and len(roles) < 2):
            raise ValueError(
                "branches >= 1; several branches need a shared head and at least one role after it"
            )
        self.device = torch.device(device)
        if self.device.type != "cpu":
            # NCCL allows one rank per GPU and this driver puts every worker on `device`; on GPUs
            # start each worker on its own (`python -m workers.runtime.stages.worker --device cuda:N`).
            raise ValueError("StageChain runs its workers on the CPU (Gloo); NCCL needs one GPU per worker")
        self.branches = branches
        self.store = TCPStore(
            "127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(timeout_s)
        )
        address = f"127.0.0.1:{self.store.port}"
        common = {
            "preset": preset,
            "store": address,
            "device": device,
            "timeout_s": timeout_s,
            "max_in_flight_mb": None if max_in_flight_bytes is None else max_in_flight_bytes / 2**20,
            "model_path": model_path(preset),
        }
        plan = _plan(roles, branches)
        self.processes = [
            CONTEXT.Process(
                target=worker.main,
                args=(_flags(role=role, upstream=upstream, downstream=downstream, **common),),
                name=f"stage-worker-{role}",
                daemon=True,
            )
            for role, upstream, downstream in plan
        ]
        for process in self.processes:
            process.start()
        # The head's link and the tails' are opened concurrently: each worker opens its upstream
        # link first, so the graph only completes once every end is held. Each tail's opener has its
        # own store client: a client blocks while it waits for a key.
        self.tails: dict[int, LinkReceiver] = {}
        openers = [
            threading.Thread(target=self._open_tail, args=(address, branch, timeout_s), daemon=True)
            for branch in range(branches)
        ]
        for opener in openers:
            opener.start()
        kwargs = {} if max_in_flight_bytes is None else {"max_in_flight_bytes": max_in_flight_bytes}
        self.head = LinkSender(
            open_pair(self.store, "in", SOURCE_RANK, device=self.device, timeout_s=timeout_s),
            timeout_s=timeout_s,
            **kwargs,
        )
        for opener in openers:
            opener.join(timeout_s)
        if len(self.tails) != branches:
            self.close()
            raise RuntimeError("a tail of the stage workers did not connect")

    def send(self, message: StageMessage) -> None:
        self.head.send(message)

    def recv(self, branch: int = 0) -> StageMessage:
        return self.tails[branch].recv()

    def close(self, timeout_s: float = 30.0) -> list[int | None]:
        """Stop the workers (``stop`` through every one) and return their exit codes."""
        if len(self.tails) == self.branches:
            self.head.send(StageMessage("stop"))
            for tail in self.tails.values():
                while tail.recv().kind != "stop":
                    pass
        codes = []
        for process in self.processes:
            process.join(timeout_s)
            if process.exitcode is None:
                process.kill()
                process.join()
            codes.append(process.exitcode)
        self.head.close()
        for tail in self.tails.values():
            tail.close()
        return codes

    def _open_tail(self, address: str, branch: int, timeout_s: float) -> None:
        group = open_pair(
            connect_store(address), f"out{branch}", TARGET_RANK, device=self.device, timeout_s=timeout_s
        )
        # The driver waits for answers, not for new work: a silent tail is a failure after timeout_s.
        self.tails[branch] = LinkReceiver(group, timeout_s=timeout_s, idle_timeout_s=timeout_s)


def model_path(preset: str) -> str | None:
    """The checkpoint directory a worker process registers ``preset`` from (a ``MODEL_PATHS``
    preset: registered in this process only), or None for a built-in preset."""
    entry = PRESETS.get(preset)
    if entry is not None and isinstance(entry.architecture, WanCausalArchitecture):
        return entry.architecture.path
    return None


def _plan(roles: Sequence[str], branches: int) -> list[tuple[str, str, list[str]]]:
    """(role, upstream link, downstream ``ROUTE=LINK``s) of every worker process."""
    if branches == 1:
        links = ["in", *(f"b0.{i}" for i in range(1, len(roles))), "out0"]
        return [(role, links[i], [links[i + 1]]) for i, role in enumerate(roles)]
    plan = [(roles[0], "in", [f"{route(b)}=b{b}.1" for b in range(branches)])]
    for b in range(branches):
        links = [*(f"b{b}.{i}" for i in range(1, len(roles))), f"out{b}"]
        plan += [(role, links[i], [links[i + 1]]) for i, role in enumerate(roles[1:])]
    return plan


def _flags(**values: object) -> list[str]:
    """``worker.main`` arguments: ``max_in_flight_mb=2.0`` → ``["--max-in-flight-mb", "2.0"]``."""
    argv: list[str] = []
    for name, value in values.items():
        if value is None:
            continue
        argv.append(f"--{name.replace('_', '-')}")
        argv += [str(v) for v in value] if isinstance(value, list) else [str(value)]
    return argv
