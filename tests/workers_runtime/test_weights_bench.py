"""bench_scaleout: a well-formed report from real processes (figures are printed, never asserted)."""

from __future__ import annotations

import pytest
from django.core.management import CommandError, call_command

from workers.benchmarks.scaleout import format_scaleout, run_scaleout


def test_report_has_every_source_and_ready_workers_step_exactly(tmp_path):
    report = run_scaleout(
        "tiny",
        targets=(1, 2),
        repeats=1,
        warmup=0,
        link_mbps=400,
        workdir=str(tmp_path),
        progress=lambda _: None,
    )
    assert set(report["sources"]) == {"disk", "disk_warm", "host_cache", "peer_chain", "peer_sequential"}
    for source in report["sources"].values():
        assert set(source["by_targets"]) == {"1", "2"}
        assert len(source["by_targets"]["2"]["per_target_s"]) == 2
        assert source["seconds"] == source["by_targets"]["2"]["seconds"] > 0
    chain = report["sources"]["peer_chain"]["by_targets"]["2"]
    # the second target of the chain took its weights from the first, not from the peer
    assert chain["sources_used"][1] != chain["sources_used"][0]
    assert report["sources"]["disk"]["by_targets"]["1"]["sources_used"] == ["disk"]
    assert report["frames_match_reference"] is True
    assert report["chain_vs_single"] > 0 and report["chain_speedup_vs_sequential"] > 0
    assert report["projection"]["weights_bytes"] > report["weights_bytes"]
    # the scale planner, given the paced links, plans the chain the bench ran
    assert report["planner"]["chains"] == [["peer", "T1", "T2"]]
    assert report["planner"]["expected_ready_s"][0] <= report["planner"]["expected_ready_s"][1]
    assert "chain_vs_single" in format_scaleout(report)
    assert not list(tmp_path.iterdir())  # the weights file is removed


def test_command_rejects_bad_flags():
    with pytest.raises(CommandError, match="--targets"):
        call_command("bench_scaleout", "--targets", "a,b")
    with pytest.raises(CommandError, match="--link-mbps"):
        call_command("bench_scaleout", "--preset", "tiny", "--link-mbps", "-1")
    with pytest.raises(CommandError, match="--sources"):
        call_command("bench_scaleout", "--preset", "tiny", "--sources", "carrier-pigeon")
