"""The soak's comparison of what its clients saw: chunks generated while a viewer was away (between
two connections of one client) are counted apart, not as skips."""

from __future__ import annotations

import time

import pytest

from scheduling.benchmarks.soak import ClientLog, _compare
from tests.factories import SessionFactory

pytestmark = pytest.mark.django_db(transaction=True)  # _compare closes stale connections, as the soak does


def test_a_gap_between_connections_is_missed_while_away_and_one_inside_is_a_skip():
    session = SessionFactory()
    log = ClientLog(session=str(session.pk), indices=[0, 1, 2, 10, 11, 13], connections=[0, 3], leaves=1)

    report = _compare([log], since=time.time())

    assert report["missed_while_away"] == 7  # 3..9: the viewer was away
    assert report["skips"] == 1  # 12: lost on an open connection
    assert report["viewer_leaves"] == 1
    assert report["idle_reasons"] == {}


def test_one_connection_counts_as_before():
    session = SessionFactory()
    log = ClientLog(session=str(session.pk), indices=[0, 1, 3], connections=[0])

    report = _compare([log], since=time.time())

    assert (report["skips"], report["missed_while_away"]) == (1, 0)


def test_the_rss_slope_leaves_out_the_warm_up_and_reads_megabytes_per_minute():
    from scheduling.benchmarks.soak import rss_slope

    # Given a process that grows 50 MB in its first minute (warm-up), then 1 MB per minute
    points = [[0.0, 100.0], [30.0, 130.0], [60.0, 150.0]] + [
        [60.0 + 30 * k, 150.0 + 0.5 * k] for k in range(1, 9)
    ]
    # Then the slope after the warm-up is the steady growth, and the whole run's is far steeper
    assert rss_slope(points, since_s=60.0) == pytest.approx(1.0)
    assert rss_slope(points, since_s=0.0) > 5.0
    # and fewer than three samples after the warm-up give no slope
    assert rss_slope(points, since_s=270.0) is None
