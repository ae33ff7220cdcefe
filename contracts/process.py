"""No process outlives the platform that started it by accident: the parent-death signal.

A process manager (or an operator) that stops the platform with SIGKILL gives it no chance to stop
its children: without help they are re-parented to PID 1 and go on (issue 31: a GPU worker
generating for nobody for 55 minutes, a second Celery beat doubling every periodic task). Linux's
``PR_SET_PDEATHSIG`` makes the kernel signal a process when the thread that started it exits,
whatever killed it; the setting survives ``execve``, so a small exec wrapper
(``python -m contracts.process -- ARGV``) gives it to any program — supervisord's programs are
started that way.

The race it leaves: the parent may die between ``fork`` and ``prctl``. The spawner therefore
names itself in ``STREAMSERVE_PARENT_PID``; a child whose parent is already someone else exits at
once. ``STREAMSERVE_PLATFORM_PID`` names ``runplatform``, the child subreaper: a process
re-parented to it (its own parent, say a Celery pool child, died while the platform lives) is
still the platform's and stays; one re-parented anywhere else has lost it.

Off Linux everything here is a no-op with a log line: the orphan timeout of the worker
(``WORKER_ORPHAN_TIMEOUT_S``) and ``reconcile``'s orphan sweep remain.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import os
import signal
import sys
from types import FrameType

logger = logging.getLogger("contracts.process")

PARENT_PID_ENV = "STREAMSERVE_PARENT_PID"
PLATFORM_PID_ENV = "STREAMSERVE_PLATFORM_PID"

# linux/prctl.h
PR_SET_PDEATHSIG = 1
PR_SET_CHILD_SUBREAPER = 36

# Exit status of a process that found its parent gone before it could ask to die with it.
ORPHANED_AT_START = 70


def _prctl(option: int, value: int) -> bool:
    if not sys.platform.startswith("linux"):
        return False
    libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
    return libc.prctl(option, value, 0, 0, 0) == 0


def become_subreaper() -> bool:
    """Make orphaned descendants re-parent to this process rather than to PID 1.

    Linux only; returns whether it applied. The caller must then reap them (``os.waitpid(-1)``).
    """
    applied = _prctl(PR_SET_CHILD_SUBREAPER, 1)
    if not applied:
        logger.info("process.subreaper unavailable platform=%s", sys.platform)
    return applied


def _env_pid(name: str, environ: dict[str, str] | os._Environ[str]) -> int | None:
    text = environ.get(name, "")
    return int(text) if text.isdigit() else None


def platform_pid() -> int | None:
    """``runplatform``'s pid when this process runs under it (inherited through the environment)."""
    return _env_pid(PLATFORM_PID_ENV, os.environ)


def parent_lost(expected_parent: int | None) -> bool:
    """Whether this process's starter is gone: its parent is not the one that started it (nor the
    platform's subreaper that adopts a process whose starter died while the platform lives).

    Without an expected parent, a parent that is PID 1 is the only sign (a process started by
    supervisord, never by init).
    """
    parent = os.getppid()
    if parent == platform_pid():
        return False
    if expected_parent is not None:
        return parent != expected_parent
    return parent == 1


def die_with_parent(*, signum: int = signal.SIGTERM, expected_parent: int | None = None) -> bool:
    """Ask the kernel for ``signum`` when the parent dies; exit now if it already has.

    ``expected_parent`` defaults to ``STREAMSERVE_PARENT_PID`` (which is then removed from the
    environment, so this process's own children do not inherit a pid that is not theirs). Returns
    whether the signal was set (False off Linux).
    """
    if expected_parent is None:
        expected_parent = _env_pid(PARENT_PID_ENV, os.environ)
    os.environ.pop(PARENT_PID_ENV, None)
    applied = _prctl(PR_SET_PDEATHSIG, signum)
    if not applied:
        logger.info(
            "process.pdeathsig unavailable platform=%s: orphans are left to the timeouts", sys.platform
        )
        return False
    if parent_lost(expected_parent):
        # The parent died between our fork and the prctl: the signal will never come.
        logger.warning(
            "process.orphaned_at_start pid=%d parent=%d expected=%s",
            os.getpid(),
            os.getppid(),
            expected_parent,
        )
        os._exit(ORPHANED_AT_START)
    return True


def stop_when_orphaned(expected_parent: int | None = None) -> bool:
    """For a long-lived process with its own graceful stop on SIGTERM (a GPU worker).

    Its parent's death sends SIGUSR2 here; if the process was re-parented to the platform's
    subreaper (the platform lives; only the process that spawned it, a Celery pool child, died) it
    goes on, else it sends itself SIGTERM, so whatever SIGTERM does now (before the daemon runs:
    terminate; after: checkpoint and stop) happens.
    """

    def parent_died(signum: int, frame: FrameType | None) -> None:
        if parent_lost(expected_parent):
            logger.warning("process.parent_gone pid=%d parent=%d: stopping", os.getpid(), os.getppid())
            os.kill(os.getpid(), signal.SIGTERM)
        else:
            logger.info(
                "process.reparented pid=%d parent=%d (the platform): going on", os.getpid(), os.getppid()
            )

    if expected_parent is None:
        expected_parent = _env_pid(PARENT_PID_ENV, os.environ)
    signal.signal(signal.SIGUSR2, parent_died)
    return die_with_parent(signum=signal.SIGUSR2, expected_parent=expected_parent)


def main(argv: list[str]) -> None:
    """``python -m contracts.process [--] PROGRAM ARGS…``: die with the parent, then exec PROGRAM."""
    if argv and argv[0] == "--":
        argv = argv[1:]
    if not argv:
        sys.stderr.write("usage: python -m contracts.process [--] PROGRAM [ARGS...]\n")
        sys.exit(2)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s %(message)s")
    die_with_parent()
    os.execvp(argv[0], argv)


if __name__ == "__main__":
    main(sys.argv[1:])
