"""The layering the project declares (pyproject ``[tool.importlinter]``) holds, and would catch a break.

Also: no function-level import of the project's own apps without a comment that gives a reason
(an import cycle is not one: it means the layering is wrong).
"""

from __future__ import annotations

import ast
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
APPS = ("controlplane", "contracts", "sessions", "scheduling", "gpu", "workers")
LINT_IMPORTS = Path(sys.executable).with_name("lint-imports")


def lint_imports(cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [str(LINT_IMPORTS), "--no-cache"], cwd=cwd, capture_output=True, text=True, timeout=300
    )


def test_every_contract_holds():
    result = lint_imports(ROOT)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "0 broken" in result.stdout


@pytest.mark.parametrize(
    ("module", "line", "contract"),
    [
        ("gpu/services.py", "import sessions.models", "gpu knows nothing of sessions or the scheduler"),
        ("scheduling/core/placement.py", "import django.db", "scheduling.core is pure Python"),
        ("workers/runtime/engine.py", "import scheduling.models", "workers.runtime is pure PyTorch"),
        ("workers/daemon/worker.py", "import sessions.models", "the worker reaches the control plane only"),
        ("workers/hostcache.py", "import gpu.models", "the worker reaches the control plane only"),
        ("workers/daemon/streams.py", "import django.db", "the worker reaches the control plane only"),
        ("workers/daemon/streams.py", "import workers.adapters.reporting", "the Django adapters are wired"),
        ("sessions/services.py", "import scheduling.live.run", "events flow one way"),
        ("contracts/wire/frames.py", "import workers.daemon", "the shared contracts know no app"),
        ("contracts/catalog/presets.py", "import torch", "the wire and the catalogue are pure Python"),
        # Service and lab apart (issue 24): the live loop, the top modules and the pure core of the
        # service never import the simulators, the reproductions or the benchmarks.
        ("scheduling/live/run.py", "import scheduling.sim.jobs.cosim", "no service module imports the lab"),
        ("scheduling/tasks.py", "import scheduling.reproduce.runner", "no service module imports the lab"),
        ("scheduling/api.py", "import scheduling.benchmarks.scheduler", "no service module imports the lab"),
        ("scheduling/core/jobs/policy.py", "import contracts.bench", "no service module imports the lab"),
        ("scheduling/core/turboserve.py", "import scheduling.sim.traces", "scheduling.core is pure Python"),
        ("scheduling/sim/simulator.py", "import django.db", "scheduling.sim is pure Python"),
        ("scheduling/sim/traces.py", "import scheduling.reproduce.torta", "scheduling.sim is pure Python"),
        (
            "scheduling/reproduce/genserve.py",
            "import scheduling.models",
            "scheduling.reproduce is pure Python",
        ),
    ],
)
def test_a_forbidden_import_breaks_its_contract(tmp_path, module, line, contract):
    # A copy of the packages and the contracts, with one forbidden import added.
    for app in APPS:
        shutil.copytree(ROOT / app, tmp_path / app, ignore=shutil.ignore_patterns("__pycache__", "*.json"))
    shutil.copy(ROOT / "pyproject.toml", tmp_path / "pyproject.toml")
    target = tmp_path / module
    target.write_text(target.read_text() + f"\n{line}  # noqa\n")
    result = lint_imports(tmp_path)
    assert result.returncode != 0
    broken = result.stdout.split("Broken contracts", 1)[1]
    importer = module.removesuffix(".py").replace("/", ".")
    assert contract in broken and importer in broken


def test_an_import_circle_in_workers_breaks_its_contract(tmp_path):
    # A copy where the job runner imports the daemon that composes it.
    for app in APPS:
        shutil.copytree(ROOT / app, tmp_path / app, ignore=shutil.ignore_patterns("__pycache__", "*.json"))
    shutil.copy(ROOT / "pyproject.toml", tmp_path / "pyproject.toml")
    target = tmp_path / "workers/daemon/jobs.py"
    target.write_text(target.read_text() + "\nimport workers.daemon.worker  # noqa\n")
    result = lint_imports(tmp_path)
    assert result.returncode != 0
    broken = result.stdout.split("Broken contracts", 1)[1]
    assert "no import circle in workers" in broken and ".jobs -> .worker" in broken


# The lab of the scheduling app (issue 24): where simulators, reproductions and benchmarks live. The
# research commands in scheduling/management/commands are the lab's too and say so in their help.
SCHEDULING_LAB = ("scheduling.sim", "scheduling.reproduce", "scheduling.benchmarks")
LAB_HELP = ("Research tool (lab): ", "Benchmark (lab): ")


def _contract(contract_id: str) -> dict:
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())
    return next(c for c in config["tool"]["importlinter"]["contracts"] if c["id"] == contract_id)


def _command_help(path: Path) -> str:
    """The ``help`` of a management command's ``Command`` class, read without importing it."""
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Assign) and [getattr(t, "id", None) for t in node.targets] == ["help"]:
            return ast.literal_eval(node.value)
    return ""


def test_every_scheduling_module_is_service_or_lab():
    # A module the service contract does not cover would be free to import the lab: every top-level
    # module and package of scheduling is either one of the contract's sources or in the lab, and
    # every management command either runs the platform (a source) or says it is a research tool.
    service = set(_contract("service-not-lab")["source_modules"])
    top = {
        f"scheduling.{path.stem if path.suffix else path.name}"
        for path in (ROOT / "scheduling").iterdir()
        if (path.suffix == ".py" and path.stem != "__init__") or (path / "__init__.py").exists()
    }
    unclassified = top - service - set(SCHEDULING_LAB) - {"scheduling.management"}
    assert unclassified == set(), (
        f"neither service (pyproject service-not-lab) nor lab: {sorted(unclassified)}"
    )
    commands = sorted((ROOT / "scheduling/management/commands").glob("[!_]*.py"))
    unmarked = [
        path.stem
        for path in commands
        if f"scheduling.management.commands.{path.stem}" not in service
        and not _command_help(path).startswith(LAB_HELP)
    ]
    assert unmarked == [], (
        f"commands neither in the service contract nor marked as lab in their help: {unmarked}"
    )
    mislabelled = [
        path.stem
        for path in commands
        if f"scheduling.management.commands.{path.stem}" in service
        and _command_help(path).startswith(LAB_HELP)
    ]
    assert mislabelled == [], f"service commands whose help calls them lab: {mislabelled}"


def _function_level_imports(path: Path):
    source = path.read_text()
    lines = source.splitlines()
    tree = ast.parse(source)
    for func in ast.walk(tree):
        if not isinstance(func, ast.FunctionDef | ast.AsyncFunctionDef):
            continue
        body = list(ast.walk(func))
        imports = [n for n in body if isinstance(n, ast.Import | ast.ImportFrom)]
        for node in imports:
            names = [node.module or ""] if isinstance(node, ast.ImportFrom) else [a.name for a in node.names]
            if any(name.split(".")[0] in APPS for name in names):
                yield node.lineno, lines


def _reason_above(lineno: int, lines: list[str]) -> str | None:
    """The comment block right above the import (or its block of imports), if any."""
    i = lineno - 2
    while i >= 0 and lines[i].strip().startswith(("from ", "import ")):
        i -= 1
    comment = []
    while i >= 0 and lines[i].strip().startswith("#"):
        comment.append(lines[i].strip())
        i -= 1
    return " ".join(reversed(comment)) or None


def test_no_function_level_import_of_the_project_without_a_reason():
    offenders = []
    for app in APPS:
        for path in sorted((ROOT / app).rglob("*.py")):
            if "migrations" in path.parts:
                continue
            for lineno, lines in _function_level_imports(path):
                reason = _reason_above(lineno, lines)
                if reason is None or "cycle" in reason.lower() or "circular" in reason.lower():
                    offenders.append(f"{path.relative_to(ROOT)}:{lineno}")
    assert offenders == [], "function-level imports of the project without a reason: " + ", ".join(offenders)
