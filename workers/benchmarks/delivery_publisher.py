"""The publisher's side of ``bench_delivery``, in its own process
(``python -m workers.benchmarks.delivery_publisher``).

Publishes chunks exactly as ``workers.daemon.publisher.ChunkPublisher`` does — header with
``generated_at = time.time()``, the delivered-index write to Redis, then ``group_send`` of
``session.chunk`` through the configured channel layer, its payload (real JPEG frames or one H.264
fragment of ``--content``, a panned photograph by default) beside the message when large, as the
worker sends it — one chunk per session
every ``--period`` seconds, sessions' phases spread evenly over the period. It is the worker's side,
so it lives with the workers (and, given ``--worker-id``, appends each chunk's record to the record
stream before the send, as the worker's publisher does).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import time
from pathlib import Path
from typing import Any

import numpy as np

from contracts.bench import summarize
from contracts.wire.frames import PAYLOAD_TTL_S, chunk_message, chunk_message_offloaded, group_name
from contracts.wire.records import chunk_record_append
from workers.benchmarks.content import CONTENTS, content_frames, noise_frames
from workers.runtime.encoding import encode_chunk, encode_jpeg_frames

# --- frames ------------------------------------------------------------------------------------

CHUNK_VARIANTS = 4  # distinct chunks per run, sent in turn (encoded once, before the schedule starts)


def jpeg_frames(width: int, height: int, count: int, *, seed: int = 0, quality: int = 85) -> list[bytes]:
    """``count`` real JPEG frames of ``width``×``height`` (smooth noise, like a generated frame's texture)."""
    return encode_jpeg_frames(noise_frames(width, height, count, seed=seed), quality).frames


def chunk_variants(
    content: str, codec: str, width: int, height: int, frames_per_chunk: int, fps: float = 16.0
) -> list[tuple[list[bytes], dict[str, Any] | None]]:
    """``CHUNK_VARIANTS`` chunks of ``content`` (``workers.benchmarks.content``: ``photo`` is a
    pan over a photograph, consecutive chunks continuing it) as the worker encodes them for viewers
    of ``codec`` (``encode_chunk``: JPEG frames, or one closed-GOP H.264 fragment and no JPEG):
    ``(frames, media)`` per chunk, as ``chunk_message`` takes them."""
    if content == "noise":  # new noise every chunk (seeded), as before there was a photograph
        clips = [noise_frames(width, height, frames_per_chunk, seed=seed) for seed in range(CHUNK_VARIANTS)]
    else:
        frames = content_frames(content, width, height, CHUNK_VARIANTS * frames_per_chunk)
        clips = [frames[k * frames_per_chunk : (k + 1) * frames_per_chunk] for k in range(CHUNK_VARIANTS)]
    variants = []
    for index, clip in enumerate(clips):
        encoded = encode_chunk(
            np.ascontiguousarray(clip), codecs=frozenset({codec}), fps=fps, chunk_index=index
        )
        media = None
        if encoded.fragment is not None:
            media = {
                "init": encoded.fragment.init,
                "fragment": encoded.fragment.data,
                "mime": encoded.fragment.mime,
                "encoder": encoded.fragment.encoder,
                "placed": encoded.fragment,  # not sent: what the fragment is re-placed from per index
            }
        variants.append((encoded.frames, media))
    return variants


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
    codec: str = "jpeg",
    content: str = "photo",
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
    from contracts import tracing
    from contracts.wire.channel import delivered_key
    from controlplane.tracing import tracing_configure

    # Traced as the worker is when the environment turns it on (bench_delivery --tracing on).
    tracing_configure("worker")

    client = redis.Redis.from_url(settings.REDIS_URL)

    def store_payloads(payloads: dict[str, bytes]) -> None:
        pipe = client.pipeline(transaction=False)
        for key, blob in payloads.items():
            pipe.set(key, blob, ex=PAYLOAD_TTL_S)
        pipe.execute()

    record = worker_id is not None
    layer = get_channel_layer()
    loop = asyncio.new_event_loop()
    # The presets play a chunk in one period (tiny: 4 frames at 8 fps every 0.5 s; 832×480: 12 at 16
    # every 0.75 s): the frame rate the header says and the fragments are stamped with.
    fps = frames_per_chunk / period_s
    variants = chunk_variants(content, codec, width, height, frames_per_chunk, fps)
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
            "fps": fps,
            "frames_per_chunk": frames_per_chunk,
            "mime": "image/jpeg",
            "generated_at": time.time(),
        }
        late_ms.append(max(0.0, header["generated_at"] - due) * 1000.0)
        client.set(delivered_key(sid), index, ex=3600)
        if record:
            chunk_record_append(client, header)
        frames, media = variants[index % len(variants)]
        if media is not None:
            # Chunk k re-sends variant k mod 4: moved to k's place on the timeline, as the worker
            # places each fragment, so a player (bench_glass's browser) presents it as chunk k.
            from workers.runtime.media import fragment_placed

            placed = fragment_placed(media["placed"], chunk_index=index, fps=fps)
            media = {key: value for key, value in media.items() if key != "placed"} | {"fragment": placed}
        if tracing.ON and tracing.chunk_sampled():  # as ChunkPublisher traces a chunk
            attributes = {"session.id": sid, "chunk.index": index, "worker.name": "bench-delivery"}
            with (
                tracing.span(tracing.CHUNK, attributes=attributes),
                tracing.span(tracing.CHUNK_PUBLISH, kind="producer"),
            ):
                message = chunk_message_offloaded(header, frames, media=media, store=store_payloads)
                message["traceparent"] = tracing.traceparent()
                loop.run_until_complete(layer.group_send(group_name(sid), message))
        else:
            # Large payloads beside the message, as the worker's publisher sends them (contracts.wire.frames).
            message = chunk_message_offloaded(header, frames, media=media, store=store_payloads)
            loop.run_until_complete(layer.group_send(group_name(sid), message))
        send_ms.append((time.time() - header["generated_at"]) * 1000.0)
    loop.close()
    client.delete(*[delivered_key(sid) for sid in session_ids])
    return {
        "published": len(schedule),
        "late_ms": summarize(late_ms),
        "publish_call_ms": summarize(send_ms),
        "content": content,
        "frame_bytes": [len(f) for f in variants[0][0]],
        "chunk_bytes": [
            sum(map(len, frames)) + (len(media["fragment"]) if media else 0) for frames, media in variants
        ],
        "fragment_bytes": len(variants[0][1]["fragment"]) if variants[0][1] else None,
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
    parser.add_argument("--content", choices=CONTENTS, default="photo")
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
        content=args.content,
    )
    tmp = Path(args.out + ".tmp")
    tmp.write_text(json.dumps(result))
    tmp.rename(args.out)  # the orchestrator waits for the file: it appears complete


if __name__ == "__main__":
    main()
