"""Shared pieces of the live-loop benchmarks (``bench_ingest``, ``bench_delivery``, ``bench_activation``).

Service checks, the benchmark database and its throwaway rows, and a group of child processes that
is always torn down (own process groups, SIGTERM then SIGKILL, also on Ctrl-C). Arguments, figures,
the machine and JSON are the shared harness's (:mod:`contracts.bench`).

Why a dedicated database: the benchmarks start their own platform processes (ASGI server, Celery,
local workers) and create throwaway rows. In the configured database a developer's running
platform would schedule those rows onto its own workers, and the local provisioner's
``release_all`` releases *every* live local worker recorded there. The benchmark database lives
on the same PostgreSQL server (``<configured name>_bench`` by default), is created and migrated on
demand, and every row a benchmark creates is deleted when it ends.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any
from urllib.parse import urlparse, urlunparse

import psycopg
import redis
from django.conf import settings
from django.core.management import call_command
from django.db import connections
from django.utils import timezone
from psycopg import sql

from gpu.models import GpuWorker
from sessions import lifecycle
from sessions.models import GenerationSession

BENCH_BROKER_DB = (
    14  # Celery broker of the benchmark's processes: a developer's platform never takes their tasks
)
BENCH_REDIS_DB = 15  # channel layer, cache and scheduler lock of bench_activation's platform


class ServiceUnavailable(Exception):
    """PostgreSQL or Redis does not answer (the message says which)."""


class BenchmarkFailed(Exception):
    """The run could not complete: a platform process died, a request was refused (the message says)."""


# --- services and the benchmark database -------------------------------------------------------


def postgres_params(settings_dict: dict[str, Any], dbname: str | None = None) -> dict[str, Any]:
    """psycopg connection keywords from a Django ``DATABASES`` entry."""
    params = {
        "dbname": dbname or settings_dict["NAME"],
        "user": settings_dict.get("USER") or None,
        "password": settings_dict.get("PASSWORD") or None,
        "host": settings_dict.get("HOST") or None,
        "port": settings_dict.get("PORT") or None,
        "connect_timeout": 5,
    }
    return {k: v for k, v in params.items() if v not in (None, "")}


def database_url(settings_dict: dict[str, Any], dbname: str) -> str:
    """A ``DATABASE_URL`` for child processes pointing at ``dbname`` on the same server."""
    user = settings_dict.get("USER") or ""
    password = settings_dict.get("PASSWORD") or ""
    auth = f"{user}:{password}@" if password else (f"{user}@" if user else "")
    host = settings_dict.get("HOST") or "127.0.0.1"
    port = settings_dict.get("PORT") or 5432
    return f"postgres://{auth}{host}:{port}/{dbname}"


def check_postgres(settings_dict: dict[str, Any]) -> None:
    params = postgres_params(settings_dict, dbname="postgres")
    try:
        with psycopg.connect(**params) as conn:
            conn.execute("SELECT 1")
    except psycopg.Error as exc:
        where = f"{params.get('host', 'localhost')}:{params.get('port', 5432)}"
        raise ServiceUnavailable(f"PostgreSQL at {where} does not answer (DATABASE_URL): {exc}") from exc


def check_redis(url: str) -> None:
    try:
        redis.Redis.from_url(url, socket_connect_timeout=3).ping()
    except redis.RedisError as exc:
        raise ServiceUnavailable(f"Redis at {redact(url)} does not answer (REDIS_URL): {exc}") from exc


def redact(url: str) -> str:
    parsed = urlparse(url)
    if parsed.password:
        parsed = parsed._replace(netloc=parsed.netloc.replace(f":{parsed.password}@", ":***@"))
    return urlunparse(parsed)


def redis_url_with_db(url: str, db: int) -> str:
    """The same Redis server, logical database ``db``."""
    parsed = urlparse(url)
    if parsed.scheme == "unix":
        query = "&".join(p for p in parsed.query.split("&") if p and not p.startswith("db=")) + f"&db={db}"
        return urlunparse(parsed._replace(query=query.lstrip("&")))
    return urlunparse(parsed._replace(path=f"/{db}"))


def ensure_database(settings_dict: dict[str, Any], dbname: str) -> bool:
    """Create ``dbname`` on the configured server unless it exists; returns whether it was created."""
    with psycopg.connect(**postgres_params(settings_dict, dbname="postgres"), autocommit=True) as conn:
        exists = conn.execute("SELECT 1 FROM pg_database WHERE datname = %s", (dbname,)).fetchone()
        if exists:
            return False
        conn.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(dbname)))
        return True


# --- child processes ---------------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def port_open(port: int, host: str = "127.0.0.1") -> bool:
    try:
        with socket.create_connection((host, port), timeout=0.5):
            return True
    except OSError:
        return False


def wait_until(
    predicate: Callable[[], Any],
    timeout: float,
    what: str,
    interval: float = 0.2,
    alive: Callable[[], str | None] | None = None,
) -> Any:
    """Poll ``predicate`` until truthy; TimeoutError naming ``what`` (or why ``alive`` says we stopped)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        if alive is not None and (dead := alive()):
            raise RuntimeError(f"while waiting for {what}: {dead}")
        time.sleep(interval)
    raise TimeoutError(f"timed out after {timeout:.0f}s waiting for {what}")


class ProcessGroup:
    """Child processes, each in its own session/process group, stopped together on exit.

    Use as a context manager: leaving it (normally, on an exception or on Ctrl-C) sends SIGTERM to
    every group, waits ``grace_s`` and SIGKILLs the stragglers. While it is open, SIGTERM to the
    benchmark itself is turned into ``KeyboardInterrupt`` so the same clean-up runs.
    """

    def __init__(self, log_dir: Path, env: dict[str, str], cwd: Path, grace_s: float = 10.0) -> None:
        self.log_dir = Path(log_dir)
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.env = env
        self.cwd = cwd
        self.grace_s = grace_s
        self.processes: dict[str, subprocess.Popen] = {}
        self.services: set[str] = set()
        self._previous_sigterm: Any = None

    def spawn(self, name: str, *args: str, python: bool = True, service: bool = True) -> subprocess.Popen:
        """Start a child; a ``service`` (server, Celery) must keep running, a task may exit with 0."""
        argv = [sys.executable, *args] if python else list(args)
        with open(self.log_dir / f"{name}.log", "wb") as log:
            process = subprocess.Popen(
                argv,
                cwd=self.cwd,
                env=self.env,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        self.processes[name] = process
        if service:
            self.services.add(name)
        return process

    def dead(self) -> str | None:
        """A line naming the first service that exited or task that failed (with its log's tail), else None."""
        for name, process in self.processes.items():
            if process.poll() is not None and (name in self.services or process.returncode != 0):
                return f"{name} exited with code {process.returncode}: {self.log_tail(name)}"
        return None

    def log_tail(self, name: str, limit: int = 600) -> str:
        try:
            text = (self.log_dir / f"{name}.log").read_text(errors="replace")
        except OSError:
            return ""
        return " | ".join(line.strip() for line in text.strip().splitlines()[-4:])[-limit:]

    def stop(self) -> None:
        for process in self.processes.values():
            if process.poll() is None:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(process.pid, signal.SIGTERM)
        deadline = time.monotonic() + self.grace_s
        for process in self.processes.values():
            with contextlib.suppress(subprocess.TimeoutExpired):
                process.wait(timeout=max(deadline - time.monotonic(), 0.1))
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(process.pid, signal.SIGKILL)  # stragglers of the group, or the process itself
            with contextlib.suppress(subprocess.TimeoutExpired):
                process.wait(timeout=5)

    def __enter__(self) -> ProcessGroup:
        def interrupt(signum, frame):
            raise KeyboardInterrupt(f"signal {signum}")

        with contextlib.suppress(ValueError):  # not the main thread: leave SIGTERM alone
            self._previous_sigterm = signal.signal(signal.SIGTERM, interrupt)
        return self

    def __exit__(self, *exc_info) -> None:
        try:
            self.stop()
        finally:
            if self._previous_sigterm is not None:
                with contextlib.suppress(ValueError):
                    signal.signal(signal.SIGTERM, self._previous_sigterm)


# --- the benchmark database and its rows ------------------------------------------------------


def use_bench_database(name: str | None, *, migrate: bool = True) -> dict[str, Any]:
    """Point this process's ``default`` connection at database ``name`` on the configured server.

    ``None`` means ``<configured name>_bench``. The database is created if missing and migrated.
    When ``name`` is the database already in use (the smoke tests pass the test database), nothing
    changes. Returns the connection's settings (for child processes' ``DATABASE_URL``).
    Raises ``ServiceUnavailable`` when PostgreSQL does not answer.
    """
    current = connections["default"].settings_dict
    check_postgres(current)
    target = name or f"{current['NAME']}_bench"
    if target != current["NAME"]:
        ensure_database(current, target)
        connections["default"].close()
        current["NAME"] = target
        settings.DATABASES["default"]["NAME"] = target
        if migrate:
            call_command("migrate", verbosity=0, interactive=False)
    return current


def bench_sessions(
    *, label: str, owner: Any, count: int, model_name: str = "tiny"
) -> tuple[GpuWorker, list[GenerationSession]]:
    """A released worker row and ``count`` sessions that look as if they execute on it.

    Released, so no scheduler places anything on it; chunk records may still reference it.
    """
    now = timezone.now()
    worker = GpuWorker.objects.create(
        name=label,
        status=GpuWorker.Status.RELEASED,
        requested_at=now - timedelta(seconds=1),
        ready_at=now,
        released_at=now,
        provider="static",
        host="bench",
    )
    sessions = GenerationSession.objects.bulk_create(
        GenerationSession(
            owner=owner,
            model_name=model_name,
            width=64,
            height=64,
            fps=8,
            frames_per_chunk=4,
            seed=n,
        )
        for n in range(count)
    )
    for session in sessions:  # placed through the lifecycle, like every status change
        lifecycle.session_place(session=session, worker=worker)
    return worker, sessions
