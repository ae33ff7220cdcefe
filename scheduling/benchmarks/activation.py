"""Activation → first chunk, and the control plane's share of it (docs/benchmarks-live.md).

Starts the platform against the benchmark database — uvicorn, a Celery worker and beat (on their own
broker database), and ``workers`` local CPU workers provisioned by the scheduler itself
(min = max GPUs) — and waits until the workers are ready and have served ``warmup`` sessions, so
provisioning and first-forward warm-up are excluded. Then, one at a time with a pause:

- t0: the REST create call starts (token auth); the WebSocket is opened as soon as it returns the id;
- t_decision: ``SchedulerDecision.decided_at`` of the run that sent the session's start command;
- t_command: that ``WorkerCommand.created_at``; t_ack: its ``answered_at``;
- t_first: the first chunk frame arrives on the socket (then the session is terminated).

Control-plane share = t_ack − t0; model share = the first chunk's ``generation_ms``.

``paths`` measures the same activation through two front doors, alternating on the same platform so
the figures sit side by side: ``native`` (REST create, then the session socket) and ``realtime``
(vLLM-Omni's ``/v1/realtime/video``: t0 is the ``session.start`` frame sent on an open socket,
t_created its ``video.start``, t_first the first binary fragment).
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from collections.abc import Callable
from typing import Any

import httpx
import websockets
from django.contrib.auth import get_user_model
from django.db import close_old_connections
from rest_framework.authtoken.models import Token

from contracts.bench import machine_load, rounds, summarize
from contracts.wire.frames import decode_chunk_frame
from scheduling.benchmarks.platform import live_platform
from scheduling.models import WorkerCommand
from sessions.models import ChunkRecord, GenerationSession
from workers.benchmarks.live import BenchmarkFailed

COMPONENTS = (
    ("api_ms", "create call (REST) returns"),
    ("to_decision_ms", "t0 → scheduler decision starts (API + Celery hand-off)"),
    ("decision_to_command_ms", "decision start → start command written (scheduling)"),
    ("command_to_ack_ms", "command written → worker's answer recorded (delivery + chunk boundary)"),
    ("control_plane_ms", "t0 → ack (control plane's share)"),
    ("generation_ms", "first chunk's generation (model's share)"),
    ("first_chunk_ms", "t0 → first chunk on the socket"),
    ("delivery_ms", "first chunk's generated_at → socket receive"),
)


def components(sample: dict) -> dict:
    """Per-session component durations in ms from the raw timestamps (epoch seconds)."""
    t0 = sample["t0"]
    out = {
        "api_ms": (sample["t_created"] - t0) * 1000.0,
        "to_decision_ms": (sample["t_decision"] - t0) * 1000.0,
        "decision_to_command_ms": (sample["t_command"] - sample["t_decision"]) * 1000.0,
        "command_to_ack_ms": (sample["t_ack"] - sample["t_command"]) * 1000.0,
        "control_plane_ms": (sample["t_ack"] - t0) * 1000.0,
        "generation_ms": sample["generation_ms"],
        "first_chunk_ms": (sample["t_first"] - t0) * 1000.0,
        "delivery_ms": (sample["t_first"] - sample["generated_at"]) * 1000.0,
    }
    return {k: round(v, 3) for k, v in out.items()}


PATHS = ("native", "realtime")


def run_activation(
    *,
    sessions: int,
    paths: tuple[str, ...] = ("native",),
    warmup: int,
    workers: int,
    pause: float,
    database: str | None,
    redis_db: int,
    ready_timeout: float,
    keep_logs: str | None,
    say: Callable[[str], Any],
) -> dict[str, Any]:
    """The whole benchmark; raises ``ServiceUnavailable`` or ``BenchmarkFailed`` with a message."""
    logging.getLogger("httpx").setLevel(logging.WARNING)
    run = uuid.uuid4().hex[:8]
    samples, load_before = [], None
    try:
        with live_platform(
            prefix="bench-activation",
            database=database,
            redis_db=redis_db,
            min_gpus=workers,
            max_gpus=workers,  # a fixed pool: no activation waits on provisioning
            ready_timeout=ready_timeout,
            keep_logs=keep_logs,
            say=say,
        ) as platform:
            token = _prepare(run)
            load_before = machine_load()
            say(f"{warmup} warm-up activations")
            for index, measured in rounds(sessions, warmup):
                for path in paths:
                    activate = _activate if path == "native" else _activate_realtime
                    sample = asyncio.run(activate(platform.http, platform.ws, token, seed=index))
                    if path == "realtime":
                        sample |= _first_record(sample["session"])
                    if platform.processes.dead():
                        raise BenchmarkFailed(f"a platform process died: {platform.processes.dead()}")
                    if measured:
                        samples.append(sample | {"path": path})
                        say(
                            f"  session {index - warmup + 1}/{sessions} ({path}): first chunk after"
                            f" {(sample['t_first'] - sample['t0']) * 1000:.0f} ms"
                        )
                    time.sleep(pause)
            _attach_control_plane(samples)
            db_name = platform.database
    finally:
        _cleanup(run)

    complete = [s for s in samples if s.get("t_ack") is not None]
    per_session = [components(s) | {"path": s["path"]} for s in complete]
    by_path = {
        path: {key: summarize(c[key] for c in per_session if c["path"] == path) for key, _ in COMPONENTS}
        for path in paths
    }
    figures = by_path[paths[0]]
    return {
        "benchmark": "activation",
        "database": db_name,
        "sessions": sessions,
        "measured": len(per_session),
        "incomplete": len(samples) - len(complete),
        "first_index_not_zero": sum(1 for s in samples if s["first_index"] != 0),
        "decision_triggers": {
            t: sum(1 for s in complete if s.get("decision_trigger") == t)
            for t in sorted({s.get("decision_trigger") for s in complete})
        },
        "warmup": warmup,
        "workers": workers,
        "pause_s": pause,
        "paths": list(paths),
        "components_ms": figures,
        "components_ms_by_path": by_path,
        "control_plane_share_p50": round(
            figures["control_plane_ms"]["p50"] / figures["first_chunk_ms"]["p50"], 3
        )
        if per_session
        else None,
        "samples": per_session,
        "load_before": load_before,
        "load_after": machine_load(),
    }


def format_activation(report: dict[str, Any]) -> str:
    lines = [
        f"{report['measured']} activations measured ({report['incomplete']} incomplete);"
        f" placing decisions by trigger {report['decision_triggers']}"
    ]
    for path, figures in report["components_ms_by_path"].items():
        lines.append(f"{path}:")
        for key, label in COMPONENTS:
            f = figures[key]
            lines.append(f"  {label:<72} p50 {f['p50']:8.1f}  p99 {f['p99']:8.1f}  max {f['max']:8.1f} ms")
    lines.append(
        f"load average before {report['load_before']['loadavg']} after {report['load_after']['loadavg']}"
        f" on {report['load_before']['cpus']} CPUs"
    )
    return "\n".join(lines)


# --- steps -------------------------------------------------------------------------------------


def _prepare(run: str) -> str:
    user = get_user_model().objects.create(username=f"bench-activation-{run}")
    return Token.objects.create(user=user).key


async def _activate(base: str, ws_base: str, token: str, *, seed: int) -> dict:
    async with httpx.AsyncClient(
        base_url=base, headers={"Authorization": f"Token {token}"}, timeout=30
    ) as api:
        await api.get("/api/models/")  # connection established before t0, as a live integrator's is
        t0 = time.time()
        response = await api.post(
            "/api/sessions/", json={"prompt": "a lighthouse in a storm", "model": "tiny", "seed": seed}
        )
        t_created = time.time()
        if response.status_code != 201:
            raise BenchmarkFailed(f"session create failed: {response.status_code} {response.text[:300]}")
        session_id = response.json()["id"]
        async with websockets.connect(
            f"{ws_base}/ws/sessions/{session_id}/?token={token}&codec=jpeg", max_size=None
        ) as ws:
            deadline = time.monotonic() + 60
            while True:
                message = await asyncio.wait_for(ws.recv(), timeout=max(deadline - time.monotonic(), 0.1))
                if isinstance(message, bytes):
                    t_first = time.time()
                    header, _ = decode_chunk_frame(message)
                    break
            await ws.send(json.dumps({"type": "terminate"}))
        return {
            "session": session_id,
            "t0": t0,
            "t_created": t_created,
            "t_first": t_first,
            "first_index": int(header["index"]),
            "generation_ms": float(header["generation_ms"]),
            "generated_at": float(header["generated_at"]),
            "worker": header.get("worker"),
        }


async def _activate_realtime(base: str, ws_base: str, token: str, *, seed: int) -> dict:
    """One activation through vLLM-Omni's socket: open, send ``session.start``, wait for the first
    binary fragment, stop."""
    async with websockets.connect(
        f"{ws_base}/v1/realtime/video", additional_headers={"Authorization": f"Bearer {token}"}, max_size=None
    ) as ws:
        t0 = time.time()
        start = {"type": "session.start", "model": "tiny", "prompt": "a lighthouse in a storm", "seed": seed}
        await ws.send(json.dumps(start))
        deadline = time.monotonic() + 60
        metadata: dict = {}
        while True:
            message = await asyncio.wait_for(ws.recv(), timeout=max(deadline - time.monotonic(), 0.1))
            if isinstance(message, bytes):
                t_first = time.time()
                break
            text = json.loads(message)
            if text["type"] == "video.start":
                t_created, session_id = time.time(), text["request_id"]
            elif text["type"] == "video.chunk_metadata":
                metadata = text
            elif text["type"] == "error":
                raise BenchmarkFailed(f"realtime session refused: {text['message']}")
        await ws.send(json.dumps({"type": "session.stop"}))
    return {
        "session": session_id,
        "t0": t0,
        "t_created": t_created,
        "t_first": t_first,
        "first_index": int(metadata["generation_chunk_index"]),
    }


def _first_record(session_id: str) -> dict:
    """The first chunk's generation time and end, from its audit record (the realtime metadata
    frame carries neither): the record stream drains into PostgreSQL within a second or two."""
    close_old_connections()
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        record = (
            ChunkRecord.objects.select_related("worker")
            .filter(session_id=session_id)
            .order_by("chunk_index")
            .first()
        )
        if record is not None:  # created_at is the chunk's generated_at (sessions/ingest.py)
            return {
                "generation_ms": record.generation_ms,
                "generated_at": record.created_at.timestamp(),
                "worker": record.worker.name if record.worker else None,
            }
        time.sleep(0.2)
    raise BenchmarkFailed(f"no chunk record for realtime session {session_id} within 30 s")


def _attach_control_plane(samples: list[dict]) -> None:
    """The start command of each session, its answer, and the decision that sent it."""
    close_old_connections()
    for sample in samples:
        command = (
            WorkerCommand.objects.select_related("decision")
            .filter(
                session_id=sample["session"],
                kind__in=[WorkerCommand.Kind.START, WorkerCommand.Kind.RESUME],
            )
            .order_by("created_at")
            .first()
        )
        if command is None or command.answered_at is None or command.decision is None:
            sample["t_ack"] = None
            continue
        sample["t_decision"] = command.decision.decided_at.timestamp()
        sample["t_command"] = command.created_at.timestamp()
        sample["t_ack"] = command.answered_at.timestamp()
        sample["command_status"] = command.status
        sample["decision_trigger"] = command.decision.trigger


def _cleanup(run: str) -> None:
    """The benchmark's user and sessions go (with their events, prompts and chunk records); released
    worker rows, decisions and the cost ledger stay in the benchmark database as its history."""
    close_old_connections()
    label = f"bench-activation-{run}"
    GenerationSession.objects.filter(owner__username=label).delete()
    get_user_model().objects.filter(username=label).delete()
