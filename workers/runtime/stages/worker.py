"""A stage worker process: hosts a role's stages and relays the message stream between links.

    python -m workers.runtime.stages.worker --preset tiny --role D --store HOST:PORT \
        --upstream enc-d0 --downstream d0-dec [--device cpu] [--max-in-flight-mb 256]

A preset served from a local checkpoint directory (a Wan preset, ``MODEL_PATHS``) is registered in
the worker's own process first: ``--model-path DIR`` names its directory.

``--upstream`` names the link it receives from, ``--downstream`` one or more links it sends to, each
``LINK`` or ``ROUTE=LINK``: a worker with several downstream links (a shared encoder serving several
diffusion workers) sends a session's messages down the link its ``open`` message names in
``meta["route"]`` (a worker with one downstream link ignores the route); a step's sessions must
share one route. ``stop`` goes down every link.

`StageWorker.step()` does one bounded unit of work (one message in, its results out) and says
whether the stream goes on, so tests and embedders drive it step by step; a ``stop`` message ends
it (a stage worker holds no durable state: SIGTERM's default, exiting at once, loses nothing). A
message the worker cannot act on (`StageProtocolError`: unknown session, missing embeddings, a
chunk already generated) is answered with an ``error`` message passed on to the driver, and the
worker goes on. Links are opened upstream first, then downstream, so a chain of workers whose ends
are both held by one driver cannot deadlock while building its pair groups.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

import torch

from contracts.catalog.local_paths import ModelLayoutError, register_model_path
from workers.runtime.stages.contract import RoleError, build_staged, parse_role, role_name
from workers.runtime.stages.link import (
    DEFAULT_MAX_IN_FLIGHT_BYTES,
    DEFAULT_TIMEOUT_S,
    LinkReceiver,
    LinkSender,
    connect_store,
    open_pair,
    resolve_device,
)
from workers.runtime.stages.pipeline import StageMessage, StageProtocolError, StageRunner
from workers.runtime.transport.pair import SOURCE_RANK, TARGET_RANK


class StageWorker:
    def __init__(
        self, runner: StageRunner, upstream: LinkReceiver, downstream: dict[str, LinkSender]
    ) -> None:
        if not downstream:
            raise ValueError("a stage worker needs at least one downstream link")
        self.runner = runner
        self.upstream = upstream
        self.downstream = downstream
        self._routes: dict[str, str] = {}

    def step(self) -> bool:
        """Take one message from upstream, act on it, pass the results on; False once stopped."""
        message = self.upstream.recv()
        try:
            self._relay(message)
        except StageProtocolError as exc:
            # Answered, not fatal: the driver learns why and the other sessions keep streaming.
            error = self._error(message, exc)
            self.downstream[self._route_of(error)].send(error)
        if message.kind == "close":
            self._routes.pop(str(message.meta["session"]), None)
        if message.kind == "stop":
            for sender in self.downstream.values():
                sender.flush()
            return False
        return True

    def _relay(self, message: StageMessage) -> None:
        if message.kind in ("open", "job"):
            self._routes[_subjects(message.meta)[0]] = self._route_name(message.meta.get("route"))
        for out in self.runner.handle(message):
            if out.kind == "stop":
                for sender in self.downstream.values():
                    sender.send(out)
            else:
                self.downstream[self._route_of(out)].send(out)

    def run(self) -> None:
        while self.step():
            pass

    def close(self) -> None:
        self.upstream.close()
        for sender in self.downstream.values():
            sender.close()

    def _error(self, message: StageMessage, exc: StageProtocolError) -> StageMessage:
        meta = {"worker": role_name(self.runner.stages), "error": str(exc), "message": message.kind}
        return StageMessage("error", {**meta, "meta": message.meta})

    def _route_name(self, route: Any) -> str:
        if len(self.downstream) == 1:
            return next(iter(self.downstream))
        if route is None:
            raise StageProtocolError(f"open names no route; this worker has routes {sorted(self.downstream)}")
        if str(route) not in self.downstream:
            raise StageProtocolError(f"unknown route {route!r}; this worker has {sorted(self.downstream)}")
        return str(route)

    def _route_of(self, message: StageMessage) -> str:
        if len(self.downstream) == 1:
            return next(iter(self.downstream))
        if message.kind == "error":
            # The route of the session it concerns when known, else the first link.
            return self._routes.get(_subjects(message.meta["meta"])[0], next(iter(self.downstream)))
        sessions = _subjects(message.meta)
        routes = {self._routes.get(s) for s in sessions}
        if None in routes:
            raise StageProtocolError(
                f"{message.kind} names session(s) {sessions} never opened on this worker"
            )
        if len(routes) != 1:
            raise StageProtocolError(f"a {message.kind} spans sessions on different routes: {sorted(routes)}")
        return routes.pop()  # type: ignore[return-value]


def _subjects(meta: dict[str, Any]) -> list[str]:
    """The sessions (names) or one-shot jobs (``job:ID``) a message is about, for routing."""
    if "jobs" in meta or "job" in meta:
        return [f"job:{job}" for job in meta.get("jobs") or [meta.get("job")]]
    return [str(name) for name in meta.get("sessions") or [meta.get("session")]]


def parse_downstream(values: list[str]) -> dict[str, str]:
    """``["LINK"]`` or ``["ROUTE=LINK", ...]`` → {route: link}."""
    links: dict[str, str] = {}
    for value in values:
        route, sep, link = value.rpartition("=")
        route = route if sep else link
        if not link or route in links:
            raise ValueError(f"--downstream {value!r}: expected LINK or ROUTE=LINK with unique routes")
        links[route] = link
    return links


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", required=True)
    parser.add_argument("--role", required=True, help="stages hosted: EDC, ED, DC, E, D or C")
    parser.add_argument("--store", required=True, help="rendezvous TCPStore host:port")
    parser.add_argument("--upstream", required=True, help="link to receive from")
    parser.add_argument("--downstream", required=True, nargs="+", help="LINK or ROUTE=LINK (repeatable)")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--model-path", help="checkpoint directory of --preset (a MODEL_PATHS preset)")
    parser.add_argument("--max-in-flight-mb", type=float, default=DEFAULT_MAX_IN_FLIGHT_BYTES / 2**20)
    parser.add_argument("--timeout-s", type=float, default=DEFAULT_TIMEOUT_S)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args(argv)
    try:
        stages = parse_role(args.role)
        downstream = parse_downstream(args.downstream)
    except (RoleError, ValueError) as exc:
        parser.error(f"--role/--downstream: {exc}")
    if args.max_in_flight_mb <= 0:
        parser.error("--max-in-flight-mb must be positive")
    if args.model_path is not None:
        try:
            register_model_path(args.preset, args.model_path)
        except (ModelLayoutError, ValueError) as exc:
            parser.error(f"--model-path: {exc}")
    torch.set_num_threads(args.threads)
    device = resolve_device(args.device)
    staged = build_staged(args.preset, "".join(s.value for s in stages), device=device)
    store = connect_store(args.store, timeout_s=args.timeout_s)
    upstream = LinkReceiver(
        open_pair(store, args.upstream, TARGET_RANK, device=device, timeout_s=args.timeout_s),
        timeout_s=args.timeout_s,
    )
    senders = {
        route: LinkSender(
            open_pair(store, link, SOURCE_RANK, device=device, timeout_s=args.timeout_s),
            max_in_flight_bytes=int(args.max_in_flight_mb * 2**20),
            timeout_s=args.timeout_s,
        )
        for route, link in downstream.items()
    }
    worker = StageWorker(StageRunner(staged), upstream, senders)
    try:
        worker.run()
    finally:
        worker.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
