"""reproduce_paper: a --quick smoke run writes the report with our figures beside the paper's.

No assertion on the figures' values: the quick run shrinks every input, so they mean nothing.
"""

from __future__ import annotations

import io
import json

import pytest
from django.core.management import call_command
from django.core.management.base import CommandError

from scheduling.core.generators import table7_windows
from scheduling.core.profiles import BUILTIN_PROFILES
from scheduling.core.simulator import SimConfig, simulate
from scheduling.reproduce.experiments import EXPERIMENTS, demand_shape, plan, truncate
from scheduling.reproduce.policies import WindowRhoPolicy

PNGS = (
    "fig4_motivation.png",
    "fig7_end_to_end.png",
    "fig8_ablation.png",
    "fig9_scheduler.png",
    "table2_autoscaling_oracle.png",
    "tables8_10_rho_oracle.png",
    "sweep_dependencies.png",
    "fig7_by_delay.png",
)


@pytest.fixture(scope="module")
def quick_report(tmp_path_factory):
    out = tmp_path_factory.mktemp("results")
    stdout = io.StringIO()
    call_command(
        "reproduce_paper",
        out=str(out),
        quick=True,
        jobs=1,
        no_progress=True,
        stdout=stdout,
        stderr=io.StringIO(),
    )
    return out, stdout.getvalue()


def test_quick_run_writes_report_json_and_charts(quick_report):
    out, stdout = quick_report
    assert "README.md" in stdout
    for name in ("README.md", "results.json", *PNGS):
        path = out / name
        assert path.exists() and path.stat().st_size > 0, name
        if name.endswith(".png"):
            assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    data = json.loads((out / "results.json").read_text())
    assert data["meta"]["quick"] is True
    assert set(data["paper"]) >= {"fig4", "fig7", "fig8", "fig9", "table2", "table6", "tables8_10"}
    errors = {k: v["error"] for k, v in data["units"].items() if v.get("error")}
    assert not errors
    assert {u.key for u in plan(quick=True, seed=0)} == set(data["units"])


def test_report_puts_our_figures_beside_the_papers(quick_report):
    out, _ = quick_report
    text = (out / "README.md").read_text()
    data = json.loads((out / "results.json").read_text())
    for section in (
        "Fig. 4",
        "Fig. 7",
        "Fig. 8",
        "Fig. 9",
        "Table 2",
        "Tables 5–6",
        "Tables 7–10",
        "provisioning delay",
        "The whole Fig. 7 grid at shorter provisioning delays",
    ):
        assert section in text, section
    # Fig. 4: our A1 row carries our worst latency and the paper's −26.53 %.
    a1 = next(line for line in text.splitlines() if line.startswith("| A1"))
    assert f"{data['units']['fig4']['rows']['migration']['worst_ms']:,.0f} ms" in a1
    assert "-26.53 %" in a1
    # Fig. 7 averages: ours and the paper's 37.5 / 37.2 on one row each.
    lat = next(line for line in text.splitlines() if line.startswith("| worst-case latency at matched cost"))
    assert "37.5 %" in lat
    assert "3.6 % / 6.5 %" in text  # Fig. 9 gap, paper
    assert "3721.93" in text and "+0.73 %" in text  # Table 9, paper
    for png in PNGS:
        assert f"({png})" in text


def test_fig7_grid_is_rerun_with_only_the_provisioning_delay_replaced(quick_report):
    out, _ = quick_report
    data = json.loads((out / "results.json").read_text())
    unit = data["units"]["fig7delay/T1/h20-1.3b/0"]
    own = data["units"]["fig7/T1/h20-1.3b"]
    assert unit["provisioning_delay_s"] == 0.0 and own["provisioning_delay_s"] == 30.0
    # Same trace and SLO; the static baselines' pool is there from t = 0, so the delay cannot move them.
    assert unit["slo_ms"] == own["slo_ms"] and unit["events"] == own["events"]
    for b in ("base", "lag", "mag"):
        assert unit["policies"][b]["cost_at_slo_usd"] == own["policies"][b]["cost_at_slo_usd"]
    by_delay = data["summary"]["fig7_by_delay"]
    assert set(by_delay) == {"0", "profile"}
    assert by_delay["0"]["units"] == 1 and by_delay["profile"]["units"] == 1
    expected = unit["reduction_vs"]["lag"]["cost_pct"]
    costs = [unit["reduction_vs"][b]["cost_pct"] for b in ("base", "lag", "mag")]
    costs = [c for c in costs if c is not None]
    assert by_delay["0"]["cost_reduction_mean_pct"] == pytest.approx(sum(costs) / len(costs), abs=0.01)
    text = (out / "README.md").read_text()
    instant = next(line for line in text.splitlines() if "instant GPU attach" in line)
    assert "37.5 % / 37.2 %" in instant
    row = next(line for line in text.splitlines() if line.startswith("| T1 | h20-1.3b | 0 s |"))
    assert (f"{expected:+.1f} %" if expected is not None else "–") in row


def test_bad_experiment_name_names_the_flag():
    with pytest.raises(CommandError, match="--experiments"):
        call_command(
            "reproduce_paper", out="/tmp/never", quick=True, experiments="fig99", stdout=io.StringIO()
        )
    assert "fig7" in EXPERIMENTS


def test_window_rho_policy_switches_target_by_window():
    _meta, events = truncate(*table7_windows(0), 60.0)
    policy = WindowRhoPolicy(rhos=[0.5, 0.95], window_s=30.0)
    cfg = SimConfig(profiles=[BUILTIN_PROFILES["paper-k5"]], initial_gpus=4, max_gpus=16, duration_s=60.0)
    simulate(events, policy, cfg)
    first = {r for t, r, *_ in policy.trail if t < 30.0}
    second = {r for t, r, *_ in policy.trail if t >= 30.0}
    assert first == {0.5} and second == {0.95}


def test_truncate_and_demand_shape():
    meta, events = truncate(*table7_windows(0), 30.0)
    assert meta["duration_s"] == 30.0 and all(e.t < 30.0 for e in events)
    shape = demand_shape(events, 30.0)
    assert shape["peak_active"] == 38  # Table 7, w1 maximum (exact by construction)
    assert shape["mean_active"] == pytest.approx(32.0, abs=0.01)


def test_other_seed_summaries_appear_in_the_report(quick_report, tmp_path):
    from scheduling.reproduce.report import write_report
    from scheduling.reproduce.runner import export_summary

    out, _ = quick_report
    data = json.loads((out / "results.json").read_text())
    other = tmp_path / "seed7"
    other.mkdir()
    copy = {**data, "meta": {**data["meta"], "seed": 7}}
    (other / "results.json").write_text(json.dumps(copy))
    report_dir = tmp_path / "report"
    report_dir.mkdir()
    path = export_summary(other, report_dir)
    assert path.name == "seed-7-quick.json"
    write_report(report_dir, data)
    text = (report_dir / "README.md").read_text()
    assert "## Seed sensitivity" in text
    assert any(line.startswith("| 7 |") for line in text.splitlines())
    assert any(line.startswith("| 0 (this report) |") for line in text.splitlines())
