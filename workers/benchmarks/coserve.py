"""One-shot jobs beside live streams on a real worker process (``manage.py bench_coserve_live``;
docs/jobs.md "Jobs beside streams", issue 32).

For each stream count N, one worker process (the `WorkerDaemon` run loop, commanded through its Redis
command stream, reporting through a queue) first runs one unmeasured job of each kind in the mix
(set-up costs paid once per process), then serves N streams started a chunk / N apart (the
staggered phases of a live worker). After a warm-up the streams run alone for ``seconds``, then the
job mix runs beside them, one job after another: for each job its completion time (``job_run`` sent
→ ``job_completed`` received) against its compute time (``run_s``: the seconds of its denoising
steps), and for both phases the streams' chunks, read from the chunk-record stream:

- ``late_ms``: how long after it is due to play a chunk was generated, ``max(0, generated_at −
  (generated_at of chunk 0 + index × chunk period))`` (a chunk later than that stalls its viewer);
- ``lead_ms``: how long before it is due to play it was generated: the viewer's buffer (jobs take
  part of the look-ahead, ``workers.daemon.streams.Streams.job_reserve_chunks``);
- ``busy``: the device's busy fraction, chunk generation plus job steps over the phase's wall time.

Everything here measures; nothing asserts.
"""

from __future__ import annotations

import json
import math
import multiprocessing as mp
import os
import queue
import time
import uuid
from collections import defaultdict
from typing import Any

import redis

from contracts.bench import summarize
from contracts.wire.channel import send_command, stream_key
from contracts.wire.records import STREAM as RECORDS

CONTEXT = mp.get_context("spawn")
DEFAULT_MIX = ("image:64x64:4", "video:128x128x16:4", "image:64x64:4", "video:128x128x16:8")


class _QueueReporter:
    """The worker's reports as (method, args, kwargs) on a queue (the ``workers.ports.Reporter`` seam)."""

    def __init__(self, reports: Any) -> None:
        self.reports = reports

    def answer(self, command: dict, status: str, reason: str = "", result: dict | None = None) -> None:
        self.reports.put(("answer", (command["id"], status, reason), {}))

    def __getattr__(self, method: str) -> Any:
        if method.startswith("job_"):
            return lambda *args, **kwargs: self.reports.put(
                (method, args, {k: v for k, v in kwargs.items() if k != "content"})
            )
        return lambda *args, **kwargs: None  # heartbeats and the rest: not measured here

    def close(self) -> None:
        pass


def _worker_main(
    name: str, redis_url: str, preset: str, capacity: int, reports: Any, starved_after_chunks: float | None
) -> None:
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "controlplane.settings")
    import django

    django.setup()  # the chunk publisher's channel layer reads the settings
    import torch

    # In the spawned worker process only, once Django is set up: the parent never loads torch.
    from workers.daemon import WorkerDaemon
    from workers.runtime.engine import ChunkEngine

    torch.set_num_threads(1)
    daemon = WorkerDaemon(
        name=name,
        engine=ChunkEngine.from_preset(preset, encode_workers=1),
        redis_client=redis.Redis.from_url(redis_url),
        reporter=_QueueReporter(reports),  # type: ignore[arg-type]
        capacity=capacity,
        heartbeat_s=3600.0,
        starved_after_chunks=starved_after_chunks,
    )
    reports.put(("ready", (daemon.streams.chunk_s,), {}))
    daemon.run()


def parse_job(spec: str) -> dict[str, Any]:
    """``KIND:WxH[xFRAMES]:STEPS`` → the job fields of a ``job_run``."""
    kind, size, steps = spec.split(":")
    parts = [int(p) for p in size.lower().split("x")]
    frames = parts[2] if len(parts) == 3 else 1
    if kind not in ("image", "video") or len(parts) not in (2, 3):
        raise ValueError(f"{spec!r} is not KIND:WxH[xFRAMES]:STEPS")
    return {"job_kind": kind, "width": parts[0], "height": parts[1], "frames": frames, "steps": int(steps)}


class _Worker:
    def __init__(
        self, redis_url: str, preset: str, capacity: int, starved_after_chunks: float | None
    ) -> None:
        self.name = f"coserve-{uuid.uuid4().hex[:8]}"
        self.client = redis.Redis.from_url(redis_url)
        self.reports = CONTEXT.Queue()
        self.process = CONTEXT.Process(
            target=_worker_main,
            args=(self.name, redis_url, preset, capacity, self.reports, starved_after_chunks),
            daemon=True,
        )
        self.process.start()
        self.chunk_s = float(self.expect("ready", timeout_s=120.0)[1][0])

    def expect(self, method: str, key: str | None = None, timeout_s: float = 120.0) -> tuple:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            try:
                report = self.reports.get(timeout=0.5)
            except queue.Empty:
                if not self.process.is_alive():
                    raise RuntimeError(f"worker {self.name} died") from None
                continue
            if report[0] == method and (key is None or report[1][0] == key):
                return report
            if report[0] == "job_failed" and report[1][0] == key:
                raise RuntimeError(f"job failed: {report[2].get('reason')}")
        raise TimeoutError(f"no {method} report from {self.name} in {timeout_s} s")

    def send(self, kind: str, **fields: Any) -> str:
        command_id = str(uuid.uuid4())
        send_command(self.client, self.name, {"id": command_id, "kind": kind, **fields})
        return command_id

    def chunks(self) -> dict[str, list[dict]]:
        rows: dict[str, list[dict]] = defaultdict(list)
        for _id, fields in self.client.xrange(RECORDS):
            row = json.loads(fields[b"row"])
            if row["worker"] == self.name and row.get("delivery_ms") is None:
                rows[row["session"]].append(row)
        return rows

    def stop(self) -> None:
        self.send("shutdown")
        self.process.join(20)
        if self.process.is_alive():
            self.process.kill()
        self.client.delete(stream_key(self.name))
        self.client.close()


def _stream_figures(
    rows: dict[str, list[dict]], chunk_s: float, since: float, until: float, jobs_run_s: float
) -> dict[str, Any]:
    late, lead, busy_s = [], [], 0.0
    for session_rows in rows.values():
        first = min(session_rows, key=lambda r: r["index"])
        for row in session_rows:
            if not since <= row["generated_at"] < until:
                continue
            due = first["generated_at"] + row["index"] * chunk_s
            late.append(max(0.0, row["generated_at"] - due) * 1000.0)
            lead.append(max(0.0, due - row["generated_at"]) * 1000.0)
    # One record per chunk, each with its batch's time: a batch of b counts 1/b of it per chunk.
    for session_rows in rows.values():
        busy_s += sum(
            r["generation_ms"] / 1000.0 / r["batch_size"]
            for r in session_rows
            if since <= r["generated_at"] < until
        )
    return {
        "chunks": len(late),
        "late_ms": summarize(late),
        "lead_ms": summarize(lead) | {"min": round(min(lead), 3) if lead else math.nan},
        "busy": round((busy_s + jobs_run_s) / max(1e-9, until - since), 3),
        "streams_busy": round(busy_s / max(1e-9, until - since), 3),
    }


def _warm_up_jobs(worker: _Worker, preset: str, mix: list[dict[str, Any]], timeout_s: float) -> None:
    """One job of each kind in the mix, before any stream and not measured: a worker's first image
    and first video pay once for what later ones do not (encoder and codec set-up: the first image
    of a fresh demo worker took 0.06 s against 0.02 s for the next), which would otherwise land on
    whichever run's first job it is."""
    for spec in {s["job_kind"]: s for s in reversed(mix)}.values():
        job = str(uuid.uuid4())
        fields = {"model": preset, "prompt": "warm-up", "seed": 0, "priority": 0}
        worker.send("job_run", job=job, epoch=1, deadline=time.time() + 600, **fields, **spec)
        worker.expect("job_completed", key=job, timeout_s=timeout_s)


def run_streams(
    redis_url: str,
    *,
    preset: str,
    streams: int,
    mix: list[dict[str, Any]],
    seconds: float,
    warmup_s: float,
    job_timeout_s: float = 60.0,
    starved_after_chunks: float | None = 4.0,
    warm_up_jobs: bool = True,
) -> dict[str, Any]:
    worker = _Worker(redis_url, preset, capacity=max(1, streams), starved_after_chunks=starved_after_chunks)
    try:
        if warm_up_jobs:
            _warm_up_jobs(worker, preset, mix, job_timeout_s)
        for seed in range(streams):
            worker.send("start", session=str(uuid.uuid4()), epoch=1, seed=seed, prompts=[[0, "a heron"]])
            time.sleep(worker.chunk_s / max(1, streams))  # staggered phases
        time.sleep(warmup_s)
        alone_from = time.time()
        time.sleep(seconds)
        alone_until = beside_from = time.time()
        jobs = []
        for spec in mix:
            job = str(uuid.uuid4())
            sent = time.monotonic()
            fields = {"model": preset, "prompt": "a red fox in snow", "seed": 1, "priority": 0}
            worker.send("job_run", job=job, epoch=1, deadline=time.time() + 600, **fields, **spec)
            try:
                _, _, done = worker.expect("job_completed", key=job, timeout_s=job_timeout_s)
            except TimeoutError:
                # Starved: recorded as such, cancelled, and the rest of the mix is not run.
                worker.send("job_cancel", job=job, epoch=1)
                jobs.append(spec | {"completion_s": None, "run_s": None, "timeout_s": job_timeout_s})
                break
            wall_s = time.monotonic() - sent
            jobs.append(spec | {"completion_s": round(wall_s, 3), "run_s": round(done["run_s"], 4)})
        beside_until = time.time()
        time.sleep(2 * worker.chunk_s)  # the last chunks' records
        rows = worker.chunks()
        run_s = sum(j["run_s"] or 0.0 for j in jobs)
        alone = _stream_figures(rows, worker.chunk_s, alone_from, alone_until, 0.0)
        beside = _stream_figures(rows, worker.chunk_s, beside_from, beside_until, run_s)
        u = alone["streams_busy"]
        for j in (j for j in jobs if j["run_s"] is not None):
            # Issue 32's target: compute / (1 − u) + one chunk period + 0.5 s.
            j["target_s"] = round(j["run_s"] / max(1e-3, 1.0 - u) + worker.chunk_s + 0.5, 3)
        return {"streams": streams, "chunk_s": worker.chunk_s, "alone": alone, "beside": beside, "jobs": jobs}
    finally:
        worker.stop()


def run_coserve_bench(
    redis_url: str,
    *,
    preset: str,
    stream_counts: list[int],
    mix: list[dict[str, Any]],
    seconds: float,
    warmup_s: float,
    starved_after_chunks: float | None = 4.0,
    warm_up_jobs: bool = True,
) -> dict[str, Any]:
    runs = [
        run_streams(
            redis_url,
            preset=preset,
            streams=n,
            mix=mix,
            seconds=seconds,
            warmup_s=warmup_s,
            starved_after_chunks=starved_after_chunks,
            warm_up_jobs=warm_up_jobs,
        )
        for n in stream_counts
    ]
    return {
        "benchmark": "coserve_live",
        "args": {
            "preset": preset,
            "streams": stream_counts,
            "seconds": seconds,
            "warmup_s": warmup_s,
            "starved_after_chunks": starved_after_chunks,
            "warm_up_jobs": warm_up_jobs,
        },
        "mix": mix,
        "runs": runs,
    }


def _simulated_text(simulated: dict[str, Any] | None) -> str:
    """The simulator's figures for one job (``--simulate``), if it ran."""
    if simulated is None:
        return ""
    if simulated["sim_device_s"] is None:
        return f"; simulated: not done in any of {simulated['phases']} phases"
    text = f"; simulated {simulated['sim_device_s']:.2f} s on the device"
    if simulated["sim_completion_s"] is not None:
        text += (
            f" + {simulated['overhead_s']:.2f} s overhead = {simulated['sim_completion_s']:.2f} s,"
            f" {simulated['sim_ratio']:.2f}× live"
        )
    if simulated["unfinished"]:
        text += f" ({simulated['unfinished']} of {simulated['phases']} phases not done)"
    return text


def format_coserve_bench(report: dict[str, Any]) -> str:
    lines = [f"bench_coserve_live: preset {report['args']['preset']}, {report['machine'].get('cpu', '')}"]
    for run in report["runs"]:
        alone, beside = run["alone"], run["beside"]
        lines.append(
            f"{run['streams']} stream(s), chunk {run['chunk_s']:.2f} s: streams busy {alone['streams_busy']:.2f};"
            f" late p50/p99 {alone['late_ms']['p50']:.1f}/{alone['late_ms']['p99']:.1f} ms alone,"
            f" {beside['late_ms']['p50']:.1f}/{beside['late_ms']['p99']:.1f} ms beside jobs;"
            f" lead p50 {alone['lead_ms']['p50']:.0f} → {beside['lead_ms']['p50']:.0f} ms,"
            f" min {alone['lead_ms']['min']:.0f} → {beside['lead_ms']['min']:.0f} ms; busy with jobs {beside['busy']:.2f}"
        )
        for job in run["jobs"]:
            size = f"{job['width']}x{job['height']}" + (
                f"x{job['frames']}" if job["job_kind"] == "video" else ""
            )
            if job["completion_s"] is None:
                lines.append(
                    f"    {job['job_kind']:5} {size:11} {job['steps']} steps: NOT done in {job['timeout_s']:.0f} s"
                )
                continue
            line = (
                f"    {job['job_kind']:5} {size:11} {job['steps']} steps: done in {job['completion_s']:.2f} s"
                f" for {job['run_s']:.3f} s of compute (target {job.get('target_s', math.nan):.2f} s)"
            )
            lines.append(line + _simulated_text(job.get("simulated")))
    return "\n".join(lines)
