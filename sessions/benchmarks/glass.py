"""``manage.py bench_glass``: glass to glass in real headless Chromium, per transport.

From a chunk's encode finishing on the worker (its header's ``generated_at``, stamped by the
publisher once the chunk is encoded, just before it is sent) to its first frame on the screen of the
real generation page (``static/js/generate.js``: ``requestVideoFrameCallback``'s presentation time
for MSE and WebRTC, the animation frame that draws it for JPEG). Both ends read the wall clock (epoch
milliseconds) of this one machine, so no offset enters; over loopback.

Starts uvicorn (the platform's ASGI app) on the benchmark database and the configured Redis, opens
the page logged in for one session per transport, and publishes that session's chunks from a
worker-side process (``workers.benchmarks.delivery_publisher``: the panned photograph at the
requested size, encoded as the worker encodes it). The page reports, per chunk, its arrival and its
first frame presented (``window.streamserve.page.glass``); the difference is the player's buffer.

A transport is a way the page receives media (``TRANSPORTS``): how to open the page, and which codec
the worker publishes for it.

WebRTC: the page's ``WebRtcPlayer`` tells which presented picture starts which chunk from the
server's ``webrtc.chunk`` frames, which give the RTP timestamp of each chunk's first picture less the
sender's random origin (``rtp_pts``), and ``requestVideoFrameCallback``'s ``rtpTimestamp``: the
origin is learnt once from the first picture presented (a closed GOP's first, matched to the chunk
announced nearest its arrival), then a picture starts chunk i when ``rtpTimestamp − origin ≡ rtp_pts``
exactly (docs/media.md). Its "arrival" is the ``webrtc.chunk`` frame: the first picture leaving the
web process.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from django.conf import settings
from django.contrib.auth import get_user_model
from django.db import close_old_connections

from contracts.bench import machine_load, summarize
from gpu.models import GpuWorker
from sessions.models import ChunkRecord, GenerationSession
from workers.benchmarks.live import (
    BENCH_BROKER_DB,
    ProcessGroup,
    bench_sessions,
    check_redis,
    database_url,
    free_port,
    port_open,
    redis_url_with_db,
    use_bench_database,
    wait_until,
)

TARGET_P99_MS = 150.0
PUBLISHER_MODULE = "workers.benchmarks.delivery_publisher"
CHROMIUM = os.environ.get("CHROMIUM_PATH", "/usr/bin/chromium")
CHROMIUM_ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--no-first-run",
    "--disable-background-networking",
]


@dataclass(frozen=True)
class Transport:
    """How the page gets media: ``page_codec`` is its ``?codec=`` (``auto``: H.264 through MSE where
    the browser can play it), ``codec`` what the worker publishes, ``page_reads`` and
    ``page_transport`` what the page must have settled on (``window.streamserve.page.codec`` and
    ``.transport``) before the first chunk is sent."""

    name: str
    page_codec: str
    codec: str
    page_reads: str
    page_transport: str = "socket"


TRANSPORTS = {
    "mse": Transport("mse", page_codec="auto", codec="h264", page_reads="h264"),
    "webrtc": Transport(
        "webrtc", page_codec="webrtc", codec="h264", page_reads="h264", page_transport="webrtc"
    ),
    "jpeg": Transport("jpeg", page_codec="jpeg", codec="jpeg", page_reads="jpeg"),
}
# What the page must show before the chunks start: its codec and transport settled, the socket open,
# and for WebRTC the peer connection up (no chunk is sent to a viewer before it is).
PAGE_READY = """([reads, transport]) => {
  const p = window.streamserve?.page;
  if (!p || p.codec !== reads || p.transport !== transport || p.socket?.ws?.readyState !== 1) return false;
  return transport !== "webrtc" || window.streamserve.player?.stats?.connectionState === "connected";
}"""


def run_glass(
    *,
    transports: Sequence[str],
    chunks: int,
    warmup: int,
    period: float,
    width: int,
    height: int,
    frames: int,
    content: str,
    database: str | None,
    keep_logs: str | None,
    say: Callable[[str], Any],
) -> dict[str, Any]:
    """The whole benchmark; raises ``ServiceUnavailable`` when PostgreSQL or Redis does not answer."""
    if not Path(CHROMIUM).exists():
        raise FileNotFoundError(f"{CHROMIUM} is missing (CHROMIUM_PATH): headless Chromium is needed")
    check_redis(settings.REDIS_URL)
    db = use_bench_database(database)
    run = uuid.uuid4().hex[:8]
    cookie, session_ids = _create_rows(
        run, len(transports), width=width, height=height, frames=frames, period=period
    )
    tmp = Path(tempfile.mkdtemp(prefix="bench-glass-"))
    port = free_port()
    env = {
        **os.environ,
        "DATABASE_URL": database_url(db, db["NAME"]),
        "REDIS_URL": settings.REDIS_URL,
        "CELERY_BROKER_URL": redis_url_with_db(settings.REDIS_URL, BENCH_BROKER_DB),
        "PYTHONUNBUFFERED": "1",
        "LOG_LEVEL": os.environ.get("BENCH_LOG_LEVEL", "WARNING"),
    }
    env.pop("DJANGO_ALLOW_ASYNC_UNSAFE", None)
    results = []
    try:
        with ProcessGroup(tmp, env, Path(settings.BASE_DIR)) as processes:
            processes.spawn(
                "web",
                "-m",
                "uvicorn",
                "controlplane.asgi:application",
                "--port",
                str(port),
                "--ws",
                "websockets-sansio",
                "--no-access-log",
                "--log-level",
                "warning",
            )
            wait_until(lambda: port_open(port), 60, "the ASGI server", alive=processes.dead)
            if "webrtc" in transports and settings.STREAMSERVE["WEBRTC_MEDIA"] == "process":
                # The WebRTC peer connections run in the media process beside the web process, as deployed.
                processes.spawn("media", "manage.py", "runmedia")
                wait_until(
                    lambda: b"serving WebRTC" in (processes.log_dir / "media.log").read_bytes(),
                    60,
                    "the media process",
                    alive=processes.dead,
                )
            base_url = f"http://127.0.0.1:{port}"
            say(f"uvicorn on :{port}, database {db['NAME']}, Redis {settings.REDIS_URL}, Chromium {CHROMIUM}")
            from playwright.sync_api import sync_playwright

            with sync_playwright() as playwright:
                browser = playwright.chromium.launch(
                    executable_path=CHROMIUM, args=CHROMIUM_ARGS, headless=True
                )
                try:
                    for name, session_id in zip(transports, session_ids, strict=True):
                        say(f"{name}: {chunks} chunks of {width}×{height}×{frames}, one every {period} s …")
                        results.append(
                            _measure(
                                browser,
                                processes,
                                tmp,
                                base_url,
                                cookie,
                                TRANSPORTS[name],
                                session_id,
                                chunks=chunks,
                                warmup=warmup,
                                period=period,
                                shape=(width, height, frames, content),
                            )
                        )
                        say(format_run(results[-1]))
                finally:
                    browser.close()
            if keep_logs:
                shutil.copytree(tmp, keep_logs, dirs_exist_ok=True)
    finally:
        _delete_rows(run)
    return {
        "benchmark": "glass",
        "clock": "wall-clock epoch ms of one machine on both sides (worker's generated_at, page's Date.now())",
        "database": db["NAME"],
        "chunks": chunks,
        "warmup_chunks": warmup,
        "period_s": period,
        "shape": {"width": width, "height": height, "frames": frames, "content": content},
        "runs": results,
        "target_p99_ms": TARGET_P99_MS,
        "target_met": {
            r["transport"]: r["glass_ms"]["p99"] <= TARGET_P99_MS for r in results if r["glass_ms"]["count"]
        },
    }


def format_run(result: dict[str, Any]) -> str:
    g, a, p = result["glass_ms"], result["arrival_ms"], result["player_ms"]
    if not g["count"]:
        return f"  {result['transport']}: no chunk was presented ({result['player_stats']})"
    return (
        f"  {result['transport']:5s} glass to glass ms p50 {g['p50']:.1f}  p99 {g['p99']:.1f}  max {g['max']:.1f}"
        f"  (n={g['count']}, {result['missing']} of {result['expected']} never presented)\n"
        f"        of which encode done → arrival p50 {a['p50']:.1f} p99 {a['p99']:.1f};"
        f" arrival → first frame presented p50 {p['p50']:.1f} p99 {p['p99']:.1f}\n"
        f"        player: {json.dumps(result['player_stats'])}\n"
        f"        load average {result['load_before']['loadavg']} → {result['load_after']['loadavg']}"
        f" on {result['load_before']['cpus']} CPUs"
    )


def format_verdict(report: dict[str, Any]) -> str:
    return "\n".join(
        f"target glass-to-glass p99 <= {TARGET_P99_MS:g} ms over loopback, {name}: {'met' if met else 'MISSED'}"
        for name, met in report["target_met"].items()
    )


def _measure(
    browser,
    processes: ProcessGroup,
    tmp: Path,
    base_url: str,
    cookie: tuple[str, str],
    transport: Transport,
    session_id: str,
    *,
    chunks: int,
    warmup: int,
    period: float,
    shape: tuple[int, int, int, str],
) -> dict[str, Any]:
    width, height, frames, content = shape
    context = browser.new_context(viewport={"width": 1280, "height": 900})
    context.add_cookies([{"name": cookie[0], "value": cookie[1], "url": base_url}])
    page = context.new_page()
    errors: list[str] = []
    page.on("pageerror", lambda exc: errors.append(str(exc)))
    try:
        page.goto(f"{base_url}/?session={session_id}&codec={transport.page_codec}")
        page.wait_for_function(
            PAGE_READY, arg=[transport.page_reads, transport.page_transport], timeout=30_000
        )
        time.sleep(1.0)  # the codec lease and the viewer registration written; the status frame shown
        load_before = machine_load()
        sessions_file, out = tmp / f"{transport.name}-sessions.json", tmp / f"{transport.name}-pub.json"
        sessions_file.write_text(json.dumps([session_id]))
        processes.spawn(
            f"{transport.name}-publisher",
            "-m",
            PUBLISHER_MODULE,
            "--sessions-file",
            str(sessions_file),
            "--out",
            str(out),
            "--chunks",
            str(chunks),
            "--period",
            str(period),
            "--start-at",
            str(time.time() + 1.0),
            "--width",
            str(width),
            "--height",
            str(height),
            "--frames",
            str(frames),
            "--codec",
            transport.codec,
            "--content",
            content,
            service=False,
        )
        # Playwright's calls drive its own event loop: wait in the page, not in a blocking sleep.
        deadline = time.monotonic() + chunks * period + 90
        while not out.exists():
            if time.monotonic() > deadline:
                raise TimeoutError(f"the {transport.name} publisher did not finish")
            page.wait_for_timeout(250)
        processes.processes.pop(f"{transport.name}-publisher").wait(timeout=10)
        page.wait_for_timeout(2.0 * period * 1000 + 1000)  # the last chunk plays out
        glass = page.evaluate("window.streamserve.page.glass")
        player_stats = page.evaluate("window.streamserve.player?.stats ?? null")
    finally:
        context.close()
    counted = [
        g
        for g in glass
        if g["index"] >= warmup
        and g["codec"] == transport.page_reads
        and g.get("transport", "socket") == transport.page_transport
    ]
    return {
        "transport": transport.name,
        "codec": transport.codec,
        "expected": chunks - warmup,
        "missing": (chunks - warmup) - len({g["index"] for g in counted}),
        "glass_ms": summarize(g["glassMs"] for g in counted),
        "arrival_ms": summarize(g["arrivalMs"] for g in counted),
        "player_ms": summarize(g["glassMs"] - g["arrivalMs"] for g in counted),
        "player_stats": player_stats,
        "page_errors": errors[:5],
        "publisher": json.loads(out.read_text()),
        "load_before": load_before,
        "load_after": machine_load(),
    }


def _create_rows(
    run: str, count: int, *, width: int, height: int, frames: int, period: float
) -> tuple[tuple[str, str], list[str]]:
    from django.test import Client

    label = f"bench-glass-{run}"
    try:
        user = get_user_model().objects.create(username=label)
        _, sessions = bench_sessions(label=label, owner=user, count=count)
        GenerationSession.objects.filter(pk__in=[s.pk for s in sessions]).update(
            width=width, height=height, frames_per_chunk=frames, fps=round(frames / period)
        )
        client = Client()
        client.force_login(user)  # the page's Django session cookie, as the login form would set it
        cookie = client.cookies[settings.SESSION_COOKIE_NAME].value
    except Exception:
        _delete_rows(run)
        raise
    return (settings.SESSION_COOKIE_NAME, cookie), [str(s.pk) for s in sessions]


def _delete_rows(run: str) -> None:
    label = f"bench-glass-{run}"
    close_old_connections()
    sessions = GenerationSession.objects.filter(owner__username=label)
    ChunkRecord.objects.filter(session__in=sessions).delete()
    sessions.delete()
    GpuWorker.objects.filter(name=label).delete()
    get_user_model().objects.filter(username=label).delete()
