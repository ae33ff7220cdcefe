"""The platform's processes under supervisord: programs, the generated config, the subreaper.

``manage.py runplatform`` runs supervisord (Supervisor, the long-maintained process control
system from PyPI) with a config generated here, so that one crashed process never stops the
rest: each program restarts on its own (``autorestart``), with supervisord's backoff while it
keeps failing to start (``startsecs``/``startretries``: 1 s, 2 s, 3 s … between attempts). The
previous runner, honcho, is a Procfile runner: by design it stops every process when one exits.

GPU workers are not supervisord programs: the scheduler asks the provisioner for them, and the
local provisioner's process tracking (pid + start time, adoption and the orphan sweep in
``reconcile``) is what keeps them owned; ``runplatform`` additionally becomes their
*subreaper* (``PR_SET_CHILD_SUBREAPER``), so a worker whose Celery child died is re-parented to
the platform rather than to PID 1, and reaped by it. See docs/provisioners.md and
docs/production.md.
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import os
import shlex
import socket
import sys
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psutil
import redis
from django.conf import settings

logger = logging.getLogger("scheduling.supervision")


@dataclass(frozen=True)
class Program:
    """One supervised process: a supervisord ``[program:NAME]`` section."""

    name: str
    argv: tuple[str, ...]
    # Seconds a start must survive to count as started; quicker exits are retried with backoff.
    startsecs: int = 3
    # Failed starts in a row before supervisord gives up (FATAL): with its linear backoff, 60
    # attempts span about half an hour, long enough to ride out a PostgreSQL or Redis restart.
    startretries: int = 60
    # SIGTERM → SIGKILL grace: a Celery worker finishes its running tasks (time limit 60 s).
    stopwaitsecs: int = 20


# The command lines of the platform's roles, written once: the supervised platform (``runplatform``),
# the benchmarks' and the soak's platform (``scheduling.benchmarks.platform``) and the end-to-end
# tests' (``tests/e2e/conftest.py``) all start these.


DEPLOYED_ASGI_APP = "controlplane.asgi:application"


def web_argv(
    *, host: str = "127.0.0.1", port: int, python: str | None = None, app: str = DEPLOYED_ASGI_APP
) -> tuple[str, ...]:
    """The ASGI server (HTTP and WebSockets); ``app``: another application only for a benchmark that
    wraps the deployed one (e.g. ``soak --trace-memory``)."""
    return (
        python or sys.executable,
        "-m", "uvicorn", app,
        "--host", host, "--port", str(port),
        # websockets' sans-I/O implementation: the same library, max size and keepalive pings as
        # the legacy one, which uvicorn deprecates. Django's ASGI application has no lifespan
        # protocol: off, rather than probed at each start and reported as unsupported.
        "--ws", "websockets-sansio", "--lifespan", "off", "--no-access-log",
    )  # fmt: skip


def scheduler_argv(*, node_name: str = "scheduler@%h", python: str | None = None) -> tuple[str, ...]:
    """The Celery worker of the scheduler's and default queues (``node_name``: Celery's ``-n``)."""
    return (
        python or sys.executable,
        "-m", "celery", "-A", "controlplane", "worker",
        "-Q", "scheduler,default", "-c", "2", "-n", node_name, "--loglevel", "INFO",
    )  # fmt: skip


def beat_argv(*, schedule: str | Path | None = None, python: str | None = None) -> tuple[str, ...]:
    """Celery beat (``schedule``: its state file, default in the working directory)."""
    extra = ("-s", str(schedule)) if schedule is not None else ()
    return (
        python or sys.executable,
        "-m",
        "celery",
        "-A",
        "controlplane",
        "beat",
        "--loglevel",
        "INFO",
        *extra,
    )


def hostcache_argv(*, models: Sequence[str], python: str | None = None) -> tuple[str, ...]:
    """The host cache holding ``models``' weights for the parameter pool (docs/scaleout.md)."""
    flags = tuple(part for model in models for part in ("--model", model))
    return (python or sys.executable, "manage.py", "hostcache", *flags)


def media_argv(*, python: str | None = None) -> tuple[str, ...]:
    """The media process: WebRTC peer connections beside the web process (docs/media.md)."""
    return (python or sys.executable, "manage.py", "runmedia")


def platform_programs(
    *, host: str, port: int, python: str | None = None, hostcache_models: Sequence[str] = ()
) -> list[Program]:
    """Web server, the scheduler's Celery worker and beat: the platform's long-lived roles; the
    media process when WebRTC runs there (``WEBRTC_MEDIA=process``, the default); and a host cache
    when ``hostcache_models`` names models to keep in this machine's memory."""
    programs = [
        Program("web", web_argv(host=host, port=port, python=python)),
        Program("scheduler", scheduler_argv(python=python), stopwaitsecs=70),
        Program("beat", beat_argv(python=python)),
    ]
    if settings.STREAMSERVE["WEBRTC_MEDIA"] == "process":
        programs.append(Program("media", media_argv(python=python)))
    if hostcache_models:
        programs.append(Program("hostcache", hostcache_argv(models=hostcache_models, python=python)))
    return programs


def guarded_argv(argv: Sequence[str], *, python: str | None = None) -> tuple[str, ...]:
    """``argv`` run through the parent-death wrapper: the program dies with whoever started it."""
    return (python or sys.executable, "-m", "contracts.process", "--", *argv)


def _escape(value: str) -> str:
    # supervisord expands %(name)s in its values: a literal % (Celery's %h) is written %%.
    return value.replace("%", "%%")


def supervisord_config(
    programs: Sequence[Program],
    *,
    run_dir: Path,
    identifier: str = "streamserve",
) -> str:
    """A complete supervisord.conf: foreground, control socket in ``run_dir``, the programs.

    supervisord's own log and the programs' output go to its stdout (the terminal of ``make
    run``), each line once; the control socket serves ``supervisorctl -c
    run_dir/supervisord.conf status`` and the XML-RPC API.
    """
    sock = run_dir / "supervisor.sock"
    lines = [
        "[supervisord]",
        "nodaemon=true",
        # In the foreground supervisord also echoes its log to stdout unless silent: with the log
        # file being /dev/stdout too, every line of its own would print twice.
        "silent=true",
        f"identifier={identifier}",
        "logfile=/dev/stdout",
        # /dev/stdout cannot be rotated (seeked).
        "logfile_maxbytes=0",
        f"pidfile={run_dir / 'supervisord.pid'}",
        f"childlogdir={run_dir}",
        "loglevel=info",
        "",
        "[unix_http_server]",
        f"file={sock}",
        "chmod=0700",
        "",
        "[rpcinterface:supervisor]",
        "supervisor.rpcinterface_factory = supervisor.rpcinterface:make_main_rpcinterface",
        "",
        "[supervisorctl]",
        f"serverurl=unix://{sock}",
        "",
    ]
    for program in programs:
        lines += [
            f"[program:{program.name}]",
            f"command={_escape(shlex.join(guarded_argv(program.argv)))}",
            f"directory={settings.BASE_DIR}",
            "autostart=true",
            "autorestart=true",
            f"startsecs={program.startsecs}",
            f"startretries={program.startretries}",
            "stopsignal=TERM",
            f"stopwaitsecs={program.stopwaitsecs}",
            # The whole group: a Celery worker's pool children and uvicorn's go with their parent.
            "stopasgroup=true",
            "killasgroup=true",
            "redirect_stderr=true",
            "stdout_logfile=/dev/stdout",
            "stdout_logfile_maxbytes=0",
            'environment=PYTHONUNBUFFERED="1"',
            "",
        ]
    return "\n".join(lines)


# --- one beat per broker ---------------------------------------------------------------------------
#
# Two beats on one broker send every periodic task twice (scheduler ticks, ingest, the ledger): a
# stray beat left by a platform killed with SIGKILL, or a second platform started on the same
# database. Beat takes a lease in the broker's Redis at start (SET NX PX, holding ``host:pid``) and
# renews it from a thread; a second beat finds it held, names the holder and exits non-zero. A lease,
# not a lock held forever: a beat killed with SIGKILL frees it within BEAT_LOCK_LEASE_S (at once
# when its holder was on this host and its pid is gone — supervisord's restart of a killed beat).

BEAT_LOCK_KEY = "streamserve:beat:lock"
BEAT_LOCK_LEASE_S = 15.0
# Exit status of a beat that found another one running on its broker.
BEAT_REFUSED_EXIT = 75

# Renew (or take over from ARGV[3]) only what we (or that dead holder) hold: compare-and-set in Redis.
_RENEW = "if redis.call('get', KEYS[1]) == ARGV[1] then return redis.call('pexpire', KEYS[1], ARGV[2]) end return 0"
_TAKE_OVER = (
    "if redis.call('get', KEYS[1]) == ARGV[3] then "
    "return redis.call('set', KEYS[1], ARGV[1], 'PX', ARGV[2]) end return false"
)
_RELEASE = "if redis.call('get', KEYS[1]) == ARGV[1] then return redis.call('del', KEYS[1]) end return 0"


class BeatLockHeld(Exception):
    """Another beat holds the lease: ``holder`` is its ``host:pid``."""

    def __init__(self, holder: str) -> None:
        super().__init__(f"another beat runs on this broker: {holder}")
        self.holder = holder


class BeatLock:
    """The lease of the one beat on a broker; ``client`` is a Redis client of the broker."""

    def __init__(self, client: redis.Redis, *, lease_s: float = BEAT_LOCK_LEASE_S, key: str = BEAT_LOCK_KEY):
        self.client = client
        self.lease_s = lease_s
        self.key = key
        self.holder = f"{socket.gethostname()}:{os.getpid()}"
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    @property
    def _px(self) -> int:
        return max(1, int(self.lease_s * 1000))

    def acquire(self) -> None:
        """Take the lease or raise ``BeatLockHeld`` naming the holder."""
        if self.client.set(self.key, self.holder, nx=True, px=self._px):
            return
        raw = self.client.get(self.key)
        other = raw.decode() if raw is not None else ""
        if (
            other
            and self._dead_here(other)
            and self.client.eval(_TAKE_OVER, 1, self.key, self.holder, self._px, other)
        ):
            logger.warning("beat.lock_taken_over from=%s (its process is gone)", other)
            return
        if not other and self.client.set(self.key, self.holder, nx=True, px=self._px):
            return  # expired between the two calls
        raise BeatLockHeld(other or "unknown")

    @staticmethod
    def _dead_here(holder: str) -> bool:
        host, _, pid = holder.rpartition(":")
        return host == socket.gethostname() and pid.isdigit() and not psutil.pid_exists(int(pid))

    def renew(self) -> bool:
        """Extend the lease; False when it is no longer ours."""
        return bool(self.client.eval(_RENEW, 1, self.key, self.holder, self._px))

    def release(self) -> None:
        self._stop.set()
        with contextlib.suppress(redis.RedisError):
            self.client.eval(_RELEASE, 1, self.key, self.holder)

    def keep(self, on_lost: Callable[[str], None]) -> None:
        """Renew the lease every third of it from a daemon thread; ``on_lost(holder)`` if another
        beat has it by then. A Redis outage is not a loss: beat cannot publish either."""

        def renewing() -> None:
            while not self._stop.wait(self.lease_s / 3):
                try:
                    if self.renew():
                        continue
                    self.acquire()  # expired during an outage, or Redis came back empty
                except BeatLockHeld as exc:
                    on_lost(exc.holder)
                    return
                except redis.RedisError as exc:
                    logger.warning("beat.lock_renew failed: %s", exc)

        self._thread = threading.Thread(target=renewing, name="beat-lock", daemon=True)
        self._thread.start()


def _refuse(holder: str, *, lost: bool) -> None:
    what = (
        "beat.lock_lost: another beat took this broker's lease" if lost else "beat.refused: another beat runs"
    )
    logger.error("%s holder=%s; exiting (one beat per broker)", what, holder)
    logging.shutdown()
    os._exit(BEAT_REFUSED_EXIT)


def beat_lock_take(**_: Any) -> None:
    """``beat_init``: take the broker's beat lease for this process, or exit naming the holder."""
    lock = BeatLock(
        redis.Redis.from_url(settings.CELERY_BROKER_URL, socket_connect_timeout=5, socket_timeout=5)
    )
    try:
        lock.acquire()
    except BeatLockHeld as exc:
        _refuse(exc.holder, lost=False)
    except redis.RedisError as exc:
        logger.error("beat.lock unavailable: broker %s: %s; exiting", settings.CELERY_BROKER_URL, exc)
        logging.shutdown()
        os._exit(BEAT_REFUSED_EXIT)
    logger.info("beat.lock held=%s lease=%.0fs", lock.holder, lock.lease_s)
    atexit.register(lock.release)
    lock.keep(lambda holder: _refuse(holder, lost=True))
