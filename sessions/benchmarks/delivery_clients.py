"""The clients' side of ``bench_delivery``, in its own process
(``python -m sessions.benchmarks.delivery_clients``), and the figures computed from what it received.

One asyncio process holds S WebSocket connections to the real ASGI server
(``/ws/sessions/<id>/?token=``); for every chunk frame it stamps the wall-clock receive time before
anything else and records ``receive − generated_at`` (the added delay), the server's own
``delivery_ms`` (from ``generated_at`` to the consumer's send), index gaps and ``skipped`` notices.
The publisher (``workers.benchmarks.delivery_publisher``) runs in another process, so its CPU is
not the clients' (and neither is the server's). Nothing here imports Django.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from pathlib import Path
from typing import Any

import websockets

from contracts.bench import summarize
from contracts.wire.frames import decode_chunk_frame

# --- clients -----------------------------------------------------------------------------------


async def _client(
    url: str,
    session_id: str,
    expected: int,
    record: dict[str, Any],
    gate: asyncio.Semaphore,
    on_connected,
    done: asyncio.Event,
) -> None:
    async with gate:  # open sockets a few at a time, as users arrive (each connect reads the DB)
        ws = await websockets.connect(url, max_size=None, ping_interval=None, compression=None)
        first = await ws.recv()  # the status message the consumer sends on connect
    try:
        if isinstance(first, bytes) or json.loads(first).get("type") != "status":
            raise RuntimeError(f"session {session_id}: expected a status message first, got {first!r:.200}")
        on_connected()
        while len(record["chunks"]) + len(record["skipped"]) < expected and not done.is_set():
            message = await ws.recv()
            received = time.time()  # stamped before anything else touches the message
            if isinstance(message, bytes):
                header, frames = decode_chunk_frame(message)
                record["chunks"].append(
                    (
                        int(header["index"]),
                        (received - header["generated_at"]) * 1000.0,
                        header.get("delivery_ms"),
                        sum(len(f) for f in frames),
                    )
                )
            else:
                text = json.loads(message)
                if text.get("type") == "skipped":
                    record["skipped"].append(int(text["index"]))
    finally:
        await ws.close()


async def run_clients(
    *,
    base_url: str,
    token: str,
    session_ids: list[str],
    expected: int,
    ready_file: Path,
    timeout_s: float,
    connect_concurrency: int = 16,
    codec: str = "jpeg",
) -> dict[str, Any]:
    records = {sid: {"chunks": [], "skipped": []} for sid in session_ids}
    ready, done = asyncio.Event(), asyncio.Event()
    connected = [0]
    gate = asyncio.Semaphore(connect_concurrency)

    def on_connected() -> None:
        connected[0] += 1
        if connected[0] == len(session_ids):
            ready.set()

    tasks = [
        asyncio.create_task(
            _client(
                f"{base_url}/ws/sessions/{sid}/?token={token}&codec={codec}",
                sid,
                expected,
                records[sid],
                gate,
                on_connected,
                done,
            )
        )
        for sid in session_ids
    ]
    waiter = asyncio.create_task(ready.wait())
    finished, _ = await asyncio.wait([waiter, *tasks], return_when=asyncio.FIRST_COMPLETED, timeout=60)
    if not ready.is_set():
        for task in finished:
            if task is not waiter and task.exception() is not None:
                raise task.exception()
        raise TimeoutError(f"only {connected[0]} of {len(session_ids)} sockets connected in 60 s")
    ready_file.write_text("ready")
    _, pending = await asyncio.wait(tasks, timeout=timeout_s)
    done.set()
    for task in pending:
        task.cancel()
    errors = [repr(t.exception()) for t in tasks if t.done() and not t.cancelled() and t.exception()]
    return {
        "sessions": records,
        "errors": errors[:5],
        "unfinished": len(pending),
        "cpu_s": time.process_time(),
    }


# --- analysis ----------------------------------------------------------------------------------


def delivery_figures(client_result: dict[str, Any], *, chunks: int, warmup: int) -> dict[str, Any]:
    """Added-delay percentiles (after ``warmup`` chunks per stream), lost and skipped chunk counts."""
    added, server, socket_side, lost, skipped, received, payload = [], [], [], 0, 0, 0, []
    for record in client_result["sessions"].values():
        indices = {index for index, *_ in record["chunks"]}
        received += len(record["chunks"])
        skipped += len(record["skipped"])
        lost += len(set(range(chunks)) - indices - set(record["skipped"]))
        for index, delay_ms, server_ms, size in record["chunks"]:
            if index < warmup:
                continue
            added.append(delay_ms)
            payload.append(size)
            if server_ms is not None:
                server.append(server_ms)
                socket_side.append(delay_ms - server_ms)
    return {
        "received": received,
        "expected": chunks * len(client_result["sessions"]),
        "lost": lost,
        "skipped": skipped,
        "added_delay_ms": summarize(added),
        "within_10ms": round(sum(1 for d in added if d <= 10.0) / len(added), 4) if added else None,
        "server_delivery_ms": summarize(server),
        "socket_to_client_ms": summarize(socket_side),
        "chunk_bytes_mean": round(sum(payload) / len(payload), 1) if payload else None,
        "client_errors": client_result["errors"],
        "clients_cpu_s": round(client_result.get("cpu_s", 0.0), 3),
    }


# --- entry point -------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m sessions.benchmarks.delivery_clients")
    parser.add_argument("--sessions-file", required=True, help="JSON list of session ids")
    parser.add_argument("--out", required=True)
    parser.add_argument("--chunks", type=int, required=True)
    parser.add_argument("--base-url", required=True)
    parser.add_argument("--token", required=True)
    parser.add_argument("--ready-file", required=True)
    parser.add_argument("--timeout", type=float, default=120.0)
    parser.add_argument("--codec", choices=("jpeg", "h264"), default="jpeg")
    args = parser.parse_args(argv)
    result = asyncio.run(
        run_clients(
            base_url=args.base_url,
            token=args.token,
            session_ids=json.loads(Path(args.sessions_file).read_text()),
            expected=args.chunks,
            ready_file=Path(args.ready_file),
            timeout_s=args.timeout,
            codec=args.codec,
        )
    )
    tmp = Path(args.out + ".tmp")
    tmp.write_text(json.dumps(result))
    tmp.rename(args.out)  # the orchestrator waits for the file: it appears complete


if __name__ == "__main__":
    main()
