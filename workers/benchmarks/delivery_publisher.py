"""The publisher's side of ``bench_delivery``, in its own process
(``python -m workers.benchmarks.delivery_publisher``).

Publishes chunks exactly as ``workers.daemon.publisher.ChunkPublisher`` does — header with
``generated_at = time.time()``, the delivered-index write to Redis, then ``group_send`` of
``session.chunk`` with real JPEG frames through the configured channel layer — one chunk per session
every ``--period`` seconds, sessions' phases spread evenly over the period. It is the worker's side,
so it lives with the workers (and, given ``--worker-id``, appends each chunk's record to the record
stream before the send, as the worker's publisher does).
"""

from __future__ import annotations

import argparse
import asyncio
import io
import json
import os
import time
from pathlib import Path
from typing import Any

import numpy as np
from PIL import Image

from contracts.bench import summarize
from contracts.wire.frames import chunk_message, group_name
from contracts.wire.records import chunk_record_append

# --- frames ------------------------------------------------------------------------------------


def jpeg_frames(width: int, height: int, count: int, *, seed: int = 0, quality: int = 85) -> list[bytes]:
    """``count`` real JPEG frames of ``width``×``height`` (smooth noise, like a generated frame's texture)."""
    rng = np.random.default_rng(seed)
    frames = []
    for _ in range(count):
        coarse = rng.integers(0, 256, size=(max(height // 4, 1), max(width // 4, 1), 3), dtype=np.uint8)
        image = Image.fromarray(coarse, mode="RGB").resize((width, height), Image.BILINEAR)
        fine = np.asarray(image, dtype=np.int16) + rng.integers(-28, 29, size=(height, width, 3))
        buffer = io.BytesIO()
        Image.fromarray(fine.clip(0, 255).astype(np.uint8), mode="RGB").save(
            buffer, format="JPEG", quality=quality
        )
        frames.append(buffer.getvalue())
    return frames


# --- publisher ---------------------------------------------------------------------------------


def h264_media(width: int, height: int, count: int, *, seed: int = 0) -> dict[str, Any]:
    """The same smooth-noise frames as one chunk's H.264 fragment (``chunk_message``'s ``media``),
    encoded as the worker encodes a chunk (``workers.runtime.media.FragmentEncoder``)."""
    # PyAV loads only for an H.264 run: a JPEG run's publisher process stays as light as before.
    from workers.runtime.media import FragmentEncoder

    decoded = [Image.open(io.BytesIO(f)).convert("RGB") for f in jpeg_frames(width, height, count, seed=seed)]
    frames = np.stack([np.asarray(image) for image in decoded])
    fragment = FragmentEncoder().encode(frames, fps=16, chunk_index=0)
    return {
        "init": fragment.init,
        "fragment": fragment.data,
        "mime": fragment.mime,
        "encoder": fragment.encoder,
    }


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
    codec: str = "jpeg",
) -> dict[str, Any]:
    """ChunkPublisher's per-chunk work, on the preset's real-time schedule; returns lateness figures."""
    # Django is loaded and set up here, when the publisher's process starts: the channel layer
    # needs the configured settings and the app registry.
    import django
    import redis
    from channels.layers import get_channel_layer
    from django.conf import settings

    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "controlplane.settings")
    django.setup()
    # The worker's own channel key needs the app registry set up just above.
    from contracts.wire.channel import delivered_key

    client = redis.Redis.from_url(settings.REDIS_URL)
    record = worker_id is not None
    layer = get_channel_layer()
    loop = asyncio.new_event_loop()
    if codec == "h264":  # what the worker publishes when every viewer reads H.264: no JPEG frames
        variants = [[] for _ in range(4)]
        media = [h264_media(width, height, frames_per_chunk, seed=seed) for seed in range(4)]
    else:
        variants = [jpeg_frames(width, height, frames_per_chunk, seed=seed) for seed in range(4)]
        media = [None] * 4
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
        if record:
            chunk_record_append(client, header)
        loop.run_until_complete(
            layer.group_send(
                group_name(sid),
                chunk_message(header, variants[index % len(variants)], media=media[index % len(media)]),
            )
        )
        send_ms.append((time.time() - header["generated_at"]) * 1000.0)
    loop.close()
    client.delete(*[delivered_key(sid) for sid in session_ids])
    return {
        "published": len(schedule),
        "late_ms": summarize(late_ms),
        "publish_call_ms": summarize(send_ms),
        "frame_bytes": [len(f) for f in variants[0]],
        "fragment_bytes": len(media[0]["fragment"]) if media[0] else None,
        "cpu_s": round(time.process_time(), 3),
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m workers.benchmarks.delivery_publisher")
    parser.add_argument("--sessions-file", required=True, help="JSON list of session ids")
    parser.add_argument("--out", required=True)
    parser.add_argument("--chunks", type=int, required=True)
    parser.add_argument("--period", type=float, default=0.5)
    parser.add_argument("--start-at", type=float, default=0.0)
    parser.add_argument("--width", type=int, default=64)
    parser.add_argument("--height", type=int, default=64)
    parser.add_argument("--frames", type=int, default=4)
    parser.add_argument("--codec", choices=("jpeg", "h264"), default="jpeg")
    parser.add_argument("--phase", type=float, default=0.0, help="offset of this publisher's phases (slots)")
    parser.add_argument("--worker-id", type=int, default=None, help="append chunk records (as a worker does)")
    args = parser.parse_args(argv)
    result = run_publisher(
        session_ids=json.loads(Path(args.sessions_file).read_text()),
        chunks=args.chunks,
        period_s=args.period,
        start_at=args.start_at,
        width=args.width,
        height=args.height,
        frames_per_chunk=args.frames,
        worker_id=args.worker_id,
        phase=args.phase,
        codec=args.codec,
    )
    tmp = Path(args.out + ".tmp")
    tmp.write_text(json.dumps(result))
    tmp.rename(args.out)  # the orchestrator waits for the file: it appears complete


if __name__ == "__main__":
    main()
