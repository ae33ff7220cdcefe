"""The co-serving rule (contracts/coserve.py): how long a job step may take beside streams."""

from __future__ import annotations

import math
import random

import pytest

from contracts.coserve import StreamDemand, job_step_fits, stream_slack_s


def test_with_no_stream_a_job_step_of_any_length_fits():
    assert stream_slack_s([], now=5.0) == math.inf
    assert job_step_fits(1e6, math.inf)


def test_the_slack_is_the_tightest_deadline_after_every_earlier_chunk_has_run():
    # Given four streams on staggered phases, 10 ms of generation each, due within the next 0.5 s
    streams = [StreamDemand(finish_by=t, generation_s=0.01) for t in (0.5, 0.125, 0.375, 0.25)]
    # Then served EDF after the step, the first chunk has 0.125 - 0.01 left; the fourth 0.5 - 0.04
    assert stream_slack_s(streams, now=0.0) == pytest.approx(0.115)
    # And close deadlines count every chunk queued before: 0.1 - 0.09 for the third
    bunched = [StreamDemand(finish_by=0.1, generation_s=0.03) for _ in range(3)]
    assert stream_slack_s(bunched, now=0.0) == pytest.approx(0.01)


def test_a_chunk_already_short_of_time_leaves_no_slack_and_nothing_fits():
    late = [StreamDemand(finish_by=1.0, generation_s=0.2)]
    assert stream_slack_s(late, now=0.9) == 0.0
    assert not job_step_fits(0.0001, 0.0)
    assert not job_step_fits(None, 0.0)


def test_a_step_fits_within_the_slack_and_an_unmeasured_one_needs_the_probe():
    assert job_step_fits(0.05, 0.05) and not job_step_fits(0.051, 0.05)
    assert not job_step_fits(None, 0.1, probe_s=0.2)
    assert job_step_fits(None, 0.2, probe_s=0.2)


def test_a_step_that_fits_the_slack_never_makes_a_chunk_end_after_its_deadline():
    # Property: insert the step now, then serve the chunks EDF; no chunk ends after finish_by when
    # every chunk could before (random staggered streams)
    rng = random.Random(32)
    for _ in range(500):
        now = rng.uniform(0, 10)
        streams = [
            StreamDemand(finish_by=now + rng.uniform(0.0, 1.0), generation_s=rng.uniform(0.0, 0.1))
            for _ in range(rng.randint(1, 8))
        ]
        slack = stream_slack_s(streams, now=now)
        end = now + slack  # the longest step the rule allows
        for demand in sorted(streams, key=lambda d: d.finish_by):
            end += demand.generation_s
            if slack > 0:
                assert end <= demand.finish_by + 1e-9
