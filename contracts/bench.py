"""The benchmarks' shared harness: arguments, warm-up and repeats, summaries, the machine, JSON out.

Every benchmark (``manage.py bench_*``, ``python -m workers.benchmarks.migration``) follows one
convention, written here once:

- ``--json`` prints exactly one JSON object on one line and nothing else (progress lines go quiet);
  without it the command prints its figures as text.
- ``--out PATH`` also writes the JSON report, indented, to ``PATH``.
- Every report carries a ``machine`` block (:func:`describe_machine`): figures without the machine
  they were measured on cannot be compared.
- Warm-up rounds run exactly like measured ones and are dropped (:func:`rounds`).
- Latency figures are ``count / p50 / p99 / max / mean`` (:func:`summarize`, numpy's linear
  percentiles); a figure that could not be measured is ``null`` in JSON.

Pure Python (no Django), so the pure benchmarks (the scheduler's, the runtime's, the migration
transport's) use it as the live-loop ones do. The benchmarks themselves live in one package per
app: ``scheduling/benchmarks``, ``sessions/benchmarks``, ``workers/benchmarks``.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import os
import platform
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np
import psutil

# --- arguments ---------------------------------------------------------------------------------


def add_report_arguments(parser: argparse.ArgumentParser) -> None:
    """``--json`` and ``--out``: how every benchmark hands its report over."""
    parser.add_argument("--json", action="store_true", help="print one JSON object only")
    parser.add_argument(
        "--out", default=None, metavar="PATH", help="also write the JSON report (with the machine) here"
    )


def add_warmup_argument(parser: argparse.ArgumentParser, *, default: int, help: str) -> None:
    parser.add_argument("--warmup", type=int, default=default, help=help)


def add_repeats_argument(parser: argparse.ArgumentParser, *, default: int, help: str) -> None:
    parser.add_argument("--repeats", type=int, default=default, help=help)


def add_seed_argument(parser: argparse.ArgumentParser, *, default: int = 0) -> None:
    parser.add_argument(
        "--seed", type=int, default=default, help=f"seed of the synthetic workload (default {default})"
    )


# --- warm-up and repeats -----------------------------------------------------------------------


class Round(NamedTuple):
    index: int  # counts warm-up rounds too, so alternation (who goes first) is decided by it
    measured: bool


def rounds(repeats: int, warmup: int = 0) -> Iterator[Round]:
    """``warmup`` rounds whose figures are dropped, then ``repeats`` measured ones.

    The caller runs the same code in every round and keeps what a measured round produced; that
    way first-touch, pool fills and lazy initialisation land in the warm-up, not in the figures.
    """
    for index in range(warmup + repeats):
        yield Round(index, index >= warmup)


# --- figures -----------------------------------------------------------------------------------


def summarize(values: Iterable[float]) -> dict[str, float | int]:
    """count, p50, p99, max and mean of ``values`` (NaN figures when empty), rounded to 3 places."""
    array = np.fromiter(values, dtype=float)
    if array.size == 0:
        return {"count": 0, "p50": math.nan, "p99": math.nan, "max": math.nan, "mean": math.nan}
    p50, p99 = np.percentile(array, [50, 99])
    return {
        "count": int(array.size),
        "p50": round(float(p50), 3),
        "p99": round(float(p99), 3),
        "max": round(float(array.max()), 3),
        "mean": round(float(array.mean()), 3),
    }


# --- the machine -------------------------------------------------------------------------------


def machine_load() -> dict[str, Any]:
    """What else the machine was doing: load averages (1/5/15 min) and CPU count."""
    one, five, fifteen = os.getloadavg()
    return {"loadavg": [round(one, 2), round(five, 2), round(fifteen, 2)], "cpus": os.cpu_count()}


def _cpu_model() -> str:
    # platform.processor() is empty or just the architecture on Linux; the kernel names the model.
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _torch_and_gpu() -> dict[str, Any]:
    if importlib.util.find_spec("torch") is None:
        return {"torch": None, "gpu": None, "gpus": 0}
    # torch is loaded only to describe the machine, after the figures are measured (the control
    # plane's benchmarks do not otherwise load it).
    import torch

    if not torch.cuda.is_available():
        return {"torch": torch.__version__, "gpu": None, "gpus": 0}
    return {
        "torch": torch.__version__,
        "gpu": torch.cuda.get_device_name(0),
        "gpus": torch.cuda.device_count(),
    }


def describe_machine() -> dict[str, Any]:
    """CPU model and cores, memory, OS, Python and torch versions, and the GPU when there is one."""
    return {
        "cpu": _cpu_model(),
        "cores_physical": psutil.cpu_count(logical=False),
        "cores_logical": psutil.cpu_count(logical=True),
        "memory_bytes": psutil.virtual_memory().total,
        "os": platform.platform(),
        "python": platform.python_version(),
        **_torch_and_gpu(),
        **machine_load(),
    }


# --- JSON and printing -------------------------------------------------------------------------


def _finite(value: Any) -> Any:
    """NaN and infinities (an empty summary) become None, so the JSON is strict."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_finite(v) for v in value]
    return value


def dumps(report: dict[str, Any], *, indent: int | None = None) -> str:
    """Strict JSON of ``report``: one line by default; values JSON does not know are written as text."""
    separators = (",", ":") if indent is None else None
    return json.dumps(_finite(report), separators=separators, indent=indent, allow_nan=False, default=str)


def quiet_unless_text(json_mode: bool, write: Callable[[str], Any]) -> Callable[[str], Any]:
    """Where a benchmark's progress lines go: ``write``, or nowhere under ``--json``."""
    return (lambda *_: None) if json_mode else write


def emit(
    report: dict[str, Any],
    *,
    json_mode: bool,
    out: str | None,
    text: Callable[[dict[str, Any]], str],
    write: Callable[[str], Any] = print,
) -> dict[str, Any]:
    """Add the ``machine`` block, write ``--out``, then print the JSON line or ``text(report)``.

    Returns the report as written. An empty text prints nothing.
    """
    report = {**report, "machine": describe_machine()}
    if out:
        Path(out).write_text(dumps(report, indent=2) + "\n")
    rendered = dumps(report) if json_mode else text(report)
    if rendered:
        write(rendered)
    return report
