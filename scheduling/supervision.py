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

import shlex
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from django.conf import settings


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


def web_argv(*, host: str = "127.0.0.1", port: int, python: str | None = None) -> tuple[str, ...]:
    """The ASGI server (HTTP and WebSockets)."""
    return (
        python or sys.executable,
        "-m", "uvicorn", "controlplane.asgi:application",
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


def platform_programs(
    *, host: str, port: int, python: str | None = None, hostcache_models: Sequence[str] = ()
) -> list[Program]:
    """Web server, the scheduler's Celery worker and beat: the platform's long-lived roles; and a
    host cache when ``hostcache_models`` names models to keep in this machine's memory."""
    programs = [
        Program("web", web_argv(host=host, port=port, python=python)),
        Program("scheduler", scheduler_argv(python=python), stopwaitsecs=70),
        Program("beat", beat_argv(python=python)),
    ]
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
