"""Run the reproduction plan (optionally in a small process pool) and write the report.

``run_all`` checkpoints every finished unit into ``<out>/results.json``. Experiments not selected in
``experiments`` keep their previous results there (same ``quick`` and ``seed``), so one experiment can
be re-run alone; ``resume=True`` also skips selected units already there with the same parameters (an
interrupted run goes on where it stopped).
"""

from __future__ import annotations

import json
import multiprocessing as mp
import platform
import time
from collections.abc import Callable, Sequence
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from . import paper
from .experiments import EXPERIMENTS, Unit, plan, run_unit

RESULTS_FILE = "results.json"


def _paper_figures() -> dict[str, Any]:
    return {
        "fig4": paper.FIG4,
        "fig7": paper.FIG7,
        "fig8": paper.FIG8,
        "fig9": paper.FIG9,
        "table2": paper.TABLE2,
        "table6": [list(r) for r in paper.TABLE6],
        "tables8_10": paper.TABLES8_10,
    }


def _core_commit() -> str | None:
    """The last git commit that touched the scheduling core or the simulators (None outside a git checkout)."""
    import subprocess

    root = Path(__file__).resolve().parents[2]
    try:
        out = subprocess.run(
            ["git", "log", "-1", "--format=%h", "--", "scheduling/core", "scheduling/sim", "scheduling/data"],
            cwd=root,
            capture_output=True,
            text=True,
            timeout=10,
            check=False,
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() or None


def _load(path: Path) -> dict[str, Any]:
    if path.exists():
        try:
            return json.loads(path.read_text())
        except json.JSONDecodeError:
            return {}
    return {}


def _save(path: Path, data: dict[str, Any]) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(data, indent=1, sort_keys=False, default=_jsonable))
    tmp.replace(path)


def _jsonable(x: Any) -> Any:
    if isinstance(x, tuple):
        return list(x)
    if hasattr(x, "item"):
        return x.item()
    return str(x)


def run_all(
    out: str | Path,
    *,
    quick: bool = False,
    seed: int = 0,
    jobs: int = 1,
    experiments: Sequence[str] = EXPERIMENTS,
    resume: bool = False,
    progress: bool = True,
    log: Callable[[str], None] | None = None,
) -> dict[str, Any]:
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / RESULTS_FILE
    units = plan(quick=quick, seed=seed, experiments=experiments)
    previous = _load(path)
    same_setup = (
        previous.get("meta", {}).get("quick") == quick and previous.get("meta", {}).get("seed") == seed
    )
    done: dict[str, Any] = {}
    if same_setup:
        for key, value in previous.get("units", {}).items():
            # Experiments not selected this time keep their previous results (same --quick and --seed).
            if key.split("/")[0] not in experiments:
                done[key] = value
    todo: list[Unit] = []
    for u in units:
        old = previous.get("units", {}).get(u.key) if same_setup else None
        if (
            resume
            and old
            and not old.get("error")
            and old.get("unit", {}).get("params") == json.loads(json.dumps(u.params, default=_jsonable))
        ):
            done[u.key] = old
            continue
        todo.append(u)
    started = time.perf_counter()
    data: dict[str, Any] = {
        "meta": {
            "command": "python manage.py reproduce_paper",
            "quick": quick,
            "seed": seed,
            "jobs": jobs,
            "experiments": list(experiments),
            "started_utc": datetime.now(UTC).strftime("%Y-%m-%d %H:%M:%S"),
            "python": platform.python_version(),
            "core_commit": _core_commit(),
            "machine": f"{platform.machine()}, {mp.cpu_count()} CPUs",
            "units_run": [u.key for u in todo],
            "units_reused": [u.key for u in units if u not in todo],
        },
        "paper": _paper_figures(),
        "units": done,
    }
    runs: list[dict[str, Any]] = []
    fresh = not resume and set(EXPERIMENTS) <= set(experiments)  # a full run starts a new history
    if same_setup and not fresh:
        pm = previous.get("meta", {})
        runs = list(pm.get("runs", []))
        if not runs and pm.get("wall_s") is not None:
            runs = [
                {
                    k: pm.get(k)
                    for k in ("started_utc", "finished_utc", "wall_s", "jobs", "experiments", "units_run")
                }
            ]
    data["meta"]["runs"] = runs

    bar = None
    if progress:
        try:
            from tqdm import tqdm

            bar = tqdm(total=len(todo), desc="reproduce_paper", unit="unit")
        except ImportError:  # pragma: no cover - tqdm is a dependency
            bar = None

    def finished(key: str, result: dict[str, Any]) -> None:
        done[key] = result
        _save(path, data)
        if bar is not None:
            bar.set_postfix_str(f"{key} {result['unit']['wall_s']:.0f}s")
            bar.update(1)
        if log is not None:
            log(
                f"{key}: {result['unit']['wall_s']:.1f} s"
                + (f" ERROR {result['error']}" if result.get("error") else "")
            )

    if jobs <= 1 or len(todo) <= 1:
        for u in todo:
            finished(*run_unit(u))
    else:
        ctx = mp.get_context("fork")
        with ctx.Pool(processes=jobs, maxtasksperchild=4) as pool:
            for key, result in pool.imap_unordered(run_unit, todo):
                finished(key, result)
    if bar is not None:
        bar.close()
    wall = time.perf_counter() - started
    data["meta"]["wall_s"] = round(wall, 1)
    data["meta"]["finished_utc"] = datetime.now(UTC).strftime("%Y-%m-%d %H:%M:%S")
    if todo:
        runs.append(
            {
                k: data["meta"][k]
                for k in (
                    "started_utc",
                    "finished_utc",
                    "wall_s",
                    "jobs",
                    "experiments",
                    "units_run",
                    "core_commit",
                )
            }
        )
    _save(path, data)

    from .report import write_report

    write_report(out, data)
    return data


def export_summary(run_dir: str | Path, report_dir: str | Path) -> Path:
    """Copy a finished run's headline summary into ``<report_dir>/other_seeds/seed-N.json``; the report of
    ``report_dir`` then shows it beside its own seed (seed sensitivity)."""
    data = _load(Path(run_dir) / RESULTS_FILE)
    if not data.get("summary"):
        raise ValueError(f"{run_dir}: no finished run (results.json without a summary)")
    meta = data["meta"]
    target = Path(report_dir) / "other_seeds"
    target.mkdir(parents=True, exist_ok=True)
    path = target / f"seed-{meta['seed']}{'-quick' if meta['quick'] else ''}.json"
    keep = {
        k: meta.get(k) for k in ("seed", "quick", "started_utc", "finished_utc", "wall_s", "jobs", "runs")
    }
    path.write_text(json.dumps({"meta": keep, "summary": data["summary"]}, indent=1, default=_jsonable))
    return path
