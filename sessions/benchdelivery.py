"""The two sides of ``bench_delivery`` that run in their own processes (``python -m sessions.benchdelivery``).

- ``clients``: one asyncio process holding S WebSocket connections to the real ASGI server
  (``/ws/sessions/<id>/?token=``); for every chunk frame it stamps the wall-clock receive time
  before anything else and records ``receive − generated_at`` (the added delay), the server's own
  ``delivery_ms`` (from ``generated_at`` to the consumer's send), index gaps and ``skipped`` notices.
- ``publisher``: publishes chunks exactly as ``workers.daemon.ChunkPublisher`` does — header with
  ``generated_at = time.time()``, the delivered-index write to Redis, then ``group_send`` of
  ``session.chunk`` with real JPEG frames through the configured channel layer — one chunk per
  session every ``--period`` seconds, sessions' phases spread evenly over the period.

The two run in separate processes so the publisher's CPU is not the clients' (and neither is the
server's). Apart from the publisher (which needs the configured channel layer and so sets Django
up in its own process), nothing here imports Django.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from pathlib import Path
from typing import Any

from workers.benchlive import jpeg_frames, summarize
from workers.streaming import CHUNK_MESSAGE, chunk_message, decode_chunk_frame, group_name

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
    import websockets

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
                f"{base_url}/ws/sessions/{sid}/?token={token}",
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


# --- publisher ---------------------------------------------------------------------------------


def run_publisher(
    *,
    session_ids: list[str],
    chunks: int,
    period_s: float,
    start_at: float,
    width: int,
    height: int,
    frames_per_chunk: int,
    worker_id: int | None = None,
    phase: float = 0.0,
) -> dict[str, Any]:
    """ChunkPublisher's per-chunk work, on the preset's real-time schedule; returns lateness figures."""
    import os

    import django

    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "controlplane.settings")
    django.setup()
    import redis
    from channels.layers import get_channel_layer
    from django.conf import settings

    from workers.channel import delivered_key
    from workers.reporting import DjangoReporter

    client = redis.Redis.from_url(settings.REDIS_URL)
    # The worker's real reporter: chunk records written in batches (COPY) beside the publishing,
    # so the consumers' delivery-latency UPDATEs find their rows as they do in production.
    reporter = DjangoReporter(worker_id, "bench-delivery") if worker_id is not None else None
    layer = get_channel_layer()
    loop = asyncio.new_event_loop()
    variants = [jpeg_frames(width, height, frames_per_chunk, seed=seed) for seed in range(4)]
    # Warm up (connections, Lua script load) before the schedule starts, as a running worker would be.
    client.ping()
    loop.run_until_complete(layer.group_send(group_name("bench-warmup"), chunk_message({}, [])))
    start_at = max(start_at, time.time() + 0.2)
    # Due times: session i's chunk k at start_at + (i / S + k) * period.
    schedule = sorted(
        (start_at + ((i + phase) / len(session_ids) + k) * period_s, k, sid)
        for k in range(chunks)
        for i, sid in enumerate(session_ids)
    )
    late_ms, send_ms = [], []
    for due, index, sid in schedule:
        wait = due - time.time()
        if wait > 0:
            time.sleep(wait)
        header = {
            "session": sid,
            "index": index,
            "epoch": 1,
            "generation_ms": 0.0,
            "worker": "bench-delivery",
            "batch_size": 1,
            "width": width,
            "height": height,
            "fps": 8,
            "mime": "image/jpeg",
            "generated_at": time.time(),
        }
        late_ms.append(max(0.0, header["generated_at"] - due) * 1000.0)
        client.set(delivered_key(sid), index, ex=3600)
        loop.run_until_complete(
            layer.group_send(group_name(sid), chunk_message(header, variants[index % len(variants)]))
        )
        send_ms.append((time.time() - header["generated_at"]) * 1000.0)
        if reporter is not None:
            reporter.chunk(
                {
                    "session_id": sid,
                    "chunk_index": index,
                    "batch_size": 1,
                    "generation_ms": 0.0,
                    "created_at": header["generated_at"],
                }
            )
    loop.close()
    if reporter is not None:
        reporter.close()
    client.delete(*[delivered_key(sid) for sid in session_ids])
    return {
        "published": len(schedule),
        "late_ms": summarize(late_ms),
        "publish_call_ms": summarize(send_ms),
        "frame_bytes": [len(f) for f in variants[0]],
        "cpu_s": round(time.process_time(), 3),
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
    parser = argparse.ArgumentParser(prog="python -m sessions.benchdelivery")
    parser.add_argument("role", choices=("clients", "publisher"))
    parser.add_argument("--sessions-file", required=True, help="JSON list of session ids")
    parser.add_argument("--out", required=True)
    parser.add_argument("--chunks", type=int, required=True)
    parser.add_argument("--base-url", default="")
    parser.add_argument("--token", default="")
    parser.add_argument("--ready-file", default="")
    parser.add_argument("--timeout", type=float, default=120.0)
    parser.add_argument("--period", type=float, default=0.5)
    parser.add_argument("--start-at", type=float, default=0.0)
    parser.add_argument("--width", type=int, default=64)
    parser.add_argument("--height", type=int, default=64)
    parser.add_argument("--frames", type=int, default=4)
    parser.add_argument("--phase", type=float, default=0.0, help="offset of this publisher's phases (slots)")
    parser.add_argument("--worker-id", type=int, default=None, help="write chunk records as this worker")
    args = parser.parse_args(argv)
    session_ids = json.loads(Path(args.sessions_file).read_text())
    if args.role == "clients":
        result = asyncio.run(
            run_clients(
                base_url=args.base_url,
                token=args.token,
                session_ids=session_ids,
                expected=args.chunks,
                ready_file=Path(args.ready_file),
                timeout_s=args.timeout,
            )
        )
    else:
        result = run_publisher(
            session_ids=session_ids,
            chunks=args.chunks,
            period_s=args.period,
            start_at=args.start_at,
            width=args.width,
            height=args.height,
            frames_per_chunk=args.frames,
            worker_id=args.worker_id,
            phase=args.phase,
        )
    tmp = Path(args.out + ".tmp")
    tmp.write_text(json.dumps(result))
    tmp.rename(args.out)


if __name__ == "__main__":
    main()


# --- the consumer fix the benchmark compares (``--asgi-app sessions.benchdelivery:dispatch_fixed_application``) --


def __getattr__(name: str) -> Any:
    """``dispatch_fixed_application``: the deployed ASGI app with ``SessionConsumer.dispatch`` handling
    ``session.chunk`` directly. Channels' ``AsyncConsumer.dispatch`` awaits ``aclose_old_connections()``
    (``close_old_connections`` through ``sync_to_async`` on the process's single thread-sensitive
    executor) before *every* handler, so each chunk queues behind the consumers' database work; the
    chunk handler touches no database. Built lazily so importing this module never sets Django up."""
    if name != "dispatch_fixed_application":
        raise AttributeError(name)
    from controlplane.asgi import application
    from sessions.consumers import SessionConsumer

    deployed = SessionConsumer.dispatch

    async def dispatch(self, message: dict) -> None:
        if message.get("type") == CHUNK_MESSAGE:
            await self.session_chunk(message)
            return
        await deployed(self, message)

    SessionConsumer.dispatch = dispatch
    return application
