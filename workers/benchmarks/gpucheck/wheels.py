"""Carried wheels: packages the GPU machine lacks (diffusers, Pillow, …) travel with the working tree
as wheel files (``var/wheels/``, fetched beforehand with ``pip download --no-deps``; docs/gpu-check.md)
and are unpacked here into a scratch folder appended to ``sys.path``.

No pip and no network: a wheel is a zip archive laid out as its site-packages entries, so unpacking it
is what an install does for the import system (console scripts and byte-compilation are not needed).
A wheel whose distribution is already installed on the machine is left alone — the machine's copy
wins, being the one its other packages were installed against — and so is a wheel built for another
Python or platform; the report lists each with what was done and why.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import platform
import re
import sys
import zipfile
from pathlib import Path
from typing import Any

_WHEEL = re.compile(
    r"^(?P<name>[^-]+)-(?P<version>[^-]+)(-(?P<build>\d[^-]*))?-(?P<python>[^-]+)-(?P<abi>[^-]+)-(?P<platform>[^-]+)\.whl$"
)


def parse_wheel_name(filename: str) -> dict[str, str] | None:
    match = _WHEEL.match(filename)
    if match is None:
        return None
    parts = match.groupdict()
    parts["distribution"] = re.sub(r"[-_.]+", "-", parts["name"]).lower()
    return parts


def wheel_fits(
    parts: dict[str, str], *, version: tuple[int, int] | None = None, machine: str | None = None
) -> str | None:
    """None when the wheel can be imported by this interpreter on this machine, else why not."""
    major, minor = version or sys.version_info[:2]
    arch = machine or platform.machine()
    pythons = parts["python"].split(".")
    cpython = f"cp{major}{minor}"
    fits_python = any(tag in ("py3", f"py{major}", f"py{major}{minor}", cpython) for tag in pythons)
    if not fits_python and parts["abi"] == "abi3":
        # abi3: built for CPython 3.N, loadable by every later 3.x.
        fits_python = any(
            tag.startswith("cp3") and tag[3:].isdigit() and int(tag[3:]) <= minor for tag in pythons
        )
    if not fits_python:
        return f"built for {parts['python']}, this is CPython {major}.{minor}"
    platforms = parts["platform"].split(".")
    if "any" in platforms:
        return None
    if sys.platform.startswith("linux") and any(
        (tag.startswith("manylinux") or tag.startswith("linux")) and tag.endswith(arch) for tag in platforms
    ):
        return None
    return f"built for {parts['platform']}, this is {sys.platform} {arch}"


def installed_version(distribution: str) -> str | None:
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return None


def use_carried_wheels(wheel_dir: Path, site_dir: Path) -> list[dict[str, Any]]:
    """Unpack the wheels of ``wheel_dir`` that this machine lacks into ``site_dir`` and append it to
    ``sys.path``; returns one entry per wheel file: ``{"wheel", "distribution", "version", "action",
    "reason"?}`` with action ``unpacked``, ``present`` (the machine has it) or ``unusable``."""
    entries: list[dict[str, Any]] = []
    if not wheel_dir.is_dir():
        return entries
    unpacked = False
    for path in sorted(wheel_dir.glob("*.whl")):
        parts = parse_wheel_name(path.name)
        if parts is None:
            entries.append({"wheel": path.name, "action": "unusable", "reason": "not a wheel file name"})
            continue
        entry: dict[str, Any] = {
            "wheel": path.name,
            "distribution": parts["distribution"],
            "version": parts["version"],
        }
        present = installed_version(parts["distribution"])
        why_not = wheel_fits(parts)
        if present is not None:
            entry.update(action="present", reason=f"the machine has {parts['distribution']} {present}")
        elif why_not is not None:
            entry.update(action="unusable", reason=why_not)
        else:
            site_dir.mkdir(parents=True, exist_ok=True)
            with zipfile.ZipFile(path) as archive:
                archive.extractall(site_dir)
            entry["action"] = "unpacked"
            unpacked = True
        entries.append(entry)
    if unpacked and str(site_dir) not in sys.path:
        # Appended: whatever the machine has installed is found first.
        sys.path.append(str(site_dir))
        importlib.invalidate_caches()
    return entries
