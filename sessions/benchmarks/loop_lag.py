"""The deployed ASGI application with a probe of its event loop's lag, for ``bench_delivery
--webrtc-viewers`` (``--asgi-app sessions.benchmarks.loop_lag:application``).

The probe is a task on uvicorn's loop that asks to sleep ``PROBE_INTERVAL_S`` again and again; how
much later than asked it wakes is the loop's lag at that moment: how long any ready callback there (a
socket's chunk, a status frame, an RTP packet) waited behind the work in front of it. Samples (wall
clock, lag in ms) go to the file named by ``BENCH_LOOP_LAG_FILE`` as JSON lines, flushed every
``FLUSH_S``; the benchmark keeps those inside each run's measured window. The probe starts on the
first ASGI call (uvicorn's lifespan startup), when the loop is running.

Only the benchmark's uvicorn imports this module.
"""

from __future__ import annotations

import asyncio
import json
import os
import time

from controlplane.asgi import application as deployed

__all__ = ["application"]

PROBE_INTERVAL_S = 0.01
FLUSH_S = 0.5
_probe: asyncio.Task | None = None


async def _measure_lag(path: str) -> None:
    # time.perf_counter, not loop.time(): uvloop's clock (libuv's) counts whole milliseconds.
    samples: list[tuple[float, float]] = []
    flushed = time.perf_counter()
    with open(path, "a", encoding="utf-8") as out:
        while True:
            asked = time.perf_counter()
            await asyncio.sleep(PROBE_INTERVAL_S)
            woke = time.perf_counter()
            samples.append(
                (round(time.time(), 4), round(max(0.0, woke - asked - PROBE_INTERVAL_S) * 1000.0, 3))
            )
            if woke - flushed >= FLUSH_S:
                out.write(json.dumps(samples) + "\n")
                out.flush()
                samples.clear()
                flushed = woke


async def application(scope, receive, send):
    global _probe
    path = os.environ.get("BENCH_LOOP_LAG_FILE")
    if _probe is None and path:
        _probe = asyncio.get_running_loop().create_task(_measure_lag(path))
    await deployed(scope, receive, send)
