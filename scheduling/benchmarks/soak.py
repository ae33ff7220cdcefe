"""A soak run: many sessions streaming for a long time through the real platform, checked as a client.

Each session is a REST create plus a WebSocket client that goes idle and comes back at random (so the
scheduler suspends, resumes, migrates and scales), and records every chunk frame it receives. Every
``sample_s`` the run samples the resident memory of each platform process: uvicorn, the Celery worker
(and its pool children), beat and every GPU worker process. At the end it compares what the clients
saw with what the platform recorded:

- duplicates: a chunk index received twice by one client;
- skips: an index never received although a later one was (a gap in the stream);
- out of order: an index lower than one already received;
- lost records: an index a client received that has no ``ChunkRecord``.
"""

from __future__ import annotations

import asyncio
import collections
import json
import logging
import random
import re
import time
import uuid
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

import httpx
import psutil
import websockets
from django.contrib.auth import get_user_model
from django.db import close_old_connections
from django.db.models import Count
from rest_framework.authtoken.models import Token

from contracts.bench import machine_load, summarize
from contracts.wire.frames import decode_chunk_frame
from scheduling.benchmarks.platform import LivePlatform, live_platform
from scheduling.models import Migration, ScalingAction
from sessions.models import ChunkRecord, GenerationSession, SessionEvent
from workers.benchmarks.live import BenchmarkFailed

PROMPTS = (
    "a lighthouse in a storm",
    "a red fox in the snow",
    "a paper boat on a river",
    "city lights at night",
)


@dataclass
class ClientLog:
    """What one client saw."""

    session: str
    indices: list[int] = field(default_factory=list)
    epochs: list[int] = field(default_factory=list)
    # Indices the consumer told this client it dropped (its bounded outbox was full: a slow client).
    dropped: set[int] = field(default_factory=set)
    errors: list[str] = field(default_factory=list)
    pauses: int = 0


def run_soak(
    *,
    sessions: int,
    minutes: float,
    max_workers: int,
    active_fraction: float,
    mean_period_s: float,
    sample_s: float,
    seed: int,
    database: str | None,
    redis_db: int,
    ready_timeout: float,
    keep_logs: str | None,
    say: Callable[[str], Any],
) -> dict[str, Any]:
    logging.getLogger("httpx").setLevel(logging.WARNING)
    run = uuid.uuid4().hex[:8]
    rng = random.Random(seed)
    load_before = machine_load()
    try:
        with live_platform(
            prefix="soak",
            database=database,
            redis_db=redis_db,
            min_gpus=1,
            max_gpus=max_workers,
            ready_timeout=ready_timeout,
            keep_logs=keep_logs,
            say=say,
            sessions_per_user=sessions,
        ) as platform:
            token = _user_token(run)
            started = time.time()
            logs, memory = asyncio.run(
                _drive(
                    platform,
                    token,
                    sessions=sessions,
                    duration_s=minutes * 60.0,
                    active_fraction=active_fraction,
                    mean_period_s=mean_period_s,
                    sample_s=sample_s,
                    rng=rng,
                    say=say,
                )
            )
            dead = platform.processes.dead()
            time.sleep(3.0)  # let the workers' reporters flush their last chunk records
            report = _compare(logs, since=started)
            report["platform_died"] = dead
            report["database"] = platform.database
    finally:
        _cleanup(run)
    return {
        "benchmark": "soak",
        "sessions": sessions,
        "minutes": minutes,
        "max_workers": max_workers,
        "active_fraction": active_fraction,
        "mean_period_s": mean_period_s,
        "seed": seed,
        **report,
        "memory_mb": memory,
        "load_before": load_before,
        "load_after": machine_load(),
    }


def _user_token(run: str) -> str:
    user = get_user_model().objects.create(username=f"soak-{run}")
    return Token.objects.create(user=user).key


async def _drive(
    platform: LivePlatform,
    token: str,
    *,
    sessions: int,
    duration_s: float,
    active_fraction: float,
    mean_period_s: float,
    sample_s: float,
    rng: random.Random,
    say: Callable[[str], Any],
) -> tuple[list[ClientLog], dict[str, Any]]:
    deadline = time.monotonic() + duration_s
    async with httpx.AsyncClient(
        base_url=platform.http, headers={"Authorization": f"Token {token}"}, timeout=60
    ) as api:
        logs = []
        for n in range(sessions):
            response = await api.post(
                "/api/sessions/", json={"prompt": rng.choice(PROMPTS), "model": "tiny", "seed": n}
            )
            if response.status_code != 201:
                raise BenchmarkFailed(f"session create failed: {response.status_code} {response.text[:300]}")
            logs.append(ClientLog(session=response.json()["id"]))
        say(f"{sessions} sessions created; streaming for {duration_s / 60:.1f} min")
        clients = [
            asyncio.create_task(
                _client(
                    platform.ws,
                    token,
                    log,
                    deadline,
                    active_fraction,
                    mean_period_s,
                    random.Random(rng.random()),
                )
            )
            for log in logs
        ]
        memory = await _sample_memory(platform, deadline, sample_s, logs, say)
        await asyncio.gather(*clients)
    return logs, memory


async def _client(
    ws_base: str,
    token: str,
    log: ClientLog,
    deadline: float,
    active_fraction: float,
    mean_period_s: float,
    rng: random.Random,
) -> None:
    """Stream until the deadline, alternating active and idle periods (exponential lengths with the
    given mean cycle and active share), then terminate the session."""
    try:
        async with websockets.connect(
            f"{ws_base}/ws/sessions/{log.session}/?token={token}", max_size=None, open_timeout=30
        ) as ws:
            active = True
            switch_at = time.monotonic() + rng.expovariate(1.0 / (mean_period_s * active_fraction))
            while time.monotonic() < deadline:
                if time.monotonic() >= switch_at:
                    active = not active
                    log.pauses += not active
                    await ws.send(json.dumps({"type": "resume" if active else "pause"}))
                    share = active_fraction if active else 1.0 - active_fraction
                    switch_at = time.monotonic() + rng.expovariate(1.0 / max(mean_period_s * share, 0.1))
                timeout = max(min(switch_at, deadline) - time.monotonic(), 0.05)
                try:
                    message = await asyncio.wait_for(ws.recv(), timeout=timeout)
                except TimeoutError:
                    continue
                if isinstance(message, bytes):
                    header, _ = decode_chunk_frame(message)
                    log.indices.append(int(header["index"]))
                    log.epochs.append(int(header.get("epoch", -1)))
                    continue
                text = json.loads(message)
                if text.get("type") == "skipped":
                    log.dropped.add(int(text["index"]))
                elif text.get("type") == "error":
                    log.errors.append(message[:200])
            await ws.send(json.dumps({"type": "terminate"}))
    except (OSError, websockets.WebSocketException) as exc:
        log.errors.append(f"{type(exc).__name__}: {exc}"[:200])


def _platform_processes(platform: LivePlatform) -> dict[str, psutil.Process]:
    """The run's processes by role: the spawned services and their children, and every GPU worker
    process serving this run's database (wherever it sits in the process tree)."""
    found: dict[str, psutil.Process] = {}
    for name, popen in platform.processes.processes.items():
        try:
            root = psutil.Process(popen.pid)
            children = root.children(recursive=True)
        except psutil.NoSuchProcess:
            continue
        found[name] = root
        for i, child in enumerate(children):
            found[_role(child) or f"{name}.child{i}"] = child
    known = {p.pid for p in found.values()}
    for process in psutil.process_iter(["pid", "cmdline"]):
        if process.pid in known or "gpuworker" not in (process.info["cmdline"] or []):
            continue
        try:
            database = process.environ().get("DATABASE_URL", "")
        except (psutil.AccessDenied, psutil.NoSuchProcess):
            continue
        if database.endswith(f"/{platform.database}"):
            found[_role(process) or f"gpuworker:{process.pid}"] = process
    return found


def _role(process: psutil.Process) -> str | None:
    try:
        cmdline = process.cmdline()
    except psutil.NoSuchProcess:
        return None
    if "gpuworker" in cmdline:
        return f"gpuworker:{_flag(cmdline, '--name') or process.pid}"
    return None


def _flag(cmdline: list[str], flag: str) -> str | None:
    return cmdline[cmdline.index(flag) + 1] if flag in cmdline[:-1] else None


async def _sample_memory(
    platform: LivePlatform, deadline: float, sample_s: float, logs: list[ClientLog], say: Callable[[str], Any]
) -> dict[str, Any]:
    series: dict[str, list[list[float]]] = defaultdict(list)
    began = time.monotonic()
    while time.monotonic() < deadline:
        elapsed = round(time.monotonic() - began, 1)
        for name, process in (await asyncio.to_thread(_platform_processes, platform)).items():
            try:
                series[name].append([elapsed, round(process.memory_info().rss / 2**20, 1)])
            except psutil.NoSuchProcess:
                continue
        chunks = sum(len(log.indices) for log in logs)
        say(f"  t={elapsed:6.0f} s  chunks received {chunks:7d}  processes {len(series)}")
        if platform.processes.dead():
            say(f"  a platform process died: {platform.processes.dead()}")
            break
        await asyncio.sleep(min(sample_s, max(deadline - time.monotonic(), 0)))
    return {
        name: {
            "first": points[0][1],
            "last": points[-1][1],
            "max": max(p[1] for p in points),
            "samples": points,
        }
        for name, points in sorted(series.items())
    }


def _compare(logs: list[ClientLog], *, since: float) -> dict[str, Any]:
    close_old_connections()
    ids = [log.session for log in logs]
    recorded: dict[str, set[int]] = defaultdict(set)
    for sid, index in ChunkRecord.objects.filter(session_id__in=ids).values_list("session_id", "chunk_index"):
        recorded[str(sid)].add(index)
    duplicates = skips = out_of_order = lost = before_join = 0
    per_session = []
    for log in logs:
        seen = set(log.indices)
        dup = len(log.indices) - len(seen)
        order = sum(1 for a, b in zip(log.indices, log.indices[1:], strict=False) if b < a)
        # Indices between the first and the last received, neither received nor announced as dropped
        # for a slow client. Chunks published before the client's socket joined are counted apart.
        gap = len(set(range(min(seen), max(seen) + 1)) - seen - log.dropped) if seen else 0
        before_join += min(seen) if seen else 0
        missing = len(seen - recorded[log.session])
        duplicates, out_of_order, skips, lost = (
            duplicates + dup,
            out_of_order + order,
            skips + gap,
            lost + missing,
        )
        per_session.append(len(log.indices))
    events = dict(
        SessionEvent.objects.filter(session_id__in=ids)
        .values("kind")
        .annotate(n=Count("id"))
        .values_list("kind", "n")
    )
    migrations = dict(
        Migration.objects.filter(session_id__in=ids)
        .values("outcome")
        .annotate(n=Count("id"))
        .values_list("outcome", "n")
    )
    # Why migrations failed, most frequent first (ids and numbers elided so that causes group).
    failures = collections.Counter(
        _error_kind(error)
        for error in Migration.objects.filter(
            session_id__in=ids, outcome=Migration.Outcome.FAILED
        ).values_list("error", flat=True)
    )
    scaling = dict(
        ScalingAction.objects.filter(created_at__gte=datetime.fromtimestamp(since, tz=UTC))
        .values("direction")
        .annotate(n=Count("id"))
        .values_list("direction", "n")
    )
    return {
        "chunks_received": sum(per_session),
        "chunks_per_session": summarize(per_session),
        "duplicates": duplicates,
        "skips": skips,
        "out_of_order": out_of_order,
        "lost_records": lost,
        "dropped_for_slow_clients": sum(len(log.dropped) for log in logs),
        "published_before_client_joined": before_join,
        "client_errors": [e for log in logs for e in log.errors][:20],
        "client_error_count": sum(len(log.errors) for log in logs),
        "pauses": sum(log.pauses for log in logs),
        "session_events": events,
        "migrations": migrations,
        "migration_failures": dict(failures.most_common(10)),
        "scaling_actions": scaling,
    }


def format_soak(report: dict[str, Any]) -> str:
    lines = [
        f"{report['sessions']} sessions for {report['minutes']} min (≤ {report['max_workers']} workers):"
        f" {report['chunks_received']} chunks received",
        f"  duplicates {report['duplicates']}  skips {report['skips']}  out of order {report['out_of_order']}"
        f"  lost records {report['lost_records']}  client errors {report['client_error_count']}"
        f"  dropped for slow clients {report['dropped_for_slow_clients']}"
        f"  published before the client joined {report['published_before_client_joined']}",
        f"  migrations {report['migrations']}  scaling {report['scaling_actions']}",
        *(f"    failed {n}× {error}" for error, n in report.get("migration_failures", {}).items()),
        f"  events {report['session_events']}",
        "  memory (MB, first → last, max):",
    ]
    for name, m in report["memory_mb"].items():
        lines.append(f"    {name:<40} {m['first']:8.1f} → {m['last']:8.1f}   max {m['max']:8.1f}")
    if report.get("platform_died"):
        lines.append(f"  a platform process died: {report['platform_died']}")
    return "\n".join(lines)


def _error_kind(error: str) -> str:
    """A migration error with its session ids, worker names and numbers elided."""
    error = re.sub(r"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}", "<session>", error)
    error = re.sub(r"local-[a-z]+-[0-9a-f]+", "<worker>", error)
    return re.sub(r"\d+(\.\d+)?", "N", error)[:200]


def _cleanup(run: str) -> None:
    close_old_connections()
    label = f"soak-{run}"
    GenerationSession.objects.filter(owner__username=label).delete()
    get_user_model().objects.filter(username=label).delete()
