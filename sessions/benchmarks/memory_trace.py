"""The deployed ASGI application under ``tracemalloc``, for ``soak --trace-memory DIR``: what in the
web process's Python heap grows over a long run.

On the first ASGI call tracemalloc starts (``NFRAMES`` frames per allocation) and a task on the
loop writes a snapshot to ``$BENCH_TRACEMALLOC_DIR/snapshot-<seconds since start>.pickle`` every
``EVERY_S`` (``Snapshot.dump``), beside the process's RSS at that moment in ``rss.jsonl``.
``scripts/memory_trace_diff.py`` compares two of them by traceback. After each, glibc's
``malloc_trim(0)`` and the RSS again (``rss_after_trim_mb``). tracemalloc sees Python's own
allocations only: what RSS gains beyond them is C libraries' memory or the allocator's fragmentation.
Tracing slows the process (every allocation records its traceback): figures of such a run are not
the platform's. Only the benchmark's uvicorn imports this module.
"""

from __future__ import annotations

import asyncio
import ctypes
import ctypes.util
import json
import os
import time
import tracemalloc
from pathlib import Path

import psutil

from controlplane.asgi import application as deployed

__all__ = ["application"]

NFRAMES = 12
try:
    _LIBC = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    _LIBC.malloc_trim  # noqa: B018 — glibc only
except (OSError, AttributeError):
    _LIBC = None
EVERY_S = 60.0
_writer: asyncio.Task | None = None


async def _snapshots(folder: Path) -> None:
    began, process = time.monotonic(), psutil.Process()
    while True:
        await asyncio.sleep(EVERY_S)
        at = round(time.monotonic() - began)
        snapshot = tracemalloc.take_snapshot()
        # Dumping a snapshot takes a while: off the loop, as the sockets keep being served.
        await asyncio.to_thread(snapshot.dump, str(folder / f"snapshot-{at:05d}.pickle"))
        traced, _peak = tracemalloc.get_traced_memory()
        rss = process.memory_info().rss
        # glibc's malloc_trim returns the free memory its heaps hold to the system: the RSS it gives
        # back is memory freed but kept by the allocator (fragmentation, idle arenas), not live data.
        trimmed = _LIBC.malloc_trim(0) if _LIBC is not None else None
        line = {
            "at_s": at,
            "rss_mb": rss / 2**20,
            "rss_after_trim_mb": process.memory_info().rss / 2**20 if trimmed is not None else None,
            "traced_mb": traced / 2**20,
        }
        with (folder / "rss.jsonl").open("a", encoding="utf-8") as out:
            out.write(json.dumps(line) + "\n")


async def application(scope, receive, send):
    global _writer
    folder = os.environ.get("BENCH_TRACEMALLOC_DIR")
    if _writer is None and folder:
        tracemalloc.start(NFRAMES)
        _writer = asyncio.get_running_loop().create_task(_snapshots(Path(folder)))
    await deployed(scope, receive, send)
