"""What ``runplatform`` prints at start: reconcile's findings and actions in one line (issue 31)."""

from __future__ import annotations

from gpu.provisioners.base import FailedWorker, ReconcileResult, WorkerRef


def test_the_summary_names_what_was_found_and_what_was_done():
    ref = WorkerRef(id=1, name="local-cpu-1", device="cpu", gpu_type="cpu", external_id="4242:1.0")
    result = ReconcileResult(
        provider="local",
        checked=3,
        failed=[FailedWorker(worker=ref, was="ready", reason="process gone")],
        stopped_orphans=["pid 4242 (local-cpu-9)"],
    )
    summary = result.summary()
    assert summary.startswith("reconcile local: 3 worker row(s) checked")
    assert "failed local-cpu-1 (ready: process gone)" in summary
    assert "stopped stray process(es) no row tracks pid 4242 (local-cpu-9)" in summary


def test_a_clean_start_says_there_was_nothing_to_do():
    assert (
        ReconcileResult(provider="local").summary()
        == "reconcile local: 0 worker row(s) checked; nothing to do"
    )
