"""The owner probe can fail: fed what a second owner looks like, it says so (no services needed)."""

from __future__ import annotations

import pytest

from tests.e2e.chaos import OwnerProbe, Published

SID = "s"


def probe(samples: list[tuple[float, int]], published: list[Published]) -> OwnerProbe:
    p = OwnerProbe("redis://unused", [SID])
    p.samples[SID], p.published[SID] = samples, published
    return p


def ticks(until: float, lease_at) -> list[tuple[float, int]]:
    return [(t / 10, lease_at(t / 10)) for t in range(1, int(until * 10) + 1)]


def test_a_clean_handoff_passes():
    # a → b at t=1.0: a's last chunk under epoch 1, then b's under epoch 2 (the lease rose first)
    published = [Published(0.05 + 0.1 * i, "a", 1, i) for i in range(10)]
    published += [Published(1.05 + 0.1 * i, "b", 2, 10 + i) for i in range(20)]
    probe(ticks(3.0, lambda t: 1 if t < 1.0 else 2), published).assert_one_owner()


def test_a_fenced_worker_that_keeps_publishing_fails():
    # a was fenced out at t=1.0 (lease 2) but publishes under epoch 1 until t=2.5
    published = [Published(0.05 + 0.1 * i, "a", 1, i) for i in range(25)]
    published += [Published(1.07 + 0.1 * i, "b", 2, 10 + i) for i in range(20)]
    with pytest.raises(AssertionError, match="published after being fenced out"):
        probe(ticks(3.0, lambda t: 1 if t < 1.0 else 2), published).assert_one_owner()


def test_two_workers_under_one_epoch_fail():
    published = [Published(0.05 + 0.1 * i, "a", 1, i) for i in range(20)]
    published += [Published(0.06 + 0.1 * i, "b", 1, i) for i in range(20)]
    with pytest.raises(AssertionError, match="several publishers"):
        probe(ticks(2.5, lambda t: 1), published).assert_one_owner()


def test_a_probe_that_saw_nothing_fails():
    with pytest.raises(AssertionError, match="saw nobody publish"):
        probe(ticks(3.0, lambda t: 1), []).assert_one_owner()
