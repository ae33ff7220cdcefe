#!/usr/bin/env python3
"""The GPU check (docs/gpu-check.md): ``make gpu-check OUT=<dir>`` on a GPU machine, ``DRY=1`` on a CPU.

Runs with whatever ``python3`` the machine has, from the repository root, with the worker runtime
alone (no Django, no services, no network); packages the machine lacks come from carried wheels
(``--wheels``, default ``var/wheels``). Writes ``gpu-check.json``, ``gpu-check.txt`` and
``gpu-profile.json`` to ``--out``.
"""

from __future__ import annotations

import time

STARTED = time.time()  # the budget counts the interpreter's imports too

import sys  # noqa: E402
from pathlib import Path  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # the project is not installed: imports resolve from the repository

from workers.benchmarks.gpucheck.run import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:], started=STARTED, repo_root=ROOT))
