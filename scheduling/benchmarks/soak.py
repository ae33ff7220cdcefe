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

With ``leave_share`` > 0 some idle periods are a viewer leaving instead of a pause (issue 31): the
client closes its socket and reopens it when the period ends, so the platform's viewer rule
(``SESSION_VIEWER_GRACE_S``, ``SESSION_IDLE_TIMEOUT_S``: ``viewer_grace_s``/``idle_timeout_s``)
makes the session idle, and the returning viewer resumes it. Chunks generated while the viewer was
away are counted apart (``missed_while_away``), not as skips.
"""

from __future__ import annotations

import asyncio
import collections
import itertools
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
from pathlib import Path
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
from scheduling.supervision import DEPLOYED_ASGI_APP
from sessions.models import ChunkRecord, GenerationSession, SessionEvent
from workers.benchmarks.live import BenchmarkFailed

# The web process under tracemalloc (``--trace-memory``): named, not imported (it wraps the deployed app).
MEMORY_TRACE_APP = "sessions.benchmarks.memory_trace:application"
LAYER_QUEUES_APP = "sessions.benchmarks.layer_queues:application"

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
    # Where in ``indices`` each connection of the client began (several when the viewer left).
    connections: list[int] = field(default_factory=list)
    leaves: int = 0


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
    leave_share: float = 0.0,
    viewer_grace_s: float | None = None,
    idle_timeout_s: float | None = None,
    codec: str = "jpeg",
    warmup_s: float | None = None,
    trace_memory_dir: str | None = None,
    trace_queues_dir: str | None = None,
) -> dict[str, Any]:
    """``codec``: what every client reads (``?codec=``; ``h264``: fragments, docs/media.md).
    ``trace_memory_dir``: the web process runs under ``tracemalloc`` and writes a snapshot there
    every minute (``sessions.benchmarks.memory_trace``), to tell what grows. ``trace_queues_dir``:
    the web process writes its RSS and the channel layer's in-process queues there every 5 s
    (``sessions.benchmarks.layer_queues``), without tracemalloc's cost.
    ``warmup_s``: each process's memory samples in its first ``warmup_s`` seconds (from its first
    sample: workers started mid-run warm up then) are left out of its RSS slope (default a fifth
    of the run)."""
    warmup_s = minutes * 60.0 / 5 if warmup_s is None else warmup_s
    logging.getLogger("httpx").setLevel(logging.WARNING)
    rule_env = {
        name: str(value)
        for name, value in (
            ("SESSION_VIEWER_GRACE_S", viewer_grace_s),
            ("SESSION_IDLE_TIMEOUT_S", idle_timeout_s),
        )
        if value is not None
    }
    asgi_app = DEPLOYED_ASGI_APP
    if trace_memory_dir is not None:
        Path(trace_memory_dir).mkdir(parents=True, exist_ok=True)
        rule_env["BENCH_TRACEMALLOC_DIR"] = str(Path(trace_memory_dir).resolve())
        asgi_app = MEMORY_TRACE_APP
    if trace_queues_dir is not None:
        if trace_memory_dir is not None:
            raise ValueError("--trace-memory and --trace-queues each wrap the web application: choose one")
        Path(trace_queues_dir).mkdir(parents=True, exist_ok=True)
        rule_env["BENCH_LAYER_QUEUES_DIR"] = str(Path(trace_queues_dir).resolve())
        asgi_app = LAYER_QUEUES_APP
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
            extra_env=rule_env,
            asgi_app=asgi_app,
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
                    leave_share=leave_share,
                    codec=codec,
                    warmup_s=warmup_s,
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
        "leave_share": leave_share,
        "viewer_rule_env": rule_env,
        "seed": seed,
        "codec": codec,
        "warmup_s": warmup_s,
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
    leave_share: float = 0.0,
    codec: str = "jpeg",
    warmup_s: float = 0.0,
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
                    leave_share,
                    codec,
                )
            )
            for log in logs
        ]
        memory = await _sample_memory(platform, deadline, sample_s, logs, say, warmup_s=warmup_s)
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
    leave_share: float = 0.0,
    codec: str = "jpeg",
) -> None:
    """Stream until the deadline, alternating active and idle periods (exponential lengths with the
    given mean cycle and active share), then terminate the session. An idle period is a pause
    message, or with probability ``leave_share`` the viewer leaving: the socket closes and a new
    one opens when the period ends."""
    url = f"{ws_base}/ws/sessions/{log.session}/?token={token}&codec={codec}"
    active = True
    switch_at = time.monotonic() + rng.expovariate(1.0 / (mean_period_s * active_fraction))
    try:
        while True:
            log.connections.append(len(log.indices))
            async with websockets.connect(url, max_size=None, open_timeout=30) as ws:
                leaving = False
                while time.monotonic() < deadline:
                    if time.monotonic() >= switch_at:
                        active = not active
                        share = active_fraction if active else 1.0 - active_fraction
                        switch_at = time.monotonic() + rng.expovariate(1.0 / max(mean_period_s * share, 0.1))
                        # rng.random() only when leaving is possible: runs without it replay as before.
                        if not active and leave_share > 0 and rng.random() < leave_share:
                            log.leaves += 1
                            leaving = True
                            break
                        log.pauses += not active
                        await ws.send(json.dumps({"type": "resume" if active else "pause"}))
                    await _receive(ws, log, min(switch_at, deadline))
                if not leaving:
                    await ws.send(json.dumps({"type": "terminate"}))
                    return
            # Away until the idle period ends (or the run does); the returning viewer is active.
            await asyncio.sleep(max(0.0, min(switch_at, deadline) - time.monotonic()))
            active = True
            switch_at = time.monotonic() + rng.expovariate(1.0 / (mean_period_s * active_fraction))
    except (OSError, websockets.WebSocketException) as exc:
        log.errors.append(f"{type(exc).__name__}: {exc}"[:200])


async def _receive(ws, log: ClientLog, until: float) -> None:
    """Take one message (or none by ``until``) into ``log``."""
    try:
        message = await asyncio.wait_for(ws.recv(), timeout=max(until - time.monotonic(), 0.05))
    except TimeoutError:
        return
    if isinstance(message, bytes):
        header, _ = decode_chunk_frame(message)
        log.indices.append(int(header["index"]))
        log.epochs.append(int(header.get("epoch", -1)))
        return
    text = json.loads(message)
    if text.get("type") == "skipped":
        log.dropped.add(int(text["index"]))
    elif text.get("type") == "error":
        log.errors.append(message[:200])


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
    platform: LivePlatform,
    deadline: float,
    sample_s: float,
    logs: list[ClientLog],
    say: Callable[[str], Any],
    *,
    warmup_s: float = 0.0,
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
            # Warm-up counted from each process's first sample: a worker the autoscaler starts
            # mid-run loads its model then, and that is not growth.
            "slope_mb_per_min": rss_slope(points, since_s=points[0][0] + warmup_s),
            "samples": points,
        }
        for name, points in sorted(series.items())
    }


def rss_slope(points: list[list[float]], *, since_s: float) -> float | None:
    """Least-squares growth of resident memory in MB per minute over the samples ``[t_s, mb]`` taken
    at or after ``since_s`` (after warm-up: imports, caches and pools filling are not growth);
    ``None`` with fewer than three such samples."""
    after = [(t, mb) for t, mb in points if t >= since_s]
    if len(after) < 3:
        return None
    n = len(after)
    mean_t = sum(t for t, _ in after) / n
    mean_mb = sum(mb for _, mb in after) / n
    spread = sum((t - mean_t) ** 2 for t, _ in after)
    if spread == 0:
        return None
    slope_per_s = sum((t - mean_t) * (mb - mean_mb) for t, mb in after) / spread
    return round(slope_per_s * 60.0, 3)


def _compare(logs: list[ClientLog], *, since: float) -> dict[str, Any]:
    close_old_connections()
    ids = [log.session for log in logs]
    recorded: dict[str, set[int]] = defaultdict(set)
    for sid, index in ChunkRecord.objects.filter(session_id__in=ids).values_list("session_id", "chunk_index"):
        recorded[str(sid)].add(index)
    duplicates = skips = out_of_order = lost = before_join = away = 0
    per_session = []
    for log in logs:
        seen = set(log.indices)
        dup = len(log.indices) - len(seen)
        order = sum(1 for a, b in zip(log.indices, log.indices[1:], strict=False) if b < a)
        # Indices between the first and the last received on one connection, neither received nor
        # announced as dropped for a slow client. Chunks published before the client's socket joined,
        # and while its viewer was away (between connections), are counted apart.
        gap = 0
        previous_last = None
        bounds = [*(log.connections or [0]), len(log.indices)]
        for begin, end in itertools.pairwise(bounds):
            segment = set(log.indices[begin:end])
            if not segment:
                continue
            gap += len(set(range(min(segment), max(segment) + 1)) - seen - log.dropped)
            if previous_last is not None:
                away += max(0, min(segment) - previous_last - 1)
            previous_last = max(segment)
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
        "viewer_leaves": sum(log.leaves for log in logs),
        "missed_while_away": away,
        # Idle events by reason: no_viewers when the viewer rule made the session idle.
        "idle_reasons": {
            str(reason or "user"): n
            for reason, n in SessionEvent.objects.filter(session_id__in=ids, kind=SessionEvent.Kind.IDLE)
            .values("detail__reason")
            .annotate(n=Count("id"))
            .values_list("detail__reason", "n")
        },
        "session_events": events,
        "migrations": migrations,
        "migration_failures": dict(failures.most_common(10)),
        "scaling_actions": scaling,
    }


def format_soak(report: dict[str, Any]) -> str:
    lines = [
        f"{report['sessions']} sessions for {report['minutes']} min (≤ {report['max_workers']} workers,"
        f" {report.get('codec', 'jpeg')} viewers):"
        f" {report['chunks_received']} chunks received",
        f"  duplicates {report['duplicates']}  skips {report['skips']}  out of order {report['out_of_order']}"
        f"  lost records {report['lost_records']}  client errors {report['client_error_count']}"
        f"  dropped for slow clients {report['dropped_for_slow_clients']}"
        f"  published before the client joined {report['published_before_client_joined']}",
        f"  migrations {report['migrations']}  scaling {report['scaling_actions']}",
        *(f"    failed {n}× {error}" for error, n in report.get("migration_failures", {}).items()),
        f"  events {report['session_events']}",
        f"  viewers left {report.get('viewer_leaves', 0)} times (missed while away"
        f" {report.get('missed_while_away', 0)}); idle by reason {report.get('idle_reasons', {})}",
        f"  memory (MB, first → last, max; slope after {report.get('warmup_s', 0):.0f} s of warm-up, MB/min):",
    ]
    for name, m in report["memory_mb"].items():
        slope = m.get("slope_mb_per_min")
        lines.append(
            f"    {name:<40} {m['first']:8.1f} → {m['last']:8.1f}   max {m['max']:8.1f}"
            f"   slope {'–' if slope is None else f'{slope:+.2f}'}"
        )
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
