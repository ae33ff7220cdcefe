"""The GPU check kit (issue 28): its CPU dry run end to end, and its parts (report, budget, carried
wheels, targets). The dry run is the same code a GPU machine runs, at tiny sizes, so it cannot rot."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from scheduling.core.gpu_profiles import BUILTIN_PROFILES, profile_from_json
from workers.benchmarks.gpucheck import report as gc_report
from workers.benchmarks.gpucheck import sections, wheels
from workers.benchmarks.gpucheck.run import PLAN

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def dry_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("gpu-check")
    env = {k: v for k, v in os.environ.items() if k != "DJANGO_SETTINGS_MODULE"}
    done = subprocess.run(
        [sys.executable, "scripts/gpu_check.py", "--dry", "--out", str(out)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=180,
    )
    return done, out


@pytest.mark.e2e
@pytest.mark.slow
def test_the_dry_run_writes_a_complete_report(dry_run):
    # given the check run as `make gpu-check DRY=1` runs it
    done, out = dry_run
    # then it succeeded and wrote the JSON, the text summary and the profile
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    data = json.loads((out / "gpu-check.json").read_text())
    assert data["kind"] == gc_report.REPORT_KIND and data["mode"] == "dry" and data["dry_run"] is True
    assert data["finished"] is True
    assert data["wall_s"] > 0.0  # measured; its size is the benchmark's business, not this test's
    # every planned section is named, none failed, and a skipped one says why
    assert list(data["sections"]) == [name for name, *_ in PLAN]
    for name, section in data["sections"].items():
        assert section["status"] in ("ok", "skipped"), (
            name,
            section.get("reason"),
            section["figures"].get("traceback"),
        )
        if section["status"] == "skipped":
            assert section["reason"], name
    assert data["failed"] == []
    # the check imported no Django, and names the machine every figure was measured on
    env = data["environment"]
    assert env["django_imported"] is False
    assert {"device_name", "driver", "torch", "cuda", "python", "packages", "gpu_paths_settings"} <= set(env)
    text = (out / "gpu-check.txt").read_text()
    assert "CPU DRY RUN" in text


@pytest.mark.e2e
@pytest.mark.slow
def test_the_dry_run_names_the_nccl_section_it_cannot_run(dry_run):
    _, out = dry_run
    data = json.loads((out / "gpu-check.json").read_text())
    nccl = data["sections"]["nccl"]
    assert nccl["status"] == "skipped"
    assert "NCCL" in nccl["reason"] and "two" in nccl["reason"]
    assert {"section": "nccl", "reason": nccl["reason"]} in data["skipped"]
    assert "nccl [skipped]" in (out / "gpu-check.txt").read_text()


@pytest.mark.e2e
@pytest.mark.slow
def test_the_dry_run_measures_the_model_sections_and_judges_no_target(dry_run):
    _, out = dry_run
    data = json.loads((out / "gpu-check.json").read_text())
    figures = {name: s["figures"] for name, s in data["sections"].items()}
    if data["sections"]["chunk_latency"]["status"] == "ok":
        rows = figures["chunk_latency"]["rows"]
        assert [r["batch"] for r in rows] == list(sections.Plan.dry().batches)
        for row in rows:
            assert row["step_ms"]["p50"] > 0 and row["step_ms"]["p99"] >= row["step_ms"]["p50"]
            assert row["frames_per_s_total"] == pytest.approx(
                row["frames_per_s_per_session"] * row["batch"], rel=1e-3
            )
            assert row["vae_decode_ms"] > 0
        # the scheduler's simulator loads the profile the check wrote
        profile = json.loads((out / "gpu-check.json").read_text())["profile"]
        assert profile == json.loads((out / "gpu-profile.json").read_text())
        spec = profile_from_json(profile)
        assert spec.slo_ms == sections.H100_1_3B_SLO_MS
        assert [load for load, _ in profile["latency_ms"]] == [r["batch"] for r in rows]
    if data["sections"]["memory"]["status"] == "ok":
        assert figures["memory"]["measured_bytes"] == figures["memory"]["estimate_bytes"]["total"]
    if data["sections"]["offload"]["status"] == "ok":
        assert figures["offload"]["variants"]["default"]["byte_exact"] is True
    if data["sections"]["correctness"]["status"] == "ok":
        assert figures["correctness"]["counts"]["failed"] == 0
    # a CPU's figures at tiny sizes say nothing about a GPU: no target is judged
    assert {t["name"] for t in data["targets"]} >= {"one session fps", "batch 4 latency", "engine overhead"}
    assert all(t["met"] is None for t in data["targets"])


def test_the_batch_4_target_is_the_builtin_h100_profiles_slo():
    assert BUILTIN_PROFILES["h100-1.3b"].default_slo_ms == sections.H100_1_3B_SLO_MS
    assert BUILTIN_PROFILES["h100-1.3b"].price_per_hour == sections.H100_1_3B_PRICE_PER_HOUR
    assert BUILTIN_PROFILES["h100-1.3b"].provisioning_delay_s == sections.H100_1_3B_PROVISIONING_DELAY_S


# -- the report and its budget ----------------------------------------------------------------------


def make_report(tmp_path, total_s=100.0):
    report = gc_report.Report(tmp_path, mode="dry", budget=gc_report.Budget(total_s))
    report.plan([("a", "first"), ("b", "second"), ("c", "third")])
    return report


def test_a_failing_section_is_recorded_and_the_next_one_still_runs(tmp_path):
    report = make_report(tmp_path)

    def broken(figures):
        figures["partial"] = 1
        raise ValueError("boom")

    assert report.run_section("a", broken) is False
    assert report.run_section("b", lambda figures: figures.update(x=2)) is True
    data = json.loads((tmp_path / gc_report.JSON_NAME).read_text())
    assert data["sections"]["a"]["status"] == "failed" and "boom" in data["sections"]["a"]["reason"]
    assert data["sections"]["a"]["figures"]["partial"] == 1 and data["sections"]["a"]["figures"]["traceback"]
    assert data["sections"]["b"] == {
        "title": "second",
        "status": "ok",
        "seconds": pytest.approx(0, abs=1),
        "figures": {"x": 2},
    }
    assert data["failed"] == [{"section": "a", "reason": "ValueError: boom"}]


def test_sections_are_skipped_with_a_reason_when_the_budget_or_a_prerequisite_is_missing(tmp_path):
    report = make_report(tmp_path, total_s=10.0)
    ran = []
    assert report.run_section("a", ran.append, needs_s=60.0) is False
    assert report.run_section("b", ran.append, requires=("a",)) is False
    report.run_section("c", lambda figures: (_ for _ in ()).throw(gc_report.SectionSkipped("no GPU here")))
    assert ran == []
    data = json.loads((tmp_path / gc_report.JSON_NAME).read_text())
    reasons = {s["section"]: s["reason"] for s in data["skipped"]}
    assert "time budget" in reasons["a"] and "needs ≈ 60 s" in reasons["a"]
    assert reasons["b"] == "needs section 'a', which is skipped"
    assert reasons["c"] == "no GPU here"
    assert "c [skipped]" in (tmp_path / gc_report.TEXT_NAME).read_text()


def test_non_finite_figures_are_written_as_null(tmp_path):
    report = make_report(tmp_path)
    report.run_section("a", lambda figures: figures.update(nan=float("nan"), inf=[float("inf")]))
    data = json.loads((tmp_path / gc_report.JSON_NAME).read_text())
    assert data["sections"]["a"]["figures"] == {"nan": None, "inf": [None]}


def test_latency_summary_has_the_benchmarks_keys():
    assert gc_report.summarize_ms([3.0, 1.0, 2.0]) == {
        "count": 3,
        "p50": 2.0,
        "p99": 2.98,
        "max": 3.0,
        "mean": 2.0,
    }
    assert gc_report.summarize_ms([])["p50"] is None


# -- carried wheels ---------------------------------------------------------------------------------


def write_wheel(
    folder: Path, name: str, version: str, tags: str = "py3-none-any", module: str | None = None
) -> Path:
    path = folder / f"{name}-{version}-{tags}.whl"
    module = module or name
    with zipfile.ZipFile(path, "w") as archive:
        archive.writestr(f"{module}/__init__.py", f"VERSION = {version!r}\n")
        archive.writestr(
            f"{name}-{version}.dist-info/METADATA",
            f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n",
        )
        archive.writestr(f"{name}-{version}.dist-info/RECORD", "")
    return path


def test_a_carried_wheel_the_machine_lacks_is_unpacked_and_importable(tmp_path, monkeypatch):
    monkeypatch.setattr(sys, "path", list(sys.path))
    folder = tmp_path / "wheels"
    folder.mkdir()
    write_wheel(folder, "gpucheck_probe_pkg", "1.2.3")
    entries = wheels.use_carried_wheels(folder, tmp_path / "site")
    assert entries == [
        {
            "wheel": "gpucheck_probe_pkg-1.2.3-py3-none-any.whl",
            "distribution": "gpucheck-probe-pkg",
            "version": "1.2.3",
            "action": "unpacked",
        }
    ]
    assert sys.path[-1] == str(tmp_path / "site")
    import gpucheck_probe_pkg

    assert gpucheck_probe_pkg.VERSION == "1.2.3"
    assert wheels.installed_version("gpucheck-probe-pkg") == "1.2.3"
    sys.modules.pop("gpucheck_probe_pkg", None)


def test_a_wheel_the_machine_has_or_cannot_load_is_left_alone(tmp_path):
    folder = tmp_path / "wheels"
    folder.mkdir()
    write_wheel(folder, "numpy", "0.0.1", module="numpy_not_used")
    write_wheel(folder, "gpucheck_other_pkg", "1.0", tags="cp27-cp27mu-manylinux1_x86_64")
    write_wheel(folder, "gpucheck_win_pkg", "1.0", tags="py3-none-win_amd64")
    entries = {e["distribution"]: e for e in wheels.use_carried_wheels(folder, tmp_path / "site")}
    assert entries["numpy"]["action"] == "present" and "the machine has numpy" in entries["numpy"]["reason"]
    assert (
        entries["gpucheck-other-pkg"]["action"] == "unusable"
        and "cp27" in entries["gpucheck-other-pkg"]["reason"]
    )
    assert entries["gpucheck-win-pkg"]["action"] == "unusable"
    assert not (tmp_path / "site").exists()


@pytest.mark.parametrize(
    ("filename", "fits"),
    [
        ("diffusers-0.42.1-py3-none-any.whl", True),
        ("pillow-13.0.0-cp312-cp312-manylinux_2_27_x86_64.manylinux_2_28_x86_64.whl", True),
        ("psutil-7.2.2-cp36-abi3-manylinux2014_x86_64.whl", True),
        ("pillow-13.0.0-cp311-cp311-manylinux_2_28_x86_64.whl", False),
        ("pillow-13.0.0-cp312-cp312-manylinux_2_28_aarch64.whl", False),
    ],
)
def test_wheel_tags_are_matched_to_the_machine_the_check_runs_on(filename, fits):
    parts = wheels.parse_wheel_name(filename)
    assert parts is not None
    assert (wheels.wheel_fits(parts, version=(3, 12), machine="x86_64") is None) is fits
